//! Models on ndarray, with parameters as one flat f32 vector.
//!
//! Layout (PyTorch's `state_dict` order and shapes, weights `[out, in]`):
//! * `logreg`: `fc.weight [C, D]`, `fc.bias [C]`;
//! * `2nn` (McMahan et al. 2017): `fc1.weight [200, D]`, `fc1.bias [200]`,
//!   `fc2.weight [200, 200]`, `fc2.bias [200]`, `fc3.weight [C, 200]`,
//!   `fc3.bias [C]`, ReLU between layers; 199 210 parameters for D = 784,
//!   C = 10.
//!
//! The loss is the mean softmax cross-entropy over a batch.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis, Slice};
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

/// A model architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlp {
    /// Layer widths from input to output: `[D, C]` is logistic regression,
    /// `[D, 200, 200, C]` the 2NN.
    pub widths: Vec<usize>,
}

/// One named tensor of the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tensor {
    /// Name.
    pub name: String,
    /// Shape.
    pub shape: Vec<usize>,
}

impl Mlp {
    /// Multinomial logistic regression.
    pub fn logreg(inputs: usize, classes: usize) -> Self {
        Self { widths: vec![inputs, classes] }
    }

    /// The two-hidden-layer perceptron of McMahan et al. (2NN).
    pub fn two_nn(inputs: usize, classes: usize) -> Self {
        Self { widths: vec![inputs, 200, 200, classes] }
    }

    /// By name: `logreg` or `2nn`.
    pub fn by_name(name: &str, inputs: usize, classes: usize) -> Option<Self> {
        match name {
            "logreg" => Some(Self::logreg(inputs, classes)),
            "2nn" => Some(Self::two_nn(inputs, classes)),
            _ => None,
        }
    }

    fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    /// The tensors, in the order of the flat vector.
    pub fn layout(&self) -> Vec<Tensor> {
        let single = self.layers() == 1;
        (0..self.layers())
            .flat_map(|l| {
                let prefix = if single { "fc".to_string() } else { format!("fc{}", l + 1) };
                let (input, output) = (self.widths[l], self.widths[l + 1]);
                [
                    Tensor { name: format!("{prefix}.weight"), shape: vec![output, input] },
                    Tensor { name: format!("{prefix}.bias"), shape: vec![output] },
                ]
            })
            .collect()
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        (0..self.layers()).map(|l| (self.widths[l] + 1) * self.widths[l + 1]).sum()
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// PyTorch's default initialisation for linear layers: weights and
    /// biases uniform in ±1/√fan_in; deterministic for the seed.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let mut params = Vec::with_capacity(self.len());
        for l in 0..self.layers() {
            let bound = 1.0 / (self.widths[l] as f64).sqrt();
            for _ in 0..(self.widths[l] + 1) * self.widths[l + 1] {
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                params.push(((2.0 * u - 1.0) * bound) as f32);
            }
        }
        params
    }

    /// Offsets of each layer's weight and bias in the flat vector.
    fn offsets(&self) -> Vec<(usize, usize, usize)> {
        let mut offset = 0;
        (0..self.layers())
            .map(|l| {
                let (input, output) = (self.widths[l], self.widths[l + 1]);
                let weight = offset;
                let bias = weight + input * output;
                offset = bias + output;
                (weight, bias, output)
            })
            .collect()
    }

