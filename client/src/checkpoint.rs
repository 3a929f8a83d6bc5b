//! Model checkpoints in the safetensors format, which PyTorch
//! (`safetensors.torch.load_file`), NumPy and JAX load directly.
//!
//! A model is one flat f32 vector with a [`ModelLayout`]: named tensors
//! with shapes, laid out one after the other in layout order. The layout
//! order is kept in the metadata (`cohort.layout`), because the safetensors
//! header itself is a map and does not preserve it.

use std::collections::{BTreeMap, HashMap};

use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::{Deserialize, Serialize};

const LAYOUT_KEY: &str = "cohort.layout";

/// One named tensor of a model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TensorSpec {
    /// Name, as PyTorch's `state_dict` would have it (e.g. `fc1.weight`).
    pub name: String,
    /// Dimensions.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Number of elements.
    pub fn len(&self) -> usize {
        // Saturating: a hostile shape must read as too large, never wrap
        // around to a small count.
        self.shape.iter().try_fold(1usize, |len, &dimension| len.checked_mul(dimension)).unwrap_or(usize::MAX)
    }

    /// Whether the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The tensors of a model, in the order of the flat parameter vector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelLayout {
    /// The tensors.
    pub tensors: Vec<TensorSpec>,
}

impl ModelLayout {
    /// The digest ([`model_digest`](cohort_crypto::policy::model_digest))
    /// of the model with this layout and `weights`.
    pub fn digest(&self, weights: &[f32]) -> [u8; 16] {
        cohort_crypto::policy::model_digest(
            self.tensors.iter().map(|t| (t.name.as_str(), t.shape.as_slice())),
            weights,
        )
    }

    /// Total number of parameters.
    pub fn len(&self) -> usize {
        self.tensors.iter().map(TensorSpec::len).fold(0, usize::saturating_add)
    }

