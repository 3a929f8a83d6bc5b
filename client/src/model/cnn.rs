//! A small convolutional network for square grey images, with im2col
//! convolutions so that the heavy lifting is matrix products.
//!
//! Activations are kept as `[batch · height · width, channels]` matrices
//! (NHWC); kernels and the flatten before `fc1` follow PyTorch's layouts so
//! that the flat parameter vector is a PyTorch `state_dict`.

use ndarray::{Array1, Array2, ArrayView1, ArrayView2, Axis};

use super::{Mlp, loss_and_output_delta, weight_and_bias};
use crate::checkpoint::TensorSpec;

const KERNEL: usize = 5;
const CHANNELS: [usize; 3] = [1, 8, 16];
const HIDDEN: usize = 64;

/// conv(5×5, 1→8) → ReLU → maxpool(2) → conv(5×5, 8→16) → ReLU →
/// maxpool(2) → flatten → fc(64) → ReLU → fc(classes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cnn {
    /// Image side in pixels.
    pub side: usize,
    /// Output classes.
    pub classes: usize,
}

/// What the forward pass keeps for the backward pass.
struct Trace {
    /// im2col matrix of each convolution's input.
    columns: [Array2<f32>; 2],
    /// Each convolution's output after ReLU.
    activated: [Array2<f32>; 2],
    /// For each pooled value, the row of its maximum in `activated`.
    argmax: [Vec<usize>; 2],
    /// The head's activations (the first is the flattened feature map).
    head: Vec<Array2<f32>>,
}

impl Cnn {
    /// The network for `inputs` = side² pixels, if the side suits the two
    /// convolution and pooling stages.
    pub fn for_images(inputs: usize, classes: usize) -> Option<Self> {
        let side = (0..=inputs).find(|s| s * s >= inputs)?;
        let valid = side * side == inputs
            && side > KERNEL
            && conv_out(side) % 2 == 0
            && conv_out(side) / 2 > KERNEL
            && conv_out(conv_out(side) / 2) % 2 == 0
            && classes > 0;
        valid.then_some(Self { side, classes })
    }

    /// Input side of convolution `layer` (0 or 1).
    fn conv_side(&self, layer: usize) -> usize {
        if layer == 0 { self.side } else { conv_out(self.side) / 2 }
    }

    fn features(&self) -> usize {
        let pooled = conv_out(self.conv_side(1)) / 2;
        CHANNELS[2] * pooled * pooled
    }

    fn head(&self) -> Mlp {
        Mlp { widths: vec![self.features(), HIDDEN, self.classes] }
    }

    fn conv_len(layer: usize) -> usize {
        CHANNELS[layer + 1] * (CHANNELS[layer] * KERNEL * KERNEL + 1)
    }

    pub(super) fn tensors(&self) -> Vec<TensorSpec> {
        let mut tensors: Vec<TensorSpec> = (0..2)
            .flat_map(|l| {
                weight_and_bias(&format!("conv{}", l + 1), vec![CHANNELS[l + 1], CHANNELS[l], KERNEL, KERNEL])
            })
            .collect();
        tensors.extend(self.head().tensors());
        tensors
    }

