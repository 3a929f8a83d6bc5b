//! The one place a round's public parameters ([`RoundConfig`]) and its
//! [`Quantizer`] are built from task settings: the coordinator's rounds,
//! the command-line tool's in-process secure mean and the benchmarks.

use cohort_crypto::dp::{DpParams, block_for};
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::policy::{GraphKind, TaskSecurity};
use cohort_crypto::quantize::NormCheck;
use cohort_crypto::validation::RoundValidation;
use cohort_crypto::{MetricSet, QuantizationSpec, Quantizer, RoundConfig, Transform, Variant};
use rand_core::Rng;

use crate::spec::{QuantizationConfig, SpecError, TaskSpec};

/// What every round of a task (or a benchmark) repeats.
#[derive(Debug, Clone)]
pub struct RoundBuilder<'a> {
    /// How clients quantize (and transform) their updates.
    pub quantization: &'a QuantizationConfig,
    /// The client metrics summed under the masks.
    pub metrics: MetricSet,
    /// Adversary model.
    pub variant: Variant,
    /// Communication graph.
    pub graph: GraphSpec,
    /// Shares needed to reconstruct a secret (t).
    pub threshold: u32,
    /// Parameters of the model (the update's length before encoding).
    pub dimension: usize,
    /// Distributed differential privacy, with the ring's bits: rounds then
    /// rotate in blocks of [`block_for`] the dimension and carry no
    /// weights or metrics.
    pub privacy: Option<(DpParams, u8)>,
    /// Input validation: each client clips its update to this L2 norm and
    /// proves its quantized vector within the bound that follows
    /// ([`cohort_crypto::validation`]).
    pub validation: Option<f32>,
}

/// A round's public randomness: its session id and the seed of its
/// quantizer's transform, with the scale of a fitted ring. All are
/// announced to every client of the round; with the task's settings and
/// the roster they fix the round, so that another coordinator replica
/// builds the same round from them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RoundSeeds {
    /// The session id.
    #[serde(with = "hex::serde")]
    pub session: [u8; 16],
    /// The transform seed.
    #[serde(with = "hex::serde")]
    pub transform: [u8; 32],
    /// A fitted ring's scale ([`QuantizationConfig::scale_for`]), chosen
    /// by the coordinator that opened the round; `None` in the exact ring
    /// (and, in a fitted ring, the safe scale).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scale: Option<f64>,
}

impl RoundSeeds {
    /// Fresh seeds drawn from `rng`, without a scale.
    pub fn draw(rng: &mut impl Rng) -> Self {
        let mut seeds = Self { session: [0; 16], transform: [0; 32], scale: None };
        rng.fill_bytes(&mut seeds.session);
        rng.fill_bytes(&mut seeds.transform);
        seeds
    }
}

/// A built round: its public parameters and the quantizer that encodes and
/// decodes under them.
#[derive(Debug)]
pub struct BuiltRound {
    /// The parameters every participant checks and agrees on.
    pub config: RoundConfig,
    /// The round's quantizer (its transform seed is the round's).
    pub quantizer: Quantizer,
}

impl<'a> RoundBuilder<'a> {
    /// Rounds of `spec`, whose security parameters are `security` (derived
    /// once from it, see [`TaskPlan::security`](crate::spec::TaskPlan::security)).
    pub fn for_task(spec: &'a TaskSpec, security: &TaskSecurity) -> Self {
        Self {
            quantization: &spec.quantization,
            metrics: spec.client_metrics.aggregate,
            variant: security.variant,
            graph: match security.graph {
                GraphKind::Complete => GraphSpec::Complete,
                GraphKind::Sparse => GraphSpec::Harary { degree: security.degree },
            },
            threshold: security.threshold,
            dimension: spec.model.layout.len(),
            privacy: security.privacy.map(|params| (params, security.modulus_bits)),
            validation: spec.validation_clip(),
        }
    }

