//! Local training: mini-batch SGD with optional momentum, weight decay and
//! the FedProx proximal term (Li et al., MLSys 2020), for E epochs with
//! batch size B, deterministic for a seed.
//!
//! Per step, with g the mean gradient of the batch loss:
//! g ← g + λ w + μ (w − w_global); v ← β v + g; w ← w − η v.

use ndarray::{ArrayView2, Axis};
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::model::Differentiable;

/// Local training hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainConfig {
    /// Passes over the local data (E).
    pub epochs: usize,
    /// Examples per step (B).
    pub batch_size: usize,
    /// Learning rate η.
    pub learning_rate: f32,
    /// Momentum β (0: plain SGD).
    pub momentum: f32,
    /// L2 weight decay λ.
    pub weight_decay: f32,
    /// FedProx proximal coefficient μ (0: FedAvg).
    pub prox_mu: f32,
    /// Seed of the example order.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            epochs: 1,
            batch_size: 10,
            learning_rate: 0.05,
            momentum: 0.0,
            weight_decay: 0.0,
            prox_mu: 0.0,
            seed: 0,
        }
    }
}

/// Why local training was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A hyper-parameter is out of range.
    #[error("invalid training parameter: {0}")]
    Parameter(&'static str),
    /// Data and model disagree.
    #[error("shape mismatch: {0}")]
    Shape(&'static str),
    /// Training diverged.
    #[error("training diverged (non-finite loss)")]
    Diverged,
}

/// What local training did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrainReport {
    /// Mean batch loss over the last epoch.
    pub loss: f32,
    /// Local examples.
    pub examples: usize,
    /// Optimizer steps taken.
    pub steps: usize,
}