    /// Whether the model has no parameters.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// PyTorch's default initialisation of linear and convolution layers:
    /// every weight tensor (rank ≥ 2) and the bias after it uniform in
    /// ±1/√fan_in, fan_in being the product of the weight's dimensions
    /// after the first. Deterministic for the seed.
    pub fn fan_in_init(&self, seed: u64) -> Vec<f32> {
        use rand_core::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(seed);
        let mut params = Vec::with_capacity(self.len());
        let mut fan_in = 1;
        for tensor in &self.tensors {
            if tensor.shape.len() > 1 {
                fan_in = tensor.shape[1..].iter().product::<usize>();
            }
            let bound = 1.0 / (fan_in as f64).sqrt();
            for _ in 0..tensor.len() {
                let u = (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
                params.push(((2.0 * u - 1.0) * bound) as f32);
            }
        }
        params
    }

    /// Checks that names are unique and non-empty and no tensor is empty.
    pub fn validate(&self) -> Result<(), CheckpointError> {
        let mut seen = std::collections::HashSet::new();
        for tensor in &self.tensors {
            if tensor.name.is_empty() || tensor.name == "__metadata__" || !seen.insert(&tensor.name) {
                return Err(CheckpointError::Layout("tensor names must be unique and non-empty"));
            }
            if tensor.is_empty() {
                return Err(CheckpointError::Layout("tensors must have at least one element"));
            }
        }
        if self.tensors.is_empty() {
            return Err(CheckpointError::Layout("a model needs at least one tensor"));
        }
        Ok(())
    }
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The layout is invalid.
    #[error("invalid model layout: {0}")]
    Layout(&'static str),
    /// The weights do not fit the layout.
    #[error("the layout has {layout} parameters, the weights {weights}")]
    Length {
        /// Parameters the layout describes.
        layout: usize,
        /// Parameters supplied.
        weights: usize,
    },
    /// The bytes are not a checkpoint this crate wrote.
    #[error("not a Cohort checkpoint: {0}")]
    Format(String),
}

/// A decoded checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    /// The layout.
    pub layout: ModelLayout,
    /// The flat weights.
    pub weights: Vec<f32>,
    /// Free-form metadata (task, round, ...), without the layout entry.
    pub metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// The model's digest ([`model_digest`](cohort_crypto::policy::model_digest)):
    /// its layout and weights, not its metadata.
    pub fn digest(&self) -> [u8; 16] {
        self.layout.digest(&self.weights)
    }
}

/// Serialises `weights` with `layout` and `metadata`.
pub fn encode(
    layout: &ModelLayout,
    weights: &[f32],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, CheckpointError> {
    layout.validate()?;
    if layout.len() != weights.len() {
        return Err(CheckpointError::Length { layout: layout.len(), weights: weights.len() });
    }
    let bytes: Vec<u8> = weights.iter().flat_map(|w| w.to_le_bytes()).collect();
    let mut offset = 0;
    let mut views = Vec::with_capacity(layout.tensors.len());
    for tensor in &layout.tensors {
        let end = offset + tensor.len() * 4;
        let view = TensorView::new(Dtype::F32, tensor.shape.clone(), &bytes[offset..end])
            .map_err(|e| CheckpointError::Format(e.to_string()))?;
        views.push((tensor.name.clone(), view));
        offset = end;
    }
    let mut info: HashMap<String, String> = metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    let names: Vec<&str> = layout.tensors.iter().map(|t| t.name.as_str()).collect();
    info.insert(
        LAYOUT_KEY.to_string(),
        serde_json::to_string(&names).map_err(|e| CheckpointError::Format(e.to_string()))?,
    );
    safetensors::serialize(views, Some(info)).map_err(|e| CheckpointError::Format(e.to_string()))
}

/// Reads a checkpoint written by [`encode`].
pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let format = |e: &dyn std::fmt::Display| CheckpointError::Format(e.to_string());
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(|e| format(&e))?;
    let tensors = SafeTensors::deserialize(bytes).map_err(|e| format(&e))?;
    let mut metadata: BTreeMap<String, String> =
        header.metadata().clone().unwrap_or_default().into_iter().collect();
    let order = metadata.remove(LAYOUT_KEY).ok_or_else(|| format(&"missing layout metadata"))?;
    let names: Vec<String> = serde_json::from_str(&order).map_err(|e| format(&e))?;
    if names.len() != tensors.len() {
        return Err(format(&"layout metadata does not list every tensor"));
    }
    let mut layout = ModelLayout { tensors: Vec::with_capacity(names.len()) };
    let mut weights = Vec::new();
    for name in names {
        let view = tensors.tensor(&name).map_err(|e| format(&e))?;
        if view.dtype() != Dtype::F32 {
            return Err(format(&"tensors must be F32"));
        }
        weights.extend(view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
        layout.tensors.push(TensorSpec { name, shape: view.shape().to_vec() });
    }
    layout.validate()?;
    Ok(Checkpoint { layout, weights, metadata })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> ModelLayout {
        ModelLayout {
            tensors: vec![
                TensorSpec { name: "fc2.weight".into(), shape: vec![2, 3] },
                TensorSpec { name: "fc2.bias".into(), shape: vec![2] },
                TensorSpec { name: "a.weight".into(), shape: vec![1, 1] },
            ],
        }
    }

    #[test]
    fn round_trip_keeps_order_values_and_metadata() {
        let weights: Vec<f32> = (0..9).map(|i| i as f32 * 0.5 - 1.0).collect();
        let metadata = BTreeMap::from([("round".to_string(), "7".to_string())]);
        let bytes = encode(&layout(), &weights, &metadata).unwrap();
        let checkpoint = decode(&bytes).unwrap();
        assert_eq!(checkpoint.layout, layout());
        assert_eq!(checkpoint.weights, weights);
        assert_eq!(checkpoint.metadata, metadata);
    }

    #[test]
    fn mismatches_and_garbage_are_rejected() {
        assert!(matches!(
            encode(&layout(), &[0.0; 8], &BTreeMap::new()),
            Err(CheckpointError::Length { layout: 9, weights: 8 })
        ));
        let duplicate = ModelLayout {
            tensors: vec![
                TensorSpec { name: "w".into(), shape: vec![1] },
                TensorSpec { name: "w".into(), shape: vec![1] },
            ],
        };
        assert!(matches!(encode(&duplicate, &[0.0; 2], &BTreeMap::new()), Err(CheckpointError::Layout(_))));
        assert!(matches!(decode(b"not a checkpoint"), Err(CheckpointError::Format(_))));
        let bytes = encode(&layout(), &[0.0; 9], &BTreeMap::new()).unwrap();
        assert!(decode(&bytes[..bytes.len() - 1]).is_err());
    }
}