    /// Kernel `[out, in·k·k]` and bias of convolution `layer`.
    fn kernel<'a>(params: &'a [f32], layer: usize) -> (ArrayView2<'a, f32>, ArrayView1<'a, f32>) {
        let start = if layer == 0 { 0 } else { Self::conv_len(0) };
        let (out, width) = (CHANNELS[layer + 1], CHANNELS[layer] * KERNEL * KERNEL);
        let weight = ArrayView2::from_shape((out, width), &params[start..start + out * width])
            .unwrap_or_else(|_| unreachable!("offsets match the layout"));
        (weight, ArrayView1::from(&params[start + out * width..start + out * width + out]))
    }

    fn head_params(params: &[f32]) -> &[f32] {
        &params[Self::conv_len(0) + Self::conv_len(1)..]
    }

    fn forward(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Trace {
        let batch = x.nrows();
        let mut input = x
            .as_standard_layout()
            .into_owned()
            .into_shape_with_order((batch * self.side * self.side, 1))
            .unwrap_or_else(|_| unreachable!("rows are side² pixels"));
        let mut columns = Vec::with_capacity(2);
        let mut activated = Vec::with_capacity(2);
        let mut argmaxes = Vec::with_capacity(2);
        #[allow(clippy::needless_range_loop)] // `layer` indexes CHANNELS and conv_side too.
        for layer in 0..2 {
            let side = self.conv_side(layer);
            let cols = im2col(&input, batch, side, CHANNELS[layer]);
            let (kernel, bias) = Self::kernel(params, layer);
            let mut out = cols.dot(&kernel.t()) + bias;
            out.mapv_inplace(|v| v.max(0.0));
            let (pooled, argmax) = max_pool(&out, batch, conv_out(side));
            columns.push(cols);
            activated.push(out);
            argmaxes.push(argmax);
            input = pooled;
        }
        let flat = flatten_chw(&input, batch, CHANNELS[2]);
        let head = self.head().forward(Self::head_params(params), flat.view());
        let pair = |mut v: Vec<Array2<f32>>| {
            let second = v.pop().unwrap_or_default();
            [v.pop().unwrap_or_default(), second]
        };
        let [a0, a1] = [argmaxes.remove(0), argmaxes.remove(0)];
        Trace { columns: pair(columns), activated: pair(activated), argmax: [a0, a1], head }
    }

    pub(super) fn logits(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Array2<f32> {
        self.forward(params, x).head.pop().unwrap_or_default()
    }

    pub(super) fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        let batch = x.nrows();
        let trace = self.forward(params, x);
        let Some(logits) = trace.head.last() else { return 0.0 };
        let (loss, delta) = loss_and_output_delta(logits, labels);
        let head_start = Self::conv_len(0) + Self::conv_len(1);
        let d_flat = self
            .head()
            .backward(Self::head_params(params), &trace.head, delta, &mut grad[head_start..], true)
            .unwrap_or_else(|| unreachable!("the input gradient was asked for"));
        let mut d_pooled = unflatten_chw(&d_flat, CHANNELS[2]);
        for layer in (0..2).rev() {
            let rows = trace.activated[layer].nrows();
            let mut d_out = Array2::<f32>::zeros((rows, CHANNELS[layer + 1]));
            for ((pooled_row, channel), &d) in d_pooled.indexed_iter() {
                let row = trace.argmax[layer][pooled_row * CHANNELS[layer + 1] + channel];
                d_out[[row, channel]] += d;
            }
            // ReLU: no gradient where the output was clipped.
            d_out.zip_mut_with(&trace.activated[layer], |d, &a| {
                if a <= 0.0 {
                    *d = 0.0;
                }
            });
            let start = if layer == 0 { 0 } else { Self::conv_len(0) };
            let (kernel, _) = Self::kernel(params, layer);
            let weight_grad = d_out.t().dot(&trace.columns[layer]);
            let weights = kernel.len();
            grad[start..start + weights]
                .copy_from_slice(weight_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            let bias_grad: Array1<f32> = d_out.sum_axis(Axis(0));
            grad[start + weights..start + weights + CHANNELS[layer + 1]]
                .copy_from_slice(bias_grad.as_slice().unwrap_or_else(|| unreachable!("standard layout")));
            if layer == 1 {
                let d_columns = d_out.dot(&kernel);
                d_pooled = col2im(&d_columns, batch, self.conv_side(1), CHANNELS[1]);
            }
        }
        loss
    }
}

/// Side of a valid (unpadded) convolution's output.
const fn conv_out(side: usize) -> usize {
    side - (KERNEL - 1)
}

/// Rows are output pixels `(b, y, x)`, columns `(c, i, j)` as in PyTorch's
/// kernel layout `[out, in, kh, kw]`.
fn im2col(input: &Array2<f32>, batch: usize, side: usize, channels: usize) -> Array2<f32> {
    let out = conv_out(side);
    let width = channels * KERNEL * KERNEL;
    let pixels = input.as_slice().unwrap_or_else(|| unreachable!("standard layout"));
    let mut columns = vec![0.0f32; batch * out * out * width];
    for (row, column) in columns.chunks_exact_mut(width).enumerate() {
        let (b, y, x) = (row / (out * out), row / out % out, row % out);
        for c in 0..channels {
            for i in 0..KERNEL {
                let source = ((b * side + y + i) * side + x) * channels + c;
                for j in 0..KERNEL {
                    column[(c * KERNEL + i) * KERNEL + j] = pixels[source + j * channels];
                }
            }
        }
    }
    Array2::from_shape_vec((batch * out * out, width), columns)
        .unwrap_or_else(|_| unreachable!("sizes computed above"))
}

/// The adjoint of [`im2col`]: sums column gradients back onto the pixels.
fn col2im(columns: &Array2<f32>, batch: usize, side: usize, channels: usize) -> Array2<f32> {
    let out = conv_out(side);
    let mut pixels = Array2::<f32>::zeros((batch * side * side, channels));
    for (row, column) in columns.outer_iter().enumerate() {
        let (b, y, x) = (row / (out * out), row / out % out, row % out);
        for c in 0..channels {
            for i in 0..KERNEL {
                for j in 0..KERNEL {
                    pixels[[(b * side + y + i) * side + x + j, c]] += column[(c * KERNEL + i) * KERNEL + j];
                }
            }
        }
    }
    pixels
}

/// 2×2 max pooling with stride 2 of a `[batch·side·side, channels]` map;
/// also returns, per pooled value, the row of the maximum.
fn max_pool(input: &Array2<f32>, batch: usize, side: usize) -> (Array2<f32>, Vec<usize>) {
    let (half, channels) = (side / 2, input.ncols());
    let mut pooled = Array2::<f32>::zeros((batch * half * half, channels));
    let mut argmax = vec![0usize; batch * half * half * channels];
    for b in 0..batch {
        for y in 0..half {
            for x in 0..half {
                let target = (b * half + y) * half + x;
                for c in 0..channels {
                    let mut best = (f32::NEG_INFINITY, 0);
                    for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                        let row = (b * side + 2 * y + dy) * side + 2 * x + dx;
                        if input[[row, c]] > best.0 {
                            best = (input[[row, c]], row);
                        }
                    }
                    pooled[[target, c]] = best.0;
                    argmax[target * channels + c] = best.1;
                }
            }
        }
    }
    (pooled, argmax)
}

