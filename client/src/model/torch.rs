//! The built-in architectures on libtorch (feature `tch`), CPU or CUDA.
//!
//! Parameters stay one flat f32 vector in the same PyTorch layout as the
//! ndarray path; each call views it as the module's tensors, runs
//! autograd, and writes the gradient back in the same order. The
//! equivalence tests hold both paths to the same loss and gradients.

use ndarray::{Array2, ArrayView2};
use tch::{Device, Kind, Tensor};

use super::{Differentiable, Model};

/// A [`Model`] evaluated by libtorch.
#[derive(Debug)]
pub struct TorchModel {
    model: Model,
    device: Device,
}

impl TorchModel {
    /// `model` on `device`.
    pub fn new(model: Model, device: Device) -> Self {
        Self { model, device }
    }

    /// `model` on the first CUDA device if there is one, else the CPU.
    pub fn best_available(model: Model) -> Self {
        Self::new(model, Device::cuda_if_available())
    }

    /// The device computations run on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The module's tensors, views of `params` copied to the device.
    fn tensors(&self, params: &[f32], requires_grad: bool) -> Vec<Tensor> {
        let mut offset = 0;
        self.model
            .layout()
            .tensors
            .iter()
            .map(|spec| {
                let shape: Vec<i64> = spec.shape.iter().map(|&d| d as i64).collect();
                let values = &params[offset..offset + spec.len()];
                offset += spec.len();
                Tensor::from_slice(values)
                    .view(shape.as_slice())
                    .to_device(self.device)
                    .set_requires_grad(requires_grad)
            })
            .collect()
    }

    fn forward(&self, tensors: &[Tensor], x: ArrayView2<'_, f32>) -> Tensor {
        let rows = x.nrows() as i64;
        let flat: Vec<f32> = x.iter().copied().collect();
        let input = Tensor::from_slice(&flat).view([rows, x.ncols() as i64]).to_device(self.device);
        match &self.model {
            Model::Mlp(_) => linear_stack(input, tensors),
            Model::Cnn(cnn) => {
                let side = cnn.side as i64;
                let mut h = input.view([rows, 1, side, side]);
                for conv in tensors[..4].chunks(2) {
                    h = h.conv2d(&conv[0], Some(&conv[1]), [1, 1], [0, 0], [1, 1], 1).relu().max_pool2d(
                        [2, 2],
                        [2, 2],
                        [0, 0],
                        [1, 1],
                        false,
                    );
                }
                linear_stack(h.flatten(1, -1), &tensors[4..])
            }
        }
    }

    /// Logits for a batch (rows of `x`).
    pub fn logits(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Array2<f32> {
        let tensors = self.tensors(params, false);
        let logits = tch::no_grad(|| self.forward(&tensors, x)).to_device(Device::Cpu);
        let (rows, cols) = (x.nrows(), logits.size()[1] as usize);
        Array2::from_shape_vec((rows, cols), to_vec(&logits))
            .unwrap_or_else(|_| unreachable!("logits are [rows, C]"))
    }
}

impl Differentiable for TorchModel {
    fn parameters(&self) -> usize {
        self.model.len()
    }

    fn inputs(&self) -> usize {
        self.model.inputs()
    }

    fn layout(&self) -> crate::checkpoint::ModelLayout {
        self.model.layout()
    }

    fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        let tensors = self.tensors(params, true);
        let targets = Tensor::from_slice(&labels.iter().map(|&l| i64::from(l)).collect::<Vec<_>>())
            .to_device(self.device);
        let loss = self.forward(&tensors, x).cross_entropy_for_logits(&targets);
        loss.backward();
        let mut offset = 0;
        for tensor in &tensors {
            let values = to_vec(&tensor.grad().to_device(Device::Cpu));
            grad[offset..offset + values.len()].copy_from_slice(&values);
            offset += values.len();
        }
        loss.to_device(Device::Cpu).double_value(&[]) as f32
    }
}

/// `fc` layers as (weight, bias) pairs with ReLU between them.
fn linear_stack(mut h: Tensor, tensors: &[Tensor]) -> Tensor {
    let layers = tensors.len() / 2;
    for (l, pair) in tensors.chunks(2).enumerate() {
        h = h.linear(&pair[0], Some(&pair[1]));
        if l + 1 < layers {
            h = h.relu();
        }
    }
    h
}

fn to_vec(tensor: &Tensor) -> Vec<f32> {
    let flat = tensor.to_kind(Kind::Float).contiguous().view(-1);
    Vec::<f32>::try_from(&flat).unwrap_or_else(|e| unreachable!("a float tensor converts: {e}"))
}
