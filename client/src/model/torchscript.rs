//! A user's own PyTorch model (feature `tch`): a TorchScript module saved
//! with `torch.jit.save`, trained by the same local loop as the built-in
//! models.
//!
//! The contract with the module: `forward` takes a batch of flattened
//! examples, a float tensor `[N, D]`, and returns logits `[N, C]` (a
//! convolutional module reshapes its input itself, e.g.
//! `x.view(-1, 1, 28, 28)`); the loss is the mean softmax cross-entropy.
//! The flat parameter vector is the module's `named_parameters()` in
//! order, each tensor row-major, so the task's layout is their names and
//! shapes and a Cohort checkpoint (safetensors, one tensor per name) loads
//! back into the module with `load_state_dict`. Buffers (batch-norm
//! statistics) are not parameters: they are neither aggregated nor part of
//! the checkpoint (load it with `strict=False` into a module that has
//! them).

use std::path::Path;

use ndarray::{Array2, ArrayView2};
use tch::{CModule, Device, Kind, TchError, Tensor};

use super::Differentiable;
use crate::checkpoint::{ModelLayout, TensorSpec};

/// Why a TorchScript module cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TorchScriptError {
    /// libtorch could not load or run it.
    #[error("TorchScript: {0}")]
    Torch(#[from] TchError),
    /// It breaks the contract above.
    #[error("TorchScript module: {0}")]
    Contract(String),
}

/// A TorchScript module as a [`Differentiable`] model.
#[derive(Debug)]
pub struct TorchScriptModel {
    module: CModule,
    layout: ModelLayout,
    inputs: usize,
    classes: usize,
    device: Device,
}

impl TorchScriptModel {
    /// Loads the module saved at `path` for examples of `inputs` features
    /// and `classes` classes, on `device`, and checks the contract: at
    /// least one parameter, float parameters, and logits `[N, classes]`
    /// for a batch `[N, inputs]`.
    pub fn load(
        path: impl AsRef<Path>,
        inputs: usize,
        classes: usize,
        device: Device,
    ) -> Result<Self, TorchScriptError> {
        let contract = |message: String| TorchScriptError::Contract(message);
        let mut module = CModule::load_on_device(path, device)?;
        // Dropout and the like behave as in training, the mode local steps run in.
        module.set_train();
        let named = module.named_parameters()?;
        if named.is_empty() {
            return Err(contract("it has no parameters to train".into()));
        }
        let mut tensors = Vec::with_capacity(named.len());
        for (name, tensor) in &named {
            if tensor.kind() != Kind::Float {
                return Err(contract(format!("parameter {name} is {:?}, not float32", tensor.kind())));
            }
            let shape = tensor.size().iter().map(|&d| usize::try_from(d)).collect::<Result<Vec<_>, _>>();
            let shape = shape.map_err(|_| contract(format!("parameter {name} has a negative dimension")))?;
            tensors.push(TensorSpec { name: name.clone(), shape });
        }
        let model = Self { module, layout: ModelLayout { tensors }, inputs, classes, device };
        let probe = Tensor::zeros([2, inputs as i64], (Kind::Float, device));
        let logits = tch::no_grad(|| model.module.forward_ts(&[probe]))?;
        if logits.size() != [2, classes as i64] {
            return Err(contract(format!(
                "forward maps a batch [2, {inputs}] to {:?}, not logits [2, {classes}]",
                logits.size()
            )));
        }
        Ok(model)
    }

    /// [`load`](Self::load) on the first CUDA device if there is one, else
    /// the CPU.
    pub fn load_best_available(
        path: impl AsRef<Path>,
        inputs: usize,
        classes: usize,
    ) -> Result<Self, TorchScriptError> {
        Self::load(path, inputs, classes, Device::cuda_if_available())
    }

    /// The task layout: the module's parameters' names and shapes.
    pub fn layout(&self) -> &ModelLayout {
        &self.layout
    }

    /// Classes (the logits' width).
    pub fn classes(&self) -> usize {
        self.classes
    }

