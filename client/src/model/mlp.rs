//! Fully connected networks: logistic regression and the 2NN.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

use super::{loss_and_output_delta, weight_and_bias};
use crate::checkpoint::TensorSpec;

/// A fully connected ReLU network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mlp {
    /// Layer widths from input to output: `[D, C]` is logistic regression,
    /// `[D, 200, 200, C]` the 2NN.
    pub widths: Vec<usize>,
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

    fn layers(&self) -> usize {
        self.widths.len() - 1
    }

    /// Layers are `fc` for a single layer, `fc1`, `fc2`, ... otherwise.
    pub(super) fn tensors(&self) -> Vec<TensorSpec> {
        let single = self.layers() == 1;
        (0..self.layers())
            .flat_map(|l| {
                let prefix = if single { "fc".to_string() } else { format!("fc{}", l + 1) };
                weight_and_bias(&prefix, vec![self.widths[l + 1], self.widths[l]])
            })
            .collect()
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        (0..self.layers()).map(|l| (self.widths[l] + 1) * self.widths[l + 1]).sum()
    }

    /// Whether the network has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Offsets of layer `l`'s weight and bias in the flat vector.
    fn offsets(&self, l: usize) -> (usize, usize) {
        let weight = (0..l).map(|i| (self.widths[i] + 1) * self.widths[i + 1]).sum();
        (weight, weight + self.widths[l] * self.widths[l + 1])
    }

    fn weight<'a>(&self, params: &'a [f32], l: usize) -> (ArrayView2<'a, f32>, ArrayView1<'a, f32>) {
        let (w, b) = self.offsets(l);
        let (input, output) = (self.widths[l], self.widths[l + 1]);
        let weight = ArrayView2::from_shape((output, input), &params[w..w + output * input])
            .unwrap_or_else(|_| unreachable!("offsets match the layout"));
        (weight, ArrayView1::from(&params[b..b + output]))
    }

    /// Each layer's activations for a batch (rows of `x`); the last are the
    /// logits.
    pub(super) fn forward(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Vec<Array2<f32>> {
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

    /// Back-propagates `delta` = dL/dlogits through the network, writing
    /// the parameter gradient to `grad`; returns dL/dinput when asked.
    pub(super) fn backward(
        &self,
        params: &[f32],
        activations: &[Array2<f32>],
        mut delta: Array2<f32>,
        grad: &mut [f32],
        input_gradient: bool,
    ) -> Option<Array2<f32>> {
        for l in (0..self.layers()).rev() {
            let (w, b) = self.offsets(l);
            let (input, output) = (self.widths[l], self.widths[l + 1]);
            let weight_grad = delta.t().dot(&activations[l]);
            grad[w..w + output * input]
                .copy_from_slice(weight_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            let bias_grad: Array1<f32> = delta.sum_axis(Axis(0));
            grad[b..b + output]
                .copy_from_slice(bias_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            if l > 0 || input_gradient {
                let (weight, _) = self.weight(params, l);
                let mut previous = delta.dot(&weight);
                if l > 0 {
                    // ReLU: no gradient where the activation was clipped.
                    previous.zip_mut_with(&activations[l], |d, &a| {
                        if a <= 0.0 {
                            *d = 0.0;
                        }
                    });
                }
                delta = previous;
            }
        }
        input_gradient.then_some(delta)
    }

    /// Mean cross-entropy of a batch and its gradient, written to `grad`.
    pub(super) fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        let activations = self.forward(params, x);
        let Some(logits) = activations.last() else { return 0.0 };
        let (loss, delta) = loss_and_output_delta(logits, labels);
        self.backward(params, &activations, delta, grad, false);
        loss
    }
}

#[cfg(test)]
mod tests {
    use super::super::Model;
    use super::super::tests::{batch, check_gradients};
    use super::*;

    #[test]
    fn gradients_match_finite_differences() {
        for widths in [vec![5, 3], vec![5, 4, 4, 3]] {
            let model = Model::Mlp(Mlp { widths });
            assert_eq!(check_gradients(&model, batch(6, 5, 8).view(), &[0, 1, 2, 0, 2, 1], 1), 0);
        }
    }

    #[test]
    fn the_input_gradient_matches_finite_differences() {
        let mlp = Mlp { widths: vec![4, 5, 3] };
        let params = Model::Mlp(mlp.clone()).init(2);
        let x = batch(2, 4, 3);
        let labels = [2u8, 0];
        let loss = |x: &Array2<f32>| {
            let activations = mlp.forward(&params, x.view());
            loss_and_output_delta(activations.last().unwrap(), &labels).0
        };
        let activations = mlp.forward(&params, x.view());
        let (_, delta) = loss_and_output_delta(activations.last().unwrap(), &labels);
        let mut grad = vec![0.0; mlp.len()];
        let dx = mlp.backward(&params, &activations, delta, &mut grad, true).unwrap();
        for ((i, j), &analytic) in dx.indexed_iter() {
            let (mut plus, mut minus) = (x.clone(), x.clone());
            plus[[i, j]] += 1e-2;
            minus[[i, j]] -= 1e-2;
            let numeric = (loss(&plus) - loss(&minus)) / 2e-2;
            assert!((numeric - analytic).abs() < 2e-3, "{numeric} vs {analytic}");
        }
    }
}
