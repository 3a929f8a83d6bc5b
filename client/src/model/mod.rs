//! Models on ndarray, with parameters as one flat f32 vector.
//!
//! Every model exposes its parameters as one `f32` vector whose layout is
//! PyTorch's `state_dict` order and shapes (weights `[out, in]`, convolution
//! kernels `[out, in, kh, kw]`), so a checkpoint loads directly into the
//! equivalent `torch.nn` module:
//!
//! * `logreg`: `fc.weight [C, D]`, `fc.bias [C]`; 7 850 parameters for
//!   D = 784, C = 10;
//! * `2nn` (McMahan et al. 2017): `fc1.weight [200, D]`, `fc1.bias [200]`,
//!   `fc2.weight [200, 200]`, `fc2.bias [200]`, `fc3.weight [C, 200]`,
//!   `fc3.bias [C]`, ReLU between layers; 199 210 parameters;
//! * `cnn` (28×28 grey images): `conv1` 5×5, 1→8 channels, ReLU, 2×2 max
//!   pool; `conv2` 5×5, 8→16, ReLU, 2×2 max pool; flatten in (C, H, W)
//!   order; `fc1` 256→64, ReLU; `fc2` 64→C; 20 522 parameters.
//!
//! The loss is the mean softmax cross-entropy over a batch.

mod cnn;
mod mlp;
#[cfg(feature = "tch")]
mod torch;
#[cfg(feature = "tch")]
mod torchscript;

use ndarray::{Array2, ArrayView1, ArrayView2, Axis, Slice};

pub use cnn::Cnn;
pub use mlp::Mlp;
#[cfg(feature = "tch")]
pub use tch::Device as TorchDevice;
#[cfg(feature = "tch")]
pub use torch::TorchModel;
#[cfg(feature = "tch")]
pub use torchscript::{TorchScriptError, TorchScriptModel};

use crate::checkpoint::{ModelLayout, TensorSpec};

/// A built-in model architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Model {
    /// Fully connected network (logistic regression, the 2NN).
    Mlp(Mlp),
    /// Small convolutional network for square grey images.
    Cnn(Cnn),
}

impl From<Mlp> for Model {
    fn from(mlp: Mlp) -> Self {
        Self::Mlp(mlp)
    }
}

impl From<Cnn> for Model {
    fn from(cnn: Cnn) -> Self {
        Self::Cnn(cnn)
    }
}

/// What local training needs of a model: the loss and its gradient.
/// Implemented by [`Model`] (ndarray) and, with the `tch` feature, by
/// `TorchModel` (libtorch).
pub trait Differentiable {
    /// Parameters (the flat vector's length).
    fn parameters(&self) -> usize;
    /// Input features per example.
    fn inputs(&self) -> usize;
    /// The tensors of the flat vector: what a task's layout must equal.
    fn layout(&self) -> ModelLayout;
    /// Mean cross-entropy of a batch; its gradient is written to `grad`.
    fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32;
}

impl Differentiable for Model {
    fn parameters(&self) -> usize {
        self.len()
    }

    fn inputs(&self) -> usize {
        Model::inputs(self)
    }

    fn layout(&self) -> ModelLayout {
        Model::layout(self)
    }

    fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        Model::loss_and_gradient(self, params, x, labels, grad)
    }
}

/// The architecture names [`Model::by_name`] knows.
pub const ARCHITECTURES: [&str; 3] = ["logreg", "2nn", "cnn"];

impl Model {
    /// By name (`logreg`, `2nn` or `cnn`) for `inputs` features and
    /// `classes` classes. `cnn` needs square images (`inputs` = side²,
    /// side ≥ 16 and divisible by 4 after the convolutions).
    pub fn by_name(name: &str, inputs: usize, classes: usize) -> Option<Self> {
        match name {
            "logreg" => Some(Mlp::logreg(inputs, classes).into()),
            "2nn" => Some(Mlp::two_nn(inputs, classes).into()),
            "cnn" => Cnn::for_images(inputs, classes).map(Into::into),
            _ => None,
        }
    }

