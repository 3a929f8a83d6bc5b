//! Server optimizers: how the coordinator turns the round's weighted mean
//! update into new global weights.
//!
//! Clients send Δ_k = w_k − w (local minus global weights); secure
//! aggregation yields the weighted mean Δ = Σ n_k Δ_k / Σ n_k. Following
//! Reddi et al., *Adaptive Federated Optimization* (ICLR 2021), the server
//! treats Δ as a pseudo-gradient (pointing downhill) and applies:
//!
//! * **FedAvg**: w ← w + η Δ (η = 1 is plain federated averaging);
//! * **FedAvgM**: v ← β v + Δ, w ← w + η v (server momentum);
//! * **FedAdam**: m ← β₁ m + (1 − β₁) Δ, v ← β₂ v + (1 − β₂) Δ²,
//!   w ← w + η m / (√v + τ);
//! * **FedYogi**: as FedAdam but v ← v − (1 − β₂) Δ² sign(v − Δ²), which
//!   lets v shrink additively rather than multiplicatively.
//!
//! As in the paper, the adaptive methods start with v = τ² and apply no bias
//! correction. The optimizer state is plain data, persisted with every
//! completed round so that a restarted coordinator continues exactly.

use serde::{Deserialize, Serialize};

/// Largest learning rate and τ a task may set.
pub const MAX_PARAMETER: f32 = 1000.0;

/// A server optimizer and its hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum ServerOptimizer {
    /// w ← w + η Δ.
    FedAvg {
        /// Server learning rate η.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        learning_rate: f32,
    },
    /// Server momentum.
    FedAvgM {
        /// Server learning rate η.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        learning_rate: f32,
        /// Momentum β.
        #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
        momentum: f32,
    },
    /// Adam on the server.
    FedAdam {
        /// Server learning rate η.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        learning_rate: f32,
        /// First-moment decay β₁.
        #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
        beta1: f32,
        /// Second-moment decay β₂.
        #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
        beta2: f32,
        /// Adaptivity τ.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        tau: f32,
    },
    /// Yogi on the server.
    FedYogi {
        /// Server learning rate η.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        learning_rate: f32,
        /// First-moment decay β₁.
        #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
        beta1: f32,
        /// Second-moment decay β₂.
        #[schema(minimum = 0.0, exclusive_maximum = 1.0)]
        beta2: f32,
        /// Adaptivity τ.
        #[schema(exclusive_minimum = 0.0, maximum = 1000.0)]
        tau: f32,
    },
}

impl Default for ServerOptimizer {
    fn default() -> Self {
        ServerOptimizer::FedAvg { learning_rate: 1.0 }
    }
}

/// Why an optimizer step was refused. The weights are left untouched.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimizerError {
    /// A hyper-parameter is out of range.
    #[error("invalid optimizer parameter: {0}")]
    Parameter(&'static str),
    /// The update, weights and state disagree in length.
    #[error("update has {update} coordinates, the model {weights}, the optimizer state {state}")]
    Length {
        /// Coordinates in the update.
        update: usize,
        /// Coordinates in the model.
        weights: usize,
        /// Coordinates in the optimizer state.
        state: usize,
    },
    /// The update holds NaN or an infinity.
    #[error("update has a non-finite value at coordinate {0}")]
    NonFinite(usize),
}

/// The optimizer's moments, persisted between rounds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OptimizerState {
    /// Steps taken.
    pub step: u64,
    /// Momentum (FedAvgM) or first moment (FedAdam, FedYogi); empty for FedAvg.
    pub first_moment: Vec<f32>,
    /// Second moment (FedAdam, FedYogi); empty otherwise.
    pub second_moment: Vec<f32>,
}

impl ServerOptimizer {
    /// Checks the hyper-parameters.
    pub fn validate(&self) -> Result<(), OptimizerError> {
        // Bounded, not only finite: τ² and η times an update must stay
        // finite in f32 (a τ of 2·10¹⁹ squares to infinity).
        let positive = |value: f32, what| {
            if value > 0.0 && value <= MAX_PARAMETER { Ok(()) } else { Err(OptimizerError::Parameter(what)) }
        };
        let decay = |value: f32, what| {
            if (0.0..1.0).contains(&value) { Ok(()) } else { Err(OptimizerError::Parameter(what)) }
        };
        match *self {
            ServerOptimizer::FedAvg { learning_rate } => {
                positive(learning_rate, "learning_rate must be in (0, 1000]")
            }
            ServerOptimizer::FedAvgM { learning_rate, momentum } => {
                positive(learning_rate, "learning_rate must be in (0, 1000]")?;
                decay(momentum, "momentum must be in [0, 1)")
            }
            ServerOptimizer::FedAdam { learning_rate, beta1, beta2, tau }
            | ServerOptimizer::FedYogi { learning_rate, beta1, beta2, tau } => {
                positive(learning_rate, "learning_rate must be in (0, 1000]")?;
                decay(beta1, "beta1 must be in [0, 1)")?;
                decay(beta2, "beta2 must be in [0, 1)")?;
                positive(tau, "tau must be in (0, 1000]")
            }
        }
    }

