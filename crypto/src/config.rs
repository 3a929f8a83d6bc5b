//! The public parameters of one aggregation round, and the round context
//! that binds every key, signature and message to them.

use crate::dp::{DpParams, Mechanism};
use crate::error::ConfigError;
use crate::graph::{CommunicationGraph, GraphSpec};
use crate::kdf::{LABEL_GRAPH_PLACEMENT, hkdf_sha256};
use crate::metrics::MetricSet;
use crate::quantize::{NormCheck, QuantizationSpec, Transform};
use crate::wire::{DecodeError, Reader, Writer};

pub use crate::limits::{MAX_CLIENTS, MAX_VECTOR_LEN};

/// Whether `threshold` is a strict majority of the k + 1 holders of a
/// client's self-mask seed shares (its `degree` neighbours and itself):
/// 2t > k + 1, as the active variant requires (see
/// [`ConfigError::ThresholdBelowMajority`]).
pub fn active_threshold_holds(threshold: u32, degree: u32) -> bool {
    threshold >= min_active_threshold(degree)
}

/// The least threshold the active variant accepts with `degree`
/// neighbours: ⌊(k + 1) / 2⌋ + 1, the least t with 2t > k + 1.
pub fn min_active_threshold(degree: u32) -> u32 {
    threshold_for_margin(degree, 1)
}

/// The least threshold t whose collusion margin 2t − k − 1 with `degree`
/// neighbours is at least `margin`: with fewer than that many of a
/// coordinator's own clients in a neighbourhood, no client of it is
/// exposed (THREAT_MODEL claim 53).
pub fn threshold_for_margin(degree: u32, margin: u32) -> u32 {
    (degree + 1 + margin).div_ceil(2)
}

/// Which adversary the protocol defends against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
pub enum Variant {
    /// Honest-but-curious server: no signatures, no consistency check.
    SemiHonest,
    /// Actively malicious server: advertised keys are signed and clients
    /// check that they all saw the same survivor list before unmasking.
    Active,
}

/// Everything the clients and the server must agree on before a round.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundConfig {
    /// Random identifier chosen by the server for the task or session.
    pub session: [u8; 16],
    /// Round number within the session.
    pub round: u64,
    /// Adversary model.
    pub variant: Variant,
    /// Number of selected clients n; their ids are `1..=n`.
    pub clients: u32,
    /// Ed25519 identity keys of clients `1..=n` (active variant only).
    pub identities: Vec<[u8; 32]>,
    /// Communication graph.
    pub graph: GraphSpec,
    /// Shares needed to reconstruct a secret (t).
    pub threshold: u32,
    /// Coordinates per masked vector.
    pub vector_len: u32,
    /// The vector lives in Z_{2^modulus_bits}.
    pub modulus_bits: u8,
    /// How clients quantize their updates.
    pub quantization: QuantizationSpec,
    /// The digest ([`model_digest`](crate::policy::model_digest)) of the
    /// model every client of a sync round trains from; `None` for an async
    /// task's group, whose members trained from different versions. Part of
    /// the round context, so every member of a sync round checks that it
    /// was served the model the others were (THREAT_MODEL claim 56).
    pub model: Option<[u8; 16]>,
}

/// SHA-256 of the encoded [`RoundConfig`]: salts every key derivation and
/// opens every message, so nothing carries over between rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RoundContext(pub [u8; 32]);