    /// Round `round` of `clients` clients (with their Ed25519 identity keys
    /// in roster order in the active variant; none in the semi-honest one),
    /// training from the model with digest `model` (a sync round; `None`
    /// for an async group), with a fresh session id and transform seed
    /// drawn from `rng`.
    pub fn build(
        &self,
        round: u64,
        clients: u32,
        identities: Vec<[u8; 32]>,
        model: Option<[u8; 16]>,
        rng: &mut impl Rng,
    ) -> Result<BuiltRound, SpecError> {
        self.build_with(round, clients, identities, model, RoundSeeds::draw(rng))
    }

    /// Round `round` with the given `seeds`: the same round wherever it is
    /// built from the same task settings, roster, model and seeds.
    pub fn build_with(
        &self,
        round: u64,
        clients: u32,
        identities: Vec<[u8; 32]>,
        model: Option<[u8; 16]>,
        seeds: RoundSeeds,
    ) -> Result<BuiltRound, SpecError> {
        let RoundSeeds { session, transform: transform_seed, scale } = seeds;
        let q = self.quantization;
        let (quantization, modulus_bits) = match self.privacy {
            Some((params, modulus_bits)) => (
                QuantizationSpec {
                    clip: params.clip_norm,
                    max_weight: 1,
                    transform: Transform::Rotate { block: block_for(self.dimension), seed: transform_seed },
                    metrics: MetricSet::NONE,
                    privacy: Some(params),
                    validation: None,
                    scale: None,
                },
                modulus_bits,
            ),
            None => {
                let scale = scale.or_else(|| q.scale_for(clients, None));
                (q.round_spec(transform_seed, self.metrics, scale)?, q.ring_bits(clients)?)
            }
        };
        let mut quantizer = Quantizer::new(quantization, modulus_bits, clients)?;
        let mut quantization = quantization;
        let mut vector_len = quantizer.encoded_len(self.dimension);
        if let Some(l2_clip) = self.validation {
            let dimension = vector_len as u32;
            quantization.validation = Some(NormCheck { l2_clip, dimension });
            quantizer = Quantizer::new(quantization, modulus_bits, clients)?;
            let layout = RoundValidation::new_for(&quantization, modulus_bits, clients)
                .map_err(|e| SpecError::field("validation", e.to_string()))?;
            vector_len = layout.vector_len();
        }
        let config = RoundConfig {
            session,
            round,
            variant: self.variant,
            clients,
            identities,
            graph: self.graph.clone(),
            threshold: self.threshold,
            vector_len: vector_len as u32,
            modulus_bits,
            quantization,
            model,
        };
        Ok(BuiltRound { config, quantizer })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tests::small_spec;
    use rand_core::SeedableRng;

    #[test]
    fn a_task_round_announces_the_pinned_security_and_fresh_seeds() {
        let mut spec = small_spec();
        spec.quantization.rotate = true;
        spec.secure_aggregation.variant = Some(crate::spec::VariantChoice::Active);
        // 2t > k + 1 with k = 5.
        spec.secure_aggregation.threshold = Some(4);
        let security = crate::spec::TaskPlan::new(spec.clone()).unwrap().security();
        let builder = RoundBuilder::for_task(&spec, &security);
        let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(7);
        let identities: Vec<[u8; 32]> = (0..6u8).map(|i| [i; 32]).collect();
        let one = builder.build(3, 6, identities.clone(), Some([4; 16]), &mut rng).unwrap();
        let two = builder.build(3, 6, identities.clone(), Some([4; 16]), &mut rng).unwrap();
        one.config.validate().unwrap();
        assert_eq!(cohort_crypto::policy::TaskSecurity::of_round(&one.config).unwrap(), security);
        assert_eq!((one.config.round, one.config.clients, &one.config.identities), (3, 6, &identities));
        assert_eq!(one.config.vector_len as usize, one.quantizer.encoded_len(spec.model.layout.len()));
        // Only the per-round randomness differs between two builds.
        assert_ne!(one.config.session, two.config.session);
        assert_ne!(one.config.quantization, two.config.quantization);
        assert_eq!(
            RoundConfig { session: one.config.session, quantization: one.config.quantization, ..two.config },
            one.config
        );
    }

    #[test]
    fn the_same_seeds_build_the_same_round_anywhere() {
        let mut spec = small_spec();
        spec.quantization.rotate = true;
        let security = crate::spec::TaskPlan::new(spec.clone()).unwrap().security();
        let builder = RoundBuilder::for_task(&spec, &security);
        let seeds = RoundSeeds::draw(&mut rand_chacha::ChaCha20Rng::seed_from_u64(9));
        let here = builder.build_with(4, 6, Vec::new(), Some([4; 16]), seeds).unwrap();
        // As another replica rebuilds it from the seeds it was sent as JSON.
        let sent: RoundSeeds = serde_json::from_str(&serde_json::to_string(&seeds).unwrap()).unwrap();
        let there = RoundBuilder::for_task(&spec, &security)
            .build_with(4, 6, Vec::new(), Some([4; 16]), sent)
            .unwrap();
        assert_eq!(here.config, there.config);
        assert_eq!(here.config.session, seeds.session);
        // One seed changed is another round, and so is another model.
        let other = RoundSeeds { transform: [1; 32], ..seeds };
        assert_ne!(builder.build_with(4, 6, Vec::new(), Some([4; 16]), other).unwrap().config, here.config);
        let elsewhere = builder.build_with(4, 6, Vec::new(), Some([5; 16]), seeds).unwrap();
        assert_ne!(elsewhere.config.context(), here.config.context());
    }

    /// A fitted ring's scale travels in the seeds bit for bit (JSON, as a
    /// replica is sent them), so the replica builds the same round; seeds
    /// without a scale build the safe scale's round, and the exact ring
    /// ignores a scale.
    #[test]
    fn a_fitted_ring_scale_rides_in_the_seeds() {
        use crate::spec::RingSizing;
        let mut spec = small_spec();
        spec.quantization.rotate = true;
        spec.quantization.bits = Some(9);
        spec.quantization.ring = RingSizing::Fitted;
        let security = crate::spec::TaskPlan::new(spec.clone()).unwrap().security();
        let builder = RoundBuilder::for_task(&spec, &security);
        let mut seeds = RoundSeeds::draw(&mut rand_chacha::ChaCha20Rng::seed_from_u64(9));
        // A scale whose shortest decimal form is long.
        seeds.scale = Some(1_234_567.0 / 3.0 / 1_000.0);
        let here = builder.build_with(4, 6, Vec::new(), Some([4; 16]), seeds).unwrap();
        assert_eq!(here.config.quantization.scale, seeds.scale);
        let sent: RoundSeeds = serde_json::from_str(&serde_json::to_string(&seeds).unwrap()).unwrap();
        assert_eq!(sent.scale.map(f64::to_bits), seeds.scale.map(f64::to_bits));
        let there = RoundBuilder::for_task(&spec, &security)
            .build_with(4, 6, Vec::new(), Some([4; 16]), sent)
            .unwrap();
        assert_eq!(here.config.context(), there.config.context());
        let unscaled = RoundSeeds { scale: None, ..seeds };
        let safe = builder.build_with(4, 6, Vec::new(), Some([4; 16]), unscaled).unwrap();
        assert_eq!(safe.config.quantization.scale, cohort_crypto::quantize::safe_scale(9, 6, 1.0));
        // Seeds stored before the field existed read as no scale.
        let old = r#"{"session":"00000000000000000000000000000000","transform":"0000000000000000000000000000000000000000000000000000000000000000"}"#;
        assert_eq!(serde_json::from_str::<RoundSeeds>(old).unwrap().scale, None);
        let mut exact = spec.clone();
        exact.quantization.ring = RingSizing::Exact;
        let exact_security = crate::spec::TaskPlan::new(exact.clone()).unwrap().security();
        let round = RoundBuilder::for_task(&exact, &exact_security)
            .build_with(4, 6, Vec::new(), None, seeds)
            .unwrap();
        assert_eq!(round.config.quantization.scale, None);
    }
}