/// `[batch·h·w, c]` → `[batch, c·h·w]`, PyTorch's `flatten` of NCHW.
fn flatten_chw(map: &Array2<f32>, batch: usize, channels: usize) -> Array2<f32> {
    let area = map.nrows() / batch;
    Array2::from_shape_fn((batch, channels * area), |(b, f)| map[[b * area + f % area, f / area]])
}

/// The inverse of [`flatten_chw`].
fn unflatten_chw(flat: &Array2<f32>, channels: usize) -> Array2<f32> {
    let (batch, area) = (flat.nrows(), flat.ncols() / channels);
    Array2::from_shape_fn((batch * area, channels), |(row, c)| flat[[row / area, c * area + row % area]])
}

#[cfg(test)]
mod tests {
    use super::super::Model;
    use super::super::tests::{batch, check_gradients};
    use super::*;

    #[test]
    fn gradients_match_finite_differences() {
        // The smallest image the architecture accepts keeps this quick.
        // ReLU and max pooling are not differentiable everywhere: a
        // parameter shared by hundreds of pixels (a conv1 weight) can move
        // one across a kink within ±eps, so a few estimates may be off.
        let model = Model::Cnn(Cnn::for_images(16 * 16, 3).unwrap());
        let checked = model.len().div_ceil(7);
        let off = check_gradients(&model, batch(3, 256, 11).view(), &[0, 2, 1], 7);
        assert!(off * 50 <= checked, "{off} of {checked} gradients disagree");
    }

    #[test]
    fn flattening_is_pytorchs_channel_major_order() {
        // 1 image, 2×2 pixels, 2 channels: NHWC rows (pixel) × channel.
        let map = Array2::from_shape_vec((4, 2), vec![0., 10., 1., 11., 2., 12., 3., 13.]).unwrap();
        let flat = flatten_chw(&map, 1, 2);
        assert_eq!(flat.as_slice().unwrap(), &[0., 1., 2., 3., 10., 11., 12., 13.]);
        assert_eq!(unflatten_chw(&flat, 2), map);
    }

    #[test]
    fn col2im_is_the_adjoint_of_im2col() {
        // <im2col(x), y> = <x, col2im(y)> for random x, y.
        let (b, side, c) = (2, 7, 2);
        let x = batch(b * side * side, c, 1);
        let columns = im2col(&x, b, side, c);
        let y = batch(columns.nrows(), columns.ncols(), 2);
        let left: f32 = (&columns * &y).sum();
        let right: f32 = (&x * &col2im(&y, b, side, c)).sum();
        assert!((left - right).abs() < 1e-3 * left.abs().max(1.0), "{left} vs {right}");
    }

    #[test]
    fn max_pooling_picks_the_largest_of_each_window() {
        let input =
            Array2::from_shape_vec((16, 1), (0..16).map(|v| ((v * 7) % 16) as f32).collect()).unwrap();
        let (pooled, argmax) = max_pool(&input, 1, 4);
        for (window, &row) in argmax.iter().enumerate() {
            assert_eq!(input[[row, 0]], pooled[[window, 0]]);
        }
        assert_eq!(pooled.column(0).to_vec(), vec![12., 14., 15., 13.]);
    }
}