    /// The state before the first step, for a model of `len` coordinates.
    pub fn initial_state(&self, len: usize) -> OptimizerState {
        let (first, second) = match *self {
            ServerOptimizer::FedAvg { .. } => (Vec::new(), Vec::new()),
            ServerOptimizer::FedAvgM { .. } => (vec![0.0; len], Vec::new()),
            ServerOptimizer::FedAdam { tau, .. } | ServerOptimizer::FedYogi { tau, .. } => {
                (vec![0.0; len], vec![tau * tau; len])
            }
        };
        OptimizerState { step: 0, first_moment: first, second_moment: second }
    }

    /// Applies one step with the round's mean update. Validates everything
    /// first; on error neither `weights` nor `state` changes.
    pub fn step(
        &self,
        weights: &mut [f32],
        update: &[f32],
        state: &mut OptimizerState,
    ) -> Result<(), OptimizerError> {
        self.validate()?;
        let expected = self.initial_state(weights.len());
        if update.len() != weights.len()
            || state.first_moment.len() != expected.first_moment.len()
            || state.second_moment.len() != expected.second_moment.len()
        {
            return Err(OptimizerError::Length {
                update: update.len(),
                weights: weights.len(),
                state: state.first_moment.len().max(state.second_moment.len()),
            });
        }
        if let Some(bad) = update.iter().position(|u| !u.is_finite()) {
            return Err(OptimizerError::NonFinite(bad));
        }
        match *self {
            ServerOptimizer::FedAvg { learning_rate } => {
                for (w, d) in weights.iter_mut().zip(update) {
                    *w += learning_rate * d;
                }
            }
            ServerOptimizer::FedAvgM { learning_rate, momentum } => {
                for ((w, d), v) in weights.iter_mut().zip(update).zip(&mut state.first_moment) {
                    *v = momentum * *v + d;
                    *w += learning_rate * *v;
                }
            }
            ServerOptimizer::FedAdam { learning_rate, beta1, beta2, tau }
            | ServerOptimizer::FedYogi { learning_rate, beta1, beta2, tau } => {
                let yogi = matches!(self, ServerOptimizer::FedYogi { .. });
                let moments = state.first_moment.iter_mut().zip(state.second_moment.iter_mut());
                for ((w, &d), (m, v)) in weights.iter_mut().zip(update).zip(moments) {
                    let square = d * d;
                    *m = beta1 * *m + (1.0 - beta1) * d;
                    *v = if yogi {
                        *v - (1.0 - beta2) * square * (*v - square).signum()
                    } else {
                        beta2 * *v + (1.0 - beta2) * square
                    };
                    *w += learning_rate * *m / (v.sqrt() + tau);
                }
            }
        }
        state.step += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(optimizer: &ServerOptimizer, updates: &[&[f32]]) -> (Vec<f32>, OptimizerState) {
        let mut weights = vec![0.5f32; updates[0].len()];
        let mut state = optimizer.initial_state(weights.len());
        for update in updates {
            optimizer.step(&mut weights, update, &mut state).unwrap();
        }
        (weights, state)
    }

    #[test]
    fn fedavg_adds_the_scaled_mean_update() {
        let (w, state) = run(&ServerOptimizer::FedAvg { learning_rate: 1.0 }, &[&[0.25, -1.0]]);
        assert_eq!(w, vec![0.75, -0.5]);
        assert_eq!(state.step, 1);
        let (w, _) = run(&ServerOptimizer::FedAvg { learning_rate: 0.5 }, &[&[0.25, -1.0]]);
        assert_eq!(w, vec![0.625, 0.0]);
    }

    #[test]
    fn fedavgm_accumulates_momentum() {
        // v1 = 1, w = 0.5 + 0.1; v2 = 0.9 + 1 = 1.9, w += 0.19.
        let (w, state) =
            run(&ServerOptimizer::FedAvgM { learning_rate: 0.1, momentum: 0.9 }, &[&[1.0], &[1.0]]);
        assert!((w[0] - 0.79).abs() < 1e-6, "{w:?}");
        assert!((state.first_moment[0] - 1.9).abs() < 1e-6);
    }

    #[test]
    fn fedadam_first_step_matches_the_paper_formula() {
        // m = 0.1, v = 0.99·1e-6 + 0.01, step = 0.1 · 0.1 / (√v + 0.001) = 0.0990050.
        let adam = ServerOptimizer::FedAdam { learning_rate: 0.1, beta1: 0.9, beta2: 0.99, tau: 1e-3 };
        let (w, state) = run(&adam, &[&[1.0]]);
        assert!((w[0] - (0.5 + 0.099_005)).abs() < 1e-6, "{w:?}");
        assert!((state.first_moment[0] - 0.1).abs() < 1e-7);
        assert!((state.second_moment[0] / 0.010_000_99 - 1.0).abs() < 1e-6);
    }

    #[test]
    fn fedyogi_shrinks_the_second_moment_additively() {
        let (beta1, beta2, tau) = (0.9, 0.99, 1e-3);
        let adam = ServerOptimizer::FedAdam { learning_rate: 0.1, beta1, beta2, tau };
        let yogi = ServerOptimizer::FedYogi { learning_rate: 0.1, beta1, beta2, tau };
        let updates: [&[f32]; 2] = [&[1.0], &[0.01]];
        let (w_adam, adam_state) = run(&adam, &updates);
        let (w_yogi, yogi_state) = run(&yogi, &updates);
        // After a large then a small update, Adam's v decays by β₂ while
        // Yogi's only loses (1 − β₂)Δ²: Yogi keeps the larger v and so
        // takes the smaller second step.
        let v1 = tau * tau + (1.0 - beta2);
        assert!((yogi_state.second_moment[0] - (v1 - (1.0 - beta2) * 1e-4)).abs() < 1e-8);
        assert!(
            (adam_state.second_moment[0]
                - (beta2 * (beta2 * tau * tau + (1.0 - beta2)) + (1.0 - beta2) * 1e-4))
                .abs()
                < 1e-8
        );
        assert!(yogi_state.second_moment[0] > adam_state.second_moment[0]);
        assert!(w_yogi[0] < w_adam[0]);
    }

    #[test]
    fn bad_steps_change_nothing() {
        let adam = ServerOptimizer::FedAdam { learning_rate: 0.1, beta1: 0.9, beta2: 0.99, tau: 1e-3 };
        let mut weights = vec![1.0, 2.0];
        let mut state = adam.initial_state(2);
        let before = (weights.clone(), state.clone());
        assert!(matches!(adam.step(&mut weights, &[1.0], &mut state), Err(OptimizerError::Length { .. })));
        assert_eq!(adam.step(&mut weights, &[1.0, f32::NAN], &mut state), Err(OptimizerError::NonFinite(1)));
        let mut wrong_state = ServerOptimizer::FedAvg { learning_rate: 1.0 }.initial_state(2);
        assert!(adam.step(&mut weights, &[1.0, 1.0], &mut wrong_state).is_err());
        assert_eq!((weights, state), before);
        for bad in [
            ServerOptimizer::FedAvg { learning_rate: 0.0 },
            ServerOptimizer::FedAvgM { learning_rate: 1.0, momentum: 1.0 },
            ServerOptimizer::FedYogi { learning_rate: 1.0, beta1: 0.9, beta2: 0.99, tau: 0.0 },
            ServerOptimizer::FedAdam { learning_rate: f32::NAN, beta1: 0.9, beta2: 0.99, tau: 1e-3 },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn optimizers_round_trip_through_json() {
        let json = r#"{"kind":"fedyogi","learning_rate":0.01,"beta1":0.9,"beta2":0.99,"tau":0.001}"#;
        let parsed: ServerOptimizer = serde_json::from_str(json).unwrap();
        assert_eq!(
            parsed,
            ServerOptimizer::FedYogi { learning_rate: 0.01, beta1: 0.9, beta2: 0.99, tau: 0.001 }
        );
        assert_eq!(serde_json::to_string(&parsed).unwrap(), json);
        assert!(
            serde_json::from_str::<ServerOptimizer>(r#"{"kind":"fedavg","learning_rate":1,"x":2}"#).is_err()
        );
    }
}