    /// The module's own parameters, as one flat vector.
    pub fn weights(&self) -> Result<Vec<f32>, TorchScriptError> {
        let mut flat = Vec::with_capacity(self.layout.len());
        for (_, tensor) in self.module.named_parameters()? {
            flat.extend(to_vec(&tensor)?);
        }
        Ok(flat)
    }

    /// The module's parameters set from `params` (in layout order); the
    /// handles returned share their storage.
    fn load_params(&self, params: &[f32]) -> Result<Vec<Tensor>, TorchScriptError> {
        if params.len() != self.layout.len() {
            return Err(TorchScriptError::Contract(format!(
                "{} parameters given, the module has {}",
                params.len(),
                self.layout.len()
            )));
        }
        let mut offset = 0;
        let mut handles = Vec::with_capacity(self.layout.tensors.len());
        for (spec, (_, mut tensor)) in self.layout.tensors.iter().zip(self.module.named_parameters()?) {
            let values = Tensor::from_slice(&params[offset..offset + spec.len()]).to_device(self.device);
            offset += spec.len();
            tch::no_grad(|| tensor.f_copy_(&values.view_as(&tensor)))?;
            handles.push(tensor);
        }
        Ok(handles)
    }

    fn batch(&self, x: ArrayView2<'_, f32>) -> Tensor {
        let flat: Vec<f32> = x.iter().copied().collect();
        Tensor::from_slice(&flat).view([x.nrows() as i64, x.ncols() as i64]).to_device(self.device)
    }

    /// Logits for a batch (rows of `x`).
    pub fn logits(&self, params: &[f32], x: ArrayView2<'_, f32>) -> Result<Array2<f32>, TorchScriptError> {
        self.load_params(params)?;
        let logits = tch::no_grad(|| self.module.forward_ts(&[self.batch(x)]))?;
        Array2::from_shape_vec((x.nrows(), self.classes), to_vec(&logits)?)
            .map_err(|e| TorchScriptError::Contract(format!("logits: {e}")))
    }

    /// The loss of a batch, its gradient written to `grad`.
    fn try_loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> Result<f32, TorchScriptError> {
        let handles = self.load_params(params)?;
        let targets: Vec<i64> = labels.iter().map(|&l| i64::from(l)).collect();
        let targets = Tensor::from_slice(&targets).to_device(self.device);
        let logits = self.module.forward_ts(&[self.batch(x)])?;
        let loss = logits.f_log_softmax(-1, Kind::Float)?.f_nll_loss::<Tensor>(
            &targets,
            None,
            tch::Reduction::Mean,
            -100,
        )?;
        let gradients = Tensor::f_run_backward(&[&loss], &handles, false, false)?;
        let mut offset = 0;
        for gradient in &gradients {
            let values = to_vec(gradient)?;
            grad[offset..offset + values.len()].copy_from_slice(&values);
            offset += values.len();
        }
        Ok(to_vec(&loss)?[0])
    }
}

impl Differentiable for TorchScriptModel {
    fn parameters(&self) -> usize {
        self.layout.len()
    }

    fn inputs(&self) -> usize {
        self.inputs
    }

    fn layout(&self) -> ModelLayout {
        self.layout.clone()
    }

    /// A failure inside libtorch (checked against at [`load`](Self::load),
    /// so unexpected here) gives a NaN loss and a zero gradient: local
    /// training then reports a diverged loss rather than panicking.
    fn loss_and_gradient(
        &self,
        params: &[f32],
        x: ArrayView2<'_, f32>,
        labels: &[u8],
        grad: &mut [f32],
    ) -> f32 {
        self.try_loss_and_gradient(params, x, labels, grad).unwrap_or_else(|_| {
            grad.fill(0.0);
            f32::NAN
        })
    }
}

fn to_vec(tensor: &Tensor) -> Result<Vec<f32>, TorchScriptError> {
    let flat = tensor.f_to_kind(Kind::Float)?.f_contiguous()?.f_view(-1)?.f_to_device(Device::Cpu)?;
    Ok(Vec::<f32>::try_from(&flat)?)
}