    fn weight<'a>(&self, params: &'a [f32], l: usize) -> (ArrayView2<'a, f32>, ArrayView1<'a, f32>) {
        let (w, b, output) = self.offsets()[l];
        let input = self.widths[l];
        let weight = ArrayView2::from_shape((output, input), &params[w..w + output * input])
            .unwrap_or_else(|_| unreachable!("offsets match the layout"));
        let bias = ArrayView1::from(&params[b..b + output]);
        (weight, bias)
    }

    /// Logits for a batch (rows of `x`), and each layer's activations.
    fn forward(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<Array2<f32>> {
        let mut activations = vec![x.to_owned()];
        for l in 0..self.layers() {
            let (weight, bias) = self.weight(params, l);
            let mut z = activations[l].dot(&weight.t()) + bias;
            if l + 1 < self.layers() {
                z.mapv_inplace(|v| v.max(0.0));
            }
            activations.push(z);
        }
        activations
    }

    /// Predicted classes.
    pub fn predict(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<u8> {
        let logits = self.forward(params, x).pop().unwrap_or_default();
        logits.outer_iter().map(|row| argmax(row) as u8).collect()
    }

    /// Mean cross-entropy and accuracy on a dataset, in batches.
    pub fn evaluate(&self, params: &[f32], x: ArrayView2<'_, f32>, labels: &[u8]) -> (f32, f32) {
        let mut loss = 0.0f64;
        let mut correct = 0usize;
        let batch = 1_000;
        for start in (0..labels.len()).step_by(batch) {
            let end = (start + batch).min(labels.len());
            let logits = self
                .forward(params, x.slice_axis(Axis(0), Slice::from(start..end)))
                .pop()
                .unwrap_or_default();
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

    /// Mean cross-entropy of a batch and its gradient, written to `grad`.
    pub fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        let activations = self.forward(params, x);
        let Some(logits) = activations.last() else { return 0.0 };
        let (loss, probs) = softmax_cross_entropy(logits, labels);
        // dL/dz for the output layer: (softmax − onehot) / batch.
        let mut delta = probs;
        for (mut row, &y) in delta.outer_iter_mut().zip(labels) {
            row[usize::from(y)] -= 1.0;
        }
        delta /= labels.len() as f32;
        let offsets = self.offsets();
        for l in (0..self.layers()).rev() {
            let (w, b, output) = offsets[l];
            let input = self.widths[l];
            let weight_grad = delta.t().dot(&activations[l]);
            grad[w..w + output * input]
                .copy_from_slice(weight_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            let bias_grad: Array1<f32> = delta.sum_axis(Axis(0));
            grad[b..b + output]
                .copy_from_slice(bias_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            if l > 0 {
                let (weight, _) = self.weight(params, l);
                let mut previous = delta.dot(&weight);
                // ReLU: no gradient where the activation was clipped.
                previous.zip_mut_with(&activations[l], |d, &a| {
                    if a <= 0.0 {
                        *d = 0.0;
                    }
                });
                delta = previous;
            }
        }
        loss
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(rows: usize, cols: usize, seed: u64) -> Array2<f32> {
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        Array2::from_shape_fn((rows, cols), |_| (rng.next_u32() as f32 / u32::MAX as f32) * 2.0 - 1.0)
    }

    #[test]
    fn layouts_match_pytorch_and_the_paper() {
        let two_nn = Mlp::two_nn(784, 10);
        assert_eq!(two_nn.len(), 199_210);
        let names: Vec<String> = two_nn.layout().into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"]);
        assert_eq!(two_nn.layout()[0].shape, vec![200, 784]);
        let logreg = Mlp::logreg(784, 10);
        assert_eq!(logreg.len(), 7_850);
        assert_eq!(logreg.layout()[0].name, "fc.weight");
        assert_eq!(
            two_nn.layout().iter().map(|t| t.shape.iter().product::<usize>()).sum::<usize>(),
            two_nn.len()
        );
    }

    /// Analytic gradients agree with central finite differences.
    #[test]
    fn gradients_match_finite_differences() {
        for model in [Mlp { widths: vec![5, 3] }, Mlp { widths: vec![5, 4, 4, 3] }] {
            let params = model.init(7);
            let x = batch(6, 5, 8);
            let labels = [0u8, 1, 2, 0, 2, 1];
            let mut grad = vec![0.0; model.len()];
            model.loss_and_gradient(&params, x.view(), &labels, &mut grad);
            let eps = 1e-2f32;
            for i in (0..model.len()).step_by(3) {
                let mut plus = params.clone();
                plus[i] += eps;
                let mut minus = params.clone();
                minus[i] -= eps;
                let mut scratch = vec![0.0; model.len()];
                let numeric = (model.loss_and_gradient(&plus, x.view(), &labels, &mut scratch)
                    - model.loss_and_gradient(&minus, x.view(), &labels, &mut scratch))
                    / (2.0 * eps);
                assert!(
                    (numeric - grad[i]).abs() < 2e-3 + 0.02 * grad[i].abs(),
                    "param {i}: {numeric} vs {}",
                    grad[i]
                );
            }
        }
    }

    #[test]
    fn initialisation_is_deterministic_and_bounded() {
        let model = Mlp::logreg(100, 10);
        let params = model.init(3);
        assert_eq!(params, model.init(3));
        assert_ne!(params, model.init(4));
        assert!(params.iter().all(|p| p.abs() <= 0.1));
    }
}