impl RoundConfig {
    /// Checks every parameter against the protocol's limits.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.clients < 2 {
            return Err(ConfigError::TooFewClients(self.clients));
        }
        if self.clients > MAX_CLIENTS {
            return Err(ConfigError::TooManyClients { max: MAX_CLIENTS, got: self.clients });
        }
        if let GraphSpec::Harary { degree, .. } = self.graph {
            let even = degree % 2 == 0;
            if degree < 2 || degree > self.clients - 1 || (!even && degree != self.clients - 1) {
                return Err(ConfigError::BadDegree { degree, clients: self.clients });
            }
        }
        let degree = self.degree();
        if self.threshold == 0 || self.threshold > degree {
            return Err(ConfigError::BadThreshold { threshold: self.threshold, degree });
        }
        // Checked by every client before it reveals anything (Client::start
        // validates the announced round): see ThresholdBelowMajority.
        if self.variant == Variant::Active && !active_threshold_holds(self.threshold, degree) {
            return Err(ConfigError::ThresholdBelowMajority { threshold: self.threshold, degree });
        }
        if self.vector_len == 0 || self.vector_len > MAX_VECTOR_LEN {
            return Err(ConfigError::BadVectorLength { max: MAX_VECTOR_LEN, got: self.vector_len });
        }
        let identities = self.identities.len() as u32;
        match self.variant {
            Variant::Active if identities != self.clients => {
                return Err(ConfigError::MissingIdentities { expected: self.clients, got: identities });
            }
            Variant::SemiHonest if identities != 0 => {
                return Err(ConfigError::MissingIdentities { expected: 0, got: identities });
            }
            _ => {}
        }
        // One signature must count for one client only (the consistency
        // check counts signers).
        let mut by_key: Vec<usize> = (0..self.identities.len()).collect();
        by_key.sort_unstable_by_key(|&i| self.identities[i]);
        if let Some(pair) =
            by_key.windows(2).find(|pair| self.identities[pair[0]] == self.identities[pair[1]])
        {
            let (first, second) = (pair[0].min(pair[1]) as u32 + 1, pair[0].max(pair[1]) as u32 + 1);
            return Err(ConfigError::DuplicateIdentity { first, second });
        }
        // The noise is split so that any `noise_shares` inputs carry all of
        // it; the coordinator can only unmask sums of more than t.
        if let Some(privacy) = &self.quantization.privacy
            && privacy.noise_shares > self.threshold
        {
            return Err(ConfigError::BadQuantization(
                "the noise must be split into at most threshold shares: a sum of fewer would carry too little",
            ));
        }
        // Also checks the ring width (2 to 32 bits) against the clients.
        self.quantization.validate(self.modulus_bits, self.clients)?;
        // A validated round's vector is the committed part and the tail of
        // blindings (`validation::RoundValidation`).
        if self.quantization.validation.is_some() {
            let layout = crate::validation::RoundValidation::new(self)
                .map_err(|_| ConfigError::BadQuantization("the validation's bound does not fit the proof"))?
                .map(|v| v.vector_len());
            if layout != Some(self.vector_len as usize) {
                return Err(ConfigError::BadQuantization(
                    "a validated round's vector is its validated dimension and the blindings' tail",
                ));
            }
        }
        Ok(())
    }

    /// Neighbours per client.
    pub fn degree(&self) -> u32 {
        match self.graph {
            GraphSpec::Complete => self.clients - 1,
            GraphSpec::Harary { degree } => degree,
        }
    }

    /// Builds the communication graph, placed by [`placement_seed`](Self::placement_seed).
    pub fn communication_graph(&self) -> CommunicationGraph {
        CommunicationGraph::new(self.clients, &self.graph, &self.placement_seed())
    }

    /// The seed of the permutation that places clients on the Harary ring:
    /// HKDF-SHA256 of the round context. Nothing in the announced round
    /// chooses it directly; it changes only when the round does.
    pub fn placement_seed(&self) -> [u8; 32] {
        let mut seed = [0u8; 32];
        hkdf_sha256(&self.context().0, &[], &[LABEL_GRAPH_PLACEMENT], &mut seed);
        seed
    }

    /// The round context: SHA-256 over a label and the canonical encoding.
    pub fn context(&self) -> RoundContext {
        let mut writer = Writer::raw();
        writer.bytes(b"cohort/secagg/v1/round-context");
        self.encode_into(&mut writer);
        let digest = ring::digest::digest(&ring::digest::SHA256, &writer.finish());
        let mut out = [0u8; 32];
        out.copy_from_slice(digest.as_ref());
        RoundContext(out)
    }

    /// Mask for reducing values into Z_{2^modulus_bits}.
    pub fn modulus_mask(&self) -> u32 {
        if self.modulus_bits >= 32 { u32::MAX } else { (1u32 << self.modulus_bits) - 1 }
    }

    pub(crate) fn encode_into(&self, w: &mut Writer) {
        w.bytes(&self.session).u64(self.round);
        w.u8(match self.variant {
            Variant::SemiHonest => 0,
            Variant::Active => 1,
        });
        w.u32(self.clients).count(self.identities.len());
        for key in &self.identities {
            w.bytes(key);
        }
        match &self.graph {
            GraphSpec::Complete => {
                w.u8(0);
            }
            GraphSpec::Harary { degree } => {
                w.u8(1).u32(*degree);
            }
        }
        w.u32(self.threshold).u32(self.vector_len).u8(self.modulus_bits);
        w.u32(self.quantization.clip.to_bits()).u32(self.quantization.max_weight);
        match &self.quantization.transform {
            Transform::None => {
                w.u8(0);
            }
            Transform::Rotate { block, seed } => {
                w.u8(1).u32(*block).bytes(seed);
            }
            Transform::Sketch { rows, columns, top_k, seed } => {
                w.u8(2).u32(*rows).u32(*columns).u32(*top_k).bytes(seed);
            }
        }
        w.u8(self.quantization.metrics.bits());
        match &self.quantization.privacy {
            None => {
                w.u8(0);
            }
            Some(p) => {
                w.u8(1)
                    .u8(p.mechanism.code())
                    .u32(p.clip_norm.to_bits())
                    .u64(p.noise_multiplier.to_bits())
                    .u64(p.scale.to_bits())
                    .u32(p.noise_shares);
            }
        }
        match &self.model {
            None => {
                w.u8(0);
            }
            Some(digest) => {
                w.u8(1).bytes(digest);
            }
        }
        match &self.quantization.validation {
            None => {
                w.u8(0);
            }
            Some(check) => {
                w.u8(1).u32(check.l2_clip.to_bits()).u32(check.dimension);
            }
        }
        match self.quantization.scale {
            None => {
                w.u8(0);
            }
            Some(scale) => {
                w.u8(1).u64(scale.to_bits());
            }
        }
    }

    pub(crate) fn decode_from(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        let session = r.array::<16>()?;
        let round = r.u64()?;
        let variant = match r.u8()? {
            0 => Variant::SemiHonest,
            1 => Variant::Active,
            _ => return Err(DecodeError::Invalid("variant")),
        };
        let clients = r.u32()?;
        let count = r.count(MAX_CLIENTS as usize, 32, "identity list")?;
        let identities = (0..count).map(|_| r.array::<32>()).collect::<Result<_, _>>()?;
        let graph = match r.u8()? {
            0 => GraphSpec::Complete,
            1 => GraphSpec::Harary { degree: r.u32()? },
            _ => return Err(DecodeError::Invalid("graph kind")),
        };
        let threshold = r.u32()?;
        let vector_len = r.u32()?;
        let modulus_bits = r.u8()?;
        let clip = f32::from_bits(r.u32()?);
        let max_weight = r.u32()?;
        let transform = match r.u8()? {
            0 => Transform::None,
            1 => Transform::Rotate { block: r.u32()?, seed: r.array()? },
            2 => Transform::Sketch { rows: r.u32()?, columns: r.u32()?, top_k: r.u32()?, seed: r.array()? },
            _ => return Err(DecodeError::Invalid("transform")),
        };
        let metrics = MetricSet::from_bits(r.u8()?).ok_or(DecodeError::Invalid("metric set"))?;
        let privacy = match r.u8()? {
            0 => None,
            1 => Some(DpParams {
                mechanism: Mechanism::from_code(r.u8()?).ok_or(DecodeError::Invalid("DP mechanism"))?,
                clip_norm: f32::from_bits(r.u32()?),
                noise_multiplier: f64::from_bits(r.u64()?),
                scale: f64::from_bits(r.u64()?),
                noise_shares: r.u32()?,
            }),
            _ => return Err(DecodeError::Invalid("privacy")),
        };
        let model = match r.u8()? {
            0 => None,
            1 => Some(r.array::<16>()?),
            _ => return Err(DecodeError::Invalid("model digest")),
        };
        let validation = match r.u8()? {
            0 => None,
            1 => Some(NormCheck { l2_clip: f32::from_bits(r.u32()?), dimension: r.u32()? }),
            _ => return Err(DecodeError::Invalid("validation")),
        };
        let scale = match r.u8()? {
            0 => None,
            1 => Some(f64::from_bits(r.u64()?)),
            _ => return Err(DecodeError::Invalid("fitted ring scale")),
        };
        let config = RoundConfig {
            session,
            round,
            variant,
            clients,
            identities,
            graph,
            threshold,
            vector_len,
            modulus_bits,
            quantization: QuantizationSpec {
                clip,
                max_weight,
                transform,
                metrics,
                privacy,
                validation,
                scale,
            },
            model,
        };
        config.validate().map_err(|_| DecodeError::Invalid("round configuration"))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ConfigError::*;
    use crate::messages::ServerMessage;

    /// Ten clients, degree 4, threshold 3, 16 bits: valid.
    fn base() -> RoundConfig {
        RoundConfig {
            session: [1; 16],
            round: 1,
            variant: Variant::SemiHonest,
            clients: 10,
            identities: Vec::new(),
            graph: GraphSpec::Harary { degree: 4 },
            threshold: 3,
            vector_len: 8,
            modulus_bits: 16,
            quantization: QuantizationSpec {
                clip: 1.0,
                max_weight: 1,
                transform: Transform::None,
                metrics: crate::MetricSet::NONE,
                privacy: None,
                validation: None,
                scale: None,
            },
            model: None,
        }
    }

    fn with(change: impl FnOnce(&mut RoundConfig)) -> Result<(), ConfigError> {
        let mut config = base();
        change(&mut config);
        config.validate()
    }

    /// A distinct 32-byte key per client index.
    fn identity(i: u32) -> [u8; 32] {
        let mut key = [9; 32];
        key[..4].copy_from_slice(&i.to_le_bytes());
        key
    }

    fn active(config: &mut RoundConfig) {
        config.variant = Variant::Active;
        config.identities = (0..config.clients).map(identity).collect();
    }

    /// Each limit accepts its last valid value and refuses the next one.
    #[test]
    fn every_limit_is_enforced_at_its_boundary() {
        assert_eq!(with(|_| {}), Ok(()));
        let complete = |clients: u32| {
            move |c: &mut RoundConfig| {
                c.clients = clients;
                c.graph = GraphSpec::Complete;
                c.threshold = 1;
            }
        };
        assert_eq!(with(complete(1)), Err(TooFewClients(1)));
        assert_eq!(with(complete(2)), Ok(()));
        let many = |clients: u32| {
            move |c: &mut RoundConfig| {
                c.clients = clients;
                c.modulus_bits = 32;
            }
        };
        assert_eq!(with(many(MAX_CLIENTS)), Ok(()));
        assert_eq!(
            with(many(MAX_CLIENTS + 1)),
            Err(TooManyClients { max: MAX_CLIENTS, got: MAX_CLIENTS + 1 })
        );

        let degree = |degree: u32| {
            move |c: &mut RoundConfig| {
                c.graph = GraphSpec::Harary { degree };
                c.threshold = 1;
            }
        };
        for valid in [2, 8, 9] {
            assert_eq!(with(degree(valid)), Ok(()), "degree {valid}");
        }
        for invalid in [0, 1, 3, 7, 10, 11] {
            assert_eq!(
                with(degree(invalid)),
                Err(BadDegree { degree: invalid, clients: 10 }),
                "degree {invalid}"
            );
        }

        assert_eq!(with(|c| c.threshold = 0), Err(BadThreshold { threshold: 0, degree: 4 }));
        assert_eq!(with(|c| c.threshold = 4), Ok(()));
        assert_eq!(with(|c| c.threshold = 5), Err(BadThreshold { threshold: 5, degree: 4 }));
        assert_eq!(with(|c| c.graph = GraphSpec::Complete), Ok(()));
        assert_eq!(
            with(|c| {
                c.graph = GraphSpec::Complete;
                c.threshold = 10;
            }),
            Err(BadThreshold { threshold: 10, degree: 9 })
        );

        assert_eq!(
            with(|c| {
                active(c);
                c.threshold = 2;
            }),
            Err(ThresholdBelowMajority { threshold: 2, degree: 4 })
        );
        assert_eq!(with(active), Ok(()));
        // One identity key twice in the roster: a signature of it would
        // count for two clients.
        assert_eq!(
            with(|c| {
                active(c);
                c.identities[7] = c.identities[2];
            }),
            Err(DuplicateIdentity { first: 3, second: 8 })
        );
        // The boundary 2t > k + 1 where k + 1 is even: k = 9, t = 5 is a
        // tie among the ten holders of a seed's shares, t = 6 a majority.
        let complete_active = |threshold: u32| {
            move |c: &mut RoundConfig| {
                active(c);
                c.graph = GraphSpec::Complete;
                c.threshold = threshold;
            }
        };
        assert_eq!(with(complete_active(5)), Err(ThresholdBelowMajority { threshold: 5, degree: 9 }));
        assert_eq!(with(complete_active(6)), Ok(()));

        assert_eq!(with(|c| c.modulus_bits = 1), Err(BadModulusBits(1)));
        assert_eq!(with(|c| c.modulus_bits = 5), Ok(()));
        assert_eq!(with(|c| c.modulus_bits = 32), Ok(()));
        assert_eq!(with(|c| c.modulus_bits = 33), Err(BadModulusBits(33)));
        // ⌊15 / 10⌋ = 1 level: too small a ring for ten clients.
        assert!(matches!(with(|c| c.modulus_bits = 4), Err(BadQuantization(_))));
        assert_eq!(with(|c| c.vector_len = 0), Err(BadVectorLength { max: MAX_VECTOR_LEN, got: 0 }));
        assert_eq!(with(|c| c.vector_len = MAX_VECTOR_LEN), Ok(()));
        assert_eq!(
            with(|c| c.vector_len = MAX_VECTOR_LEN + 1),
            Err(BadVectorLength { max: MAX_VECTOR_LEN, got: MAX_VECTOR_LEN + 1 })
        );

        assert_eq!(
            with(|c| {
                active(c);
                c.identities.pop();
            }),
            Err(MissingIdentities { expected: 10, got: 9 })
        );
        assert_eq!(with(|c| c.identities.push([9; 32])), Err(MissingIdentities { expected: 0, got: 1 }));
    }

    #[test]
    fn degree_and_modulus_mask() {
        let mut config = RoundConfig { graph: GraphSpec::Complete, modulus_bits: 32, ..base() };
        assert_eq!((config.degree(), config.modulus_mask()), (9, u32::MAX));
        config.graph = GraphSpec::Harary { degree: 4 };
        config.modulus_bits = 12;
        assert_eq!((config.degree(), config.modulus_mask()), (4, 0xfff));
    }

    /// The metrics a round's vectors carry are part of the round: they
    /// travel in the setup, change the context, and a bit that names no
    /// metric is refused.
    /// The DP parameters travel in the setup bit for bit, change the
    /// context, and an unknown mechanism is refused.
    #[test]
    fn the_privacy_parameters_are_part_of_the_round() {
        let mut config = base();
        config.quantization = QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: Transform::Rotate { block: 8, seed: [2; 32] },
            metrics: MetricSet::NONE,
            privacy: Some(DpParams {
                mechanism: Mechanism::DiscreteGaussian,
                clip_norm: 0.5,
                noise_multiplier: 1.234_567_890_123,
                scale: 777.25,
                noise_shares: 3,
            }),
            validation: None,
            scale: None,
        };
        assert_eq!(config.validate(), Ok(()));
        let bytes = ServerMessage::Setup(config.clone()).encode();
        assert_eq!(ServerMessage::decode(&bytes), Ok(ServerMessage::Setup(config.clone())));
        let mut other = config.clone();
        if let Some(p) = other.quantization.privacy.as_mut() {
            p.noise_multiplier = 1.234_567_890_124;
        }
        assert_ne!(config.context(), other.context());
        // The mechanism byte follows the metric set and the privacy flag;
        // the model and validation flags (none) end the encoding.
        let at = bytes.len() - (4 + 8 + 8 + 4) - 1 - 1 - 1 - 1;
        let mut bad = bytes.clone();
        bad[at] = 9;
        assert_eq!(ServerMessage::decode(&bad), Err(DecodeError::Invalid("DP mechanism")));
        // More noise shares than the threshold: invalid.
        if let Some(p) = config.quantization.privacy.as_mut() {
            p.noise_shares = 4;
        }
        assert!(config.validate().is_err());
    }

    #[test]
    fn the_metric_set_is_part_of_the_round() {
        let mut config = base();
        config.quantization.metrics = MetricSet::ALL;
        let bytes = ServerMessage::Setup(config.clone()).encode();
        assert_eq!(ServerMessage::decode(&bytes), Ok(ServerMessage::Setup(config.clone())));
        assert_ne!(config.context(), base().context());
        // The metric set is the byte before the privacy, model,
        // validation and scale flags.
        let mut bad = bytes.clone();
        let at = bad.len() - 5;
        bad[at] = 0x40;
        assert_eq!(ServerMessage::decode(&bad), Err(DecodeError::Invalid("metric set")));
    }

    /// The model's digest travels with the round and is part of its
    /// context: a round announcing another model is another round.
    #[test]
    fn the_model_digest_is_part_of_the_round() {
        let mut config = base();
        config.model = Some([5; 16]);
        let bytes = ServerMessage::Setup(config.clone()).encode();
        assert_eq!(ServerMessage::decode(&bytes), Ok(ServerMessage::Setup(config.clone())));
        assert_eq!(bytes.len(), ServerMessage::Setup(base()).encode().len() + 16);
        assert_ne!(config.context(), base().context());
        let other = RoundConfig { model: Some([6; 16]), ..config.clone() };
        assert_ne!(config.context(), other.context());
        let mut bad = bytes.clone();
        let at = bad.len() - 19;
        bad[at] = 2;
        assert_eq!(ServerMessage::decode(&bad), Err(DecodeError::Invalid("model digest")));
        assert!(ServerMessage::decode(&bytes[..bytes.len() - 2]).is_err(), "a digest cut short");
    }

    /// The validation's clip and dimension travel with the round and are
    /// part of its context; the vector must be the validated dimension
    /// followed by the blindings' tail.
    #[test]
    fn the_validation_is_part_of_the_round() {
        let mut config = base();
        config.quantization.validation = Some(NormCheck { l2_clip: 2.5, dimension: 5 });
        let layout = crate::validation::RoundValidation::new(&config).unwrap().unwrap();
        assert_eq!(layout.dimension(), 5);
        config.vector_len = layout.vector_len() as u32;
        assert_eq!(config.validate(), Ok(()));
        let bytes = ServerMessage::Setup(config.clone()).encode();
        assert_eq!(ServerMessage::decode(&bytes), Ok(ServerMessage::Setup(config.clone())));
        assert_eq!(bytes.len(), ServerMessage::Setup(base()).encode().len() + 8);
        let mut other = config.clone();
        other.quantization.validation = Some(NormCheck { l2_clip: 2.25, dimension: 5 });
        assert_ne!(config.context(), other.context());
        assert_ne!(config.context(), base().context());
        let mut bad = bytes.clone();
        let at = bad.len() - 10;
        bad[at] = 2;
        assert_eq!(ServerMessage::decode(&bad), Err(DecodeError::Invalid("validation")));
        // A vector without room for the tail, or under DP, is refused.
        assert!(
            with(|c| c.quantization.validation = Some(NormCheck { l2_clip: 1.0, dimension: 8 })).is_err()
        );
        let mut short = config.clone();
        short.vector_len -= 1;
        assert!(short.validate().is_err());
        let mut negative = config.clone();
        negative.quantization.validation = Some(NormCheck { l2_clip: -1.0, dimension: 5 });
        assert!(negative.validate().is_err());
    }

    /// A fitted ring's scale travels with the round and is part of its
    /// context: a round at another scale is another round.
    #[test]
    fn the_fitted_scale_is_part_of_the_round() {
        let mut config = base();
        config.quantization.transform = Transform::Rotate { block: 8, seed: [3; 32] };
        let exact = config.clone();
        config.quantization.scale = Some(37.5);
        assert_eq!(config.validate(), Ok(()));
        let bytes = ServerMessage::Setup(config.clone()).encode();
        assert_eq!(ServerMessage::decode(&bytes), Ok(ServerMessage::Setup(config.clone())));
        assert_eq!(bytes.len(), ServerMessage::Setup(exact.clone()).encode().len() + 8);
        assert_ne!(config.context(), exact.context());
        let mut other = config.clone();
        other.quantization.scale = Some(37.25);
        assert_ne!(config.context(), other.context());
        let mut bad = bytes.clone();
        let at = bad.len() - 9;
        bad[at] = 2;
        assert_eq!(ServerMessage::decode(&bad), Err(DecodeError::Invalid("fitted ring scale")));
        // A scale that is not a positive number is refused where it is decoded.
        for scale in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let mut bad = bytes.clone();
            let at = bad.len() - 8;
            bad[at..].copy_from_slice(&scale.to_bits().to_le_bytes());
            assert!(ServerMessage::decode(&bad).is_err(), "scale {scale}");
        }
        assert!(ServerMessage::decode(&bytes[..bytes.len() - 1]).is_err(), "a scale cut short");
    }
}