/// Trains `params` in place on `(x, labels)`; `global` is the round's
/// global model (for the proximal term).
pub fn train<M: Differentiable + ?Sized>(
    model: &M,
    params: &mut [f32],
    global: &[f32],
    x: ArrayView2<'_, f32>,
    labels: &[u8],
    config: &TrainConfig,
) -> Result<TrainReport, TrainError> {
    if config.epochs == 0 || config.batch_size == 0 {
        return Err(TrainError::Parameter("epochs and batch_size must be at least 1"));
    }
    let rates_valid = config.learning_rate.is_finite()
        && config.learning_rate > 0.0
        && [config.momentum, config.weight_decay, config.prox_mu].iter().all(|v| v.is_finite() && *v >= 0.0)
        && config.momentum < 1.0;
    if !rates_valid {
        return Err(TrainError::Parameter("learning_rate must be > 0, momentum in [0, 1), decay and mu ≥ 0"));
    }
    if params.len() != model.parameters() || global.len() != model.parameters() {
        return Err(TrainError::Shape("parameters do not match the model"));
    }
    if x.nrows() != labels.len() || x.ncols() != model.inputs() || labels.is_empty() {
        return Err(TrainError::Shape("data do not match the model's input or labels"));
    }
    let mut rng = ChaCha20Rng::seed_from_u64(config.seed);
    let mut order: Vec<usize> = (0..labels.len()).collect();
    let mut grad = vec![0.0f32; params.len()];
    let mut velocity = vec![0.0f32; params.len()];
    let mut steps = 0;
    let mut epoch_loss = 0.0;
    for _ in 0..config.epochs {
        order.shuffle(&mut rng);
        let mut total = 0.0f64;
        let mut batches = 0usize;
        for batch in order.chunks(config.batch_size) {
            let xb = x.select(Axis(0), batch);
            let yb: Vec<u8> = batch.iter().map(|&i| labels[i]).collect();
            let loss = model.loss_and_gradient(params, xb.view(), &yb, &mut grad);
            if !loss.is_finite() {
                return Err(TrainError::Diverged);
            }
            total += f64::from(loss);
            batches += 1;
            for (((w, g), v), w0) in params.iter_mut().zip(&grad).zip(velocity.iter_mut()).zip(global) {
                let g = g + config.weight_decay * *w + config.prox_mu * (*w - w0);
                *v = config.momentum * *v + g;
                *w -= config.learning_rate * *v;
            }
            steps += 1;
        }
        epoch_loss = (total / batches as f64) as f32;
    }
    if params.iter().any(|w| !w.is_finite()) {
        return Err(TrainError::Diverged);
    }
    Ok(TrainReport { loss: epoch_loss, examples: labels.len(), steps })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;
    use rand_core::Rng;

    use crate::model::{Mlp, Model};

    /// Three Gaussian blobs in 4 dimensions, linearly separable.
    fn blobs(n: usize, seed: u64) -> (Array2<f32>, Vec<u8>) {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut noise = || ((rng.next_u32() as f32 / u32::MAX as f32) - 0.5) * 0.8;
        let labels: Vec<u8> = (0..n).map(|i| (i % 3) as u8).collect();
        let x = Array2::from_shape_fn(
            (n, 4),
            |(i, j)| if j == usize::from(labels[i]) { 1.0 } else { 0.0 } + noise(),
        );
        (x, labels)
    }

    #[test]
    fn sgd_learns_separable_data() {
        let model = Model::Mlp(Mlp { widths: vec![4, 3] });
        let (x, y) = blobs(300, 1);
        let mut params = model.init(1);
        let global = params.clone();
        let (before_loss, before_acc) = model.evaluate(&params, x.view(), &y);
        let config = TrainConfig {
            epochs: 5,
            batch_size: 10,
            learning_rate: 0.5,
            momentum: 0.5,
            ..TrainConfig::default()
        };
        let report = train(&model, &mut params, &global, x.view(), &y, &config).unwrap();
        assert_eq!((report.examples, report.steps), (300, 150));
        let (loss, accuracy) = model.evaluate(&params, x.view(), &y);
        assert!(loss < before_loss && accuracy > 0.95, "{before_acc} -> {accuracy}, {before_loss} -> {loss}");
    }

    #[test]
    fn the_two_layer_network_learns_too() {
        let model = Model::Mlp(Mlp { widths: vec![4, 16, 16, 3] });
        let (x, y) = blobs(300, 2);
        let mut params = model.init(2);
        let global = params.clone();
        let config = TrainConfig { epochs: 10, batch_size: 10, learning_rate: 0.1, ..TrainConfig::default() };
        train(&model, &mut params, &global, x.view(), &y, &config).unwrap();
        assert!(model.evaluate(&params, x.view(), &y).1 > 0.95);
    }

    #[test]
    fn training_is_deterministic_for_a_seed() {
        let model = Model::Mlp(Mlp { widths: vec![4, 3] });
        let (x, y) = blobs(60, 3);
        let run = |seed| {
            let mut params = model.init(0);
            let global = params.clone();
            train(
                &model,
                &mut params,
                &global,
                x.view(),
                &y,
                &TrainConfig { seed, ..TrainConfig::default() },
            )
            .unwrap();
            params
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5), run(6));
    }

    #[test]
    fn the_proximal_term_keeps_weights_near_the_global_model() {
        let model = Model::Mlp(Mlp { widths: vec![4, 3] });
        let (x, y) = blobs(120, 4);
        let global = model.init(9);
        let drift = |prox_mu| {
            let mut params = global.clone();
            let config = TrainConfig { epochs: 3, learning_rate: 0.2, prox_mu, ..TrainConfig::default() };
            train(&model, &mut params, &global, x.view(), &y, &config).unwrap();
            params.iter().zip(&global).map(|(a, b)| (a - b).powi(2)).sum::<f32>().sqrt()
        };
        assert!(drift(1.0) < 0.8 * drift(0.0), "{} vs {}", drift(1.0), drift(0.0));
    }

    #[test]
    fn bad_configurations_and_shapes_are_refused() {
        let model = Model::Mlp(Mlp { widths: vec![4, 3] });
        let (x, y) = blobs(10, 5);
        let mut params = model.init(0);
        let global = params.clone();
        for config in [
            TrainConfig { epochs: 0, ..TrainConfig::default() },
            TrainConfig { batch_size: 0, ..TrainConfig::default() },
            TrainConfig { learning_rate: 0.0, ..TrainConfig::default() },
            TrainConfig { momentum: 1.0, ..TrainConfig::default() },
            TrainConfig { prox_mu: -1.0, ..TrainConfig::default() },
        ] {
            assert!(matches!(
                train(&model, &mut params, &global, x.view(), &y, &config),
                Err(TrainError::Parameter(_))
            ));
        }
        let config = TrainConfig::default();
        assert!(matches!(
            train(&model, &mut params, &global, x.view(), &y[..5], &config),
            Err(TrainError::Shape(_))
        ));
        assert!(matches!(
            train(&model, &mut params[..3], &global, x.view(), &y, &config),
            Err(TrainError::Shape(_))
        ));
        // Corrupt features make the loss non-finite: refused, not uploaded.
        let mut corrupt = x.clone();
        corrupt[[3, 1]] = f32::NAN;
        assert_eq!(
            train(&model, &mut params, &global, corrupt.view(), &y, &config),
            Err(TrainError::Diverged)
        );
    }
}