    /// The built-in architecture whose layout is `layout`, if any: how a
    /// client that was handed only a task's checkpoint picks its model.
    pub fn for_layout(layout: &ModelLayout) -> Option<Self> {
        let classes = *layout.tensors.last()?.shape.first()?;
        let first = &layout.tensors.first()?.shape;
        let candidates: Vec<Self> = match first.as_slice() {
            [_, inputs] => {
                ["logreg", "2nn"].iter().filter_map(|n| Self::by_name(n, *inputs, classes)).collect()
            }
            [_, 1, _, _] => {
                (1..=512).filter_map(|side| Cnn::for_images(side * side, classes)).map(Into::into).collect()
            }
            _ => Vec::new(),
        };
        candidates.into_iter().find(|model| &model.layout() == layout)
    }

    /// Input features per example.
    pub fn inputs(&self) -> usize {
        match self {
            Self::Mlp(m) => m.widths[0],
            Self::Cnn(c) => c.side * c.side,
        }
    }

    /// The tensors, in the order of the flat vector.
    pub fn layout(&self) -> ModelLayout {
        ModelLayout {
            tensors: match self {
                Self::Mlp(m) => m.tensors(),
                Self::Cnn(c) => c.tensors(),
            },
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.layout().len()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// PyTorch's default initialisation ([`ModelLayout::fan_in_init`]).
    pub fn init(&self, seed: u64) -> Vec<f32> {
        self.layout().fan_in_init(seed)
    }

    /// Logits for a batch (rows of `x`).
    pub fn logits(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Array2<f32> {
        match self {
            Self::Mlp(m) => m.forward(params, x).pop().unwrap_or_default(),
            Self::Cnn(c) => c.logits(params, x),
        }
    }

    /// Mean cross-entropy of a batch and its gradient, written to `grad`.
    pub fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        match self {
            Self::Mlp(m) => m.loss_and_gradient(params, x, labels, grad),
            Self::Cnn(c) => c.loss_and_gradient(params, x, labels, grad),
        }
    }

    /// Predicted classes.
    pub fn predict(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<u8> {
        self.logits(params, x).outer_iter().map(|row| argmax(row) as u8).collect()
    }

    /// Mean cross-entropy and accuracy on a dataset, in batches.
    pub fn evaluate(&self, params: &[f32], x: ArrayView2<'_, f32>, labels: &[u8]) -> (f32, f32) {
        let mut loss = 0.0f64;
        let mut correct = 0usize;
        let batch = 1_000;
        for start in (0..labels.len()).step_by(batch) {
            let end = (start + batch).min(labels.len());
            let logits = self.logits(params, x.slice_axis(Axis(0), Slice::from(start..end)));
            let (batch_loss, probs) = softmax_cross_entropy(&logits, &labels[start..end]);
            loss += f64::from(batch_loss) * (end - start) as f64;
            correct += probs
                .outer_iter()
                .zip(&labels[start..end])
                .filter(|(row, y)| argmax(*row) == usize::from(**y))
                .count();
        }
        let n = labels.len().max(1) as f64;
        ((loss / n) as f32, (correct as f64 / n) as f32)
    }
}

/// A weight tensor and its bias, PyTorch-named.
fn weight_and_bias(prefix: &str, weight: Vec<usize>) -> [TensorSpec; 2] {
    let bias = vec![weight[0]];
    [
        TensorSpec { name: format!("{prefix}.weight"), shape: weight },
        TensorSpec { name: format!("{prefix}.bias"), shape: bias },
    ]
}

/// Index of the largest value (the first, on ties).
fn argmax(row: ArrayView1<'_, f32>) -> usize {
    row.iter().enumerate().fold((0, f32::MIN), |best, (i, &v)| if v > best.1 { (i, v) } else { best }).0
}

/// Mean cross-entropy and the softmax probabilities, computed stably.
fn softmax_cross_entropy(logits: &Array2<f32>, labels: &[u8]) -> (f32, Array2<f32>) {
    let mut probs = logits.clone();
    let mut loss = 0.0f64;
    for (mut row, &y) in probs.outer_iter_mut().zip(labels) {
        let max = row.fold(f32::MIN, |m, &v| m.max(v));
        row.mapv_inplace(|v| (v - max).exp());
        let sum: f32 = row.sum();
        row /= sum;
        loss -= f64::from(row[usize::from(y)].max(1e-12).ln());
    }
    ((loss / labels.len().max(1) as f64) as f32, probs)
}

/// The loss of a batch and dL/dlogits = (softmax − onehot) / batch.
fn loss_and_output_delta(logits: &Array2<f32>, labels: &[u8]) -> (f32, Array2<f32>) {
    let (loss, mut delta) = softmax_cross_entropy(logits, labels);
    for (mut row, &y) in delta.outer_iter_mut().zip(labels) {
        row[usize::from(y)] -= 1.0;
    }
    delta /= labels.len().max(1) as f32;
    (loss, delta)
}

#[cfg(test)]
pub(crate) mod tests {
    use rand_chacha::ChaCha20Rng;
    use rand_core::{Rng, SeedableRng};

    use super::*;

    pub(crate) fn batch(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        Array2::from_shape_fn((rows, cols), |_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0)
    }

    /// Compares analytic gradients with central finite differences on every
    /// `stride`-th parameter; returns how many disagree.
    pub(crate) fn check_gradients(
        model: &Model,
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        stride: usize,
    ) -> usize {
        let params = model.init(7);
        let mut grad = vec![0.0; model.len()];
        model.loss_and_gradient(&params, x, labels, &mut grad);
        let eps = 1e-3f32;
        let mut scratch = vec![0.0; model.len()];
        let mut off = 0;
        for i in (0..model.len()).step_by(stride) {
            let mut plus = params.clone();
            plus[i] += eps;
            let mut minus = params.clone();
            minus[i] -= eps;
            let numeric = (model.loss_and_gradient(&plus, x, labels, &mut scratch)
                - model.loss_and_gradient(&minus, x, labels, &mut scratch))
                / (2.0 * eps);
            if (numeric - grad[i]).abs() > 2e-4 + 0.02 * grad[i].abs() {
                off += 1;
            }
        }
        off
    }

    #[test]
    fn layouts_match_pytorch_and_the_paper() {
        let two_nn = Model::by_name("2nn", 784, 10).unwrap();
        assert_eq!(two_nn.len(), 199_210);
        let names: Vec<String> = two_nn.layout().tensors.into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]);
        assert_eq!(two_nn.layout().tensors[0].shape, vec![200, 784]);
        let logreg = Model::by_name("logreg", 784, 10).unwrap();
        assert_eq!(logreg.len(), 7_850);
        assert_eq!(logreg.layout().tensors[0].name, "fc.weight");
        let cnn = Model::by_name("cnn", 784, 10).unwrap();
        let layout = cnn.layout();
        let names: Vec<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "conv1.weight",
                "conv1.bias",
                "conv2.weight",
                "conv2.bias",
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias"
            ]
        );
        assert_eq!(layout.tensors[2].shape, vec![16, 8, 5, 5]);
        assert_eq!(layout.tensors[4].shape, vec![64, 256]);
        assert_eq!(cnn.len(), 20_522);
        assert!(Model::by_name("cnn", 780, 10).is_none());
        assert!(Model::by_name("resnet", 784, 10).is_none());
    }

    #[test]
    fn every_architecture_is_recognised_by_its_layout() {
        for (name, inputs, classes) in
            [("logreg", 784, 10), ("2nn", 784, 10), ("cnn", 784, 10), ("cnn", 400, 3)]
        {
            let model = Model::by_name(name, inputs, classes).unwrap();
            assert_eq!(Model::for_layout(&model.layout()), Some(model), "{name}");
        }
        let mut odd = Model::by_name("2nn", 784, 10).unwrap().layout();
        odd.tensors[2].shape = vec![199, 200];
        assert_eq!(Model::for_layout(&odd), None);
        assert_eq!(Model::for_layout(&ModelLayout { tensors: vec![] }), None);
    }

    #[test]
    fn initialisation_is_deterministic_and_bounded_by_fan_in() {
        let model = Model::by_name("logreg", 100, 10).unwrap();
        let params = model.init(3);
        assert_eq!(params, model.init(3));
        assert_ne!(params, model.init(4));
        assert!(params.iter().all(|p| p.abs() <= 0.1));
        let cnn = Model::by_name("cnn", 784, 10).unwrap();
        let params = cnn.init(1);
        // conv1 has fan_in 25, conv2 200: their bounds differ.
        assert!(params[..208].iter().all(|p| p.abs() <= 0.2) && params[..208].iter().any(|p| p.abs() > 0.1));
        assert!(params[208..208 + 3_216].iter().all(|p| p.abs() <= 1.0 / 200f32.sqrt()));
    }
}
