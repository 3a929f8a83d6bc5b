//! What an administrator submits to create a task, with defaults and
//! validation. Everything needed to run its rounds is derived from it.

use cohort_crypto::config::active_threshold_holds;
use cohort_crypto::params::{Adversary, ParameterTarget, derive_complete, derive_sparse};
use cohort_crypto::policy::{GraphKind, Policy, TaskSecurity, TransformKind};
use cohort_crypto::{MetricSet, QuantizationSpec, Quantizer, SumSpread, Transform, Variant};
use serde::{Deserialize, Serialize};

use crate::checkpoint::ModelLayout;
use crate::optimizer::ServerOptimizer;
use crate::privacy::{PrivacyPlan, PrivacySpec};

/// A federated training task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSpec {
    /// Human-readable name: 1 to 200 characters, not all white space, no
    /// control characters.
    #[schema(
        min_length = 1,
        max_length = 200,
        pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*[^\\s\\u0000-\\u001F\\u007F-\\u009F][^\\u0000-\\u001F\\u007F-\\u009F]*$"
    )]
    pub name: String,
    /// The model: tensor layout and initial weights.
    pub model: ModelSpec,
    /// Rounds to run.
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub rounds: u32,
    /// Masked inputs wanted per round. The masked-input stage closes as
    /// soon as this many arrived (or at its deadline).
    #[schema(minimum = 2, maximum = 1_048_576)]
    pub clients_per_round: u32,
    /// Extra clients selected to absorb dropouts, as a fraction: a round
    /// selects ⌈clients_per_round × (1 + over_selection)⌉ clients.
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 10.0)]
    pub over_selection: f64,
    /// Secure-aggregation parameters.
    #[serde(default)]
    pub secure_aggregation: SecAggSpec,
    /// Quantization of updates.
    #[serde(default)]
    pub quantization: QuantizationConfig,
    /// Per-stage deadlines.
    #[serde(default)]
    pub deadlines: StageDeadlines,
    /// Server optimizer.
    #[serde(default)]
    pub optimizer: ServerOptimizer,
    /// Completed-round checkpoints to keep (the initial model is always kept).
    #[serde(default = "default_retention")]
    #[schema(minimum = 1, maximum = 1_000, default = 10)]
    pub checkpoint_retention: u32,
    /// What the coordinator learns of the clients' training metrics.
    #[serde(default)]
    pub client_metrics: ClientMetricsSpec,
    /// Distributed differential privacy: each client clips its update and
    /// adds its share of noise before masking, so every sum the coordinator
    /// unmasks is noisy; the coordinator accounts ε and stops the task at
    /// its budget. Under it clients report no metrics and no example
    /// counts (each counts once), and `quantization` plays no part.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub privacy: Option<PrivacySpec>,
    /// Synchronous rounds (the default) or buffered asynchronous
    /// aggregation, whose parameters are in [`asynchronous`](Self::asynchronous).
    #[serde(default)]
    pub mode: TaskMode,
    /// Buffered asynchronous aggregation (FedBuff): required with
    /// `mode: "async"`, refused otherwise. Its buffer is the
    /// secure-aggregation group, so `clients_per_round` must equal its
    /// `buffer_size`, and `rounds` counts model updates (applied buffers).
    #[serde(default, rename = "async", skip_serializing_if = "Option::is_none")]
    pub asynchronous: Option<AsyncSpec>,
    /// Input validation: every client proves in zero knowledge that the
    /// update it masked is within a norm bound, and a client whose proof
    /// fails is left out of the round and named in its record. Left out, a
    /// new task of the active variant without `privacy` or a sketch gets
    /// `{"norm": "l2"}`; a stored spec without it ran without validation.
    /// Under `privacy` (Skellam noise, groups of four or more) it is asked
    /// for explicitly: each update is proven before its noise within the
    /// privacy clip's sensitivity, and its noise is drawn on edges its
    /// neighbours verify (`cohort_crypto::validation::noise`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation: Option<ValidationSpec>,
}

/// A task's input validation ([`TaskSpec::validation`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ValidationSpec {
    /// `"l2"`: each client scales its update to at most `l2_clip` in L2
    /// norm and proves its quantized vector within the bound that follows;
    /// `"none"`: no validation.
    pub norm: NormChoice,
    /// The L2 clip. Left out, `quantization.clip` times the square root of
    /// the model's parameters: the largest norm an update clipped per
    /// coordinate can have, so that no honest update is changed and a
    /// malicious one is held to it. Under `privacy`, `privacy.clip_norm`
    /// (and only that).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0e9)]
    pub l2_clip: Option<f32>,
    /// A robust rule across a round's group sums, beside the proofs (or
    /// instead of them, with `"norm": "none"`): see [`GroupRule`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_rule: Option<GroupRule>,
}

/// How a round combines its secure-aggregation groups' means
/// ([`crate::round::robust`]); without one, their example-weighted mean.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum GroupRule {
    /// A group whose mean update is longer (L2) than `max` is left out.
    Norm {
        /// The longest group mean kept.
        #[schema(exclusive_minimum = 0.0, maximum = 1.0e9)]
        max: f32,
    },
    /// The coordinate-wise median of the groups' means.
    Median,
    /// Per coordinate, the mean of the groups' means after `trim` of them
    /// at each end are dropped.
    TrimmedMean {
        /// The fraction dropped at each end, in [0, 0.5).
        #[schema(minimum = 0.0, exclusive_maximum = 0.5)]
        trim: f32,
    },
}

/// The norm a task's inputs are validated in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum NormChoice {
    /// The Euclidean norm.
    L2,
    /// No validation.
    None,
}

/// How a task's clients are scheduled.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum TaskMode {
    /// Rounds: the selected clients train on the same model and the round
    /// waits for them (up to its deadlines).
    #[default]
    Sync,
    /// Clients train at their own pace; every `buffer_size` finished
    /// updates form one secure-aggregation group whose sum is applied as
    /// soon as it is unmasked.
    Async,
}

/// Buffered asynchronous aggregation (Nguyen et al., FedBuff, AISTATS
/// 2022), one secure-aggregation group per buffer.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AsyncSpec {
    /// Clients training at once (C).
    #[schema(minimum = 1, maximum = 100_000)]
    pub concurrency: u32,
    /// Updates per buffer (K): each buffer is one secure-aggregation group
    /// of K clients and one model update.
    #[schema(minimum = 3, maximum = 100_000)]
    pub buffer_size: u32,
    /// The most model versions an update may lag behind its base (S); a
    /// staler update is refused and its client re-bases on the current
    /// model. At least 1; 4 unless given. A client gives up its training
    /// slot sooner, after ⌈C / K⌉ versions (see [`AsyncSpec::slot_lag`]).
    #[serde(default = "default_max_staleness")]
    #[schema(minimum = 1, maximum = 1_000, default = 4)]
    pub max_staleness: u32,
    /// An update s versions stale is weighted (1 + s)^−a by its client
    /// before masking; 0.5 (the default) is FedBuff's 1/√(1 + s), 0 weighs
    /// every update alike.
    #[serde(default = "default_staleness_exponent")]
    #[schema(minimum = 0.0, maximum = 4.0, default = 0.5)]
    pub staleness_exponent: f64,
}

fn default_max_staleness() -> u32 {
    4
}

fn default_staleness_exponent() -> f64 {
    0.5
}

impl AsyncSpec {
    /// Checks the schedule on its own: a buffer the concurrency can fill,
    /// a staleness bound of at least one version.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.concurrency == 0 || self.concurrency > MAX_CONCURRENCY {
            return Err(SpecError::field(
                "async.concurrency",
                format!("concurrency must be between 1 and {MAX_CONCURRENCY}"),
            ));
        }
        if self.buffer_size < 3 {
            return Err(SpecError::field(
                "async.buffer_size",
                "buffer_size must be at least 3: each buffer is a secure-aggregation group",
            ));
        }
        if self.buffer_size > self.concurrency {
            return Err(SpecError::field(
                "async.buffer_size",
                format!(
                    "a buffer of {} never fills with {} clients training at once: buffer_size must be at most \
                     concurrency",
                    self.buffer_size, self.concurrency
                ),
            ));
        }
        if self.max_staleness == 0 || self.max_staleness > MAX_STALENESS {
            return Err(SpecError::field(
                "async.max_staleness",
                format!(
                    "max_staleness must be between 1 and {MAX_STALENESS}: with 0, an update finished while \
                     another buffer was applied would always be refused"
                ),
            ));
        }
        if !(self.staleness_exponent.is_finite() && (0.0..=4.0).contains(&self.staleness_exponent)) {
            return Err(SpecError::field(
                "async.staleness_exponent",
                "staleness_exponent must be between 0 and 4",
            ));
        }
        Ok(())
    }

    /// Whether an update trained from version `base` may still be applied
    /// at version `version`: not from the future, at most `max_staleness`
    /// behind.
    pub fn fresh(&self, base: u64, version: u64) -> bool {
        base <= version && version - base <= u64::from(self.max_staleness)
    }

    /// How many versions a client's base may lag while it still holds a
    /// training slot: ⌈C / K⌉, at most `max_staleness`. With C clients
    /// training and K updates a version, about C / K versions pass while a
    /// client of typical speed trains, so a client lagging further is slow
    /// for this population: its slot goes to another client, and its
    /// update, if it arrives within `max_staleness`, still counts
    /// (weighted). A straggler then delays no version, and its data is not
    /// lost as it would be under a tight `max_staleness`.
    pub fn slot_lag(&self) -> u64 {
        u64::from(self.concurrency.div_ceil(self.buffer_size.max(1)).min(self.max_staleness))
    }

    /// Whether a client that started training from version `base` still
    /// holds its slot at version `version` (see [`AsyncSpec::slot_lag`]).
    pub fn holds_slot(&self, base: u64, version: u64) -> bool {
        base <= version && version - base <= self.slot_lag()
    }

    /// The weight of an update `staleness` versions behind: (1 + s)^−a.
    pub fn weight(&self, staleness: u64) -> f32 {
        (1.0 + staleness as f64).powf(-self.staleness_exponent) as f32
    }
}

/// Most clients an async task may have training at once.
pub const MAX_CONCURRENCY: u32 = 100_000;
/// Largest staleness bound.
pub const MAX_STALENESS: u32 = 1_000;

/// The clients' training metrics (loss, accuracy): summed under the masks
/// with the updates, so that the coordinator learns only their means over
/// each round's survivors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ClientMetricsSpec {
    /// Metrics every masked input has room for (`train_loss`,
    /// `train_accuracy`, `global_loss`, `global_accuracy`, `eval_loss`,
    /// `eval_accuracy`; all by default). Each costs a few coordinates.
    pub aggregate: MetricSet,
    /// Also take each client's metrics in the clear through
    /// `POST /v1/metrics`: only for a semi-honest task, whose coordinator
    /// is trusted anyway. Off by default.
    pub plaintext: bool,
}

impl Default for ClientMetricsSpec {
    fn default() -> Self {
        Self { aggregate: MetricSet::ALL, plaintext: false }
    }
}

fn default_retention() -> u32 {
    10
}

/// The model of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Architecture name, for clients that build the model themselves: at
    /// most 200 characters, no control characters.
    #[schema(max_length = 200, pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub architecture: String,
    /// Tensor layout of the flat parameter vector.
    pub layout: ModelLayout,
    /// How the initial weights are drawn.
    #[serde(default)]
    pub init: ModelInit,
}

/// Initial weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum ModelInit {
    /// All zeros. (A variant with no fields rather than a unit variant, so
    /// that serde refuses fields it does not know here too.)
    Zeros {},
    /// PyTorch's default for linear and convolution layers: each weight
    /// tensor (and the bias after it) uniform in ±1/√fan_in, where fan_in
    /// is the product of the weight's dimensions after the first;
    /// deterministic for the seed.
    FanIn {
        /// Seed.
        seed: u64,
    },
    /// Uniform in [−scale, scale], deterministic for the seed.
    Uniform {
        /// Half-width of the interval.
        #[schema(exclusive_minimum = 0.0)]
        scale: f32,
        /// Seed.
        seed: u64,
    },
}

impl Default for ModelInit {
    fn default() -> Self {
        ModelInit::Zeros {}
    }
}

/// Communication graph choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum GraphChoice {
    /// Everybody shares with everybody (SecAgg).
    Complete,
    /// Random k-regular graph (SecAgg+).
    #[default]
    Sparse,
}

/// Secure-aggregation parameters of a task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct SecAggSpec {
    /// The adversary the protocol defends against: `"active"` (a coordinator
    /// that may deviate; signed keys and the consistency check) or
    /// `"semi-honest"` (a trusted coordinator only). Left out, a new task
    /// runs the active variant; a stored spec without it predates the
    /// choice and ran semi-honest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub variant: Option<VariantChoice>,
    /// Communication graph.
    pub graph: GraphChoice,
    /// Dropout rate the threshold must tolerate.
    pub target_dropout: f64,
    /// Fraction of colluding clients to tolerate.
    pub corruption: f64,
    /// Overrides the derived degree (sparse graph).
    pub degree: Option<u32>,
    /// Overrides the derived threshold.
    pub threshold: Option<u32>,
    /// Largest secure-aggregation group: a round's selected clients are
    /// split into ⌈selected / group_size⌉ groups of one size, each its own
    /// protocol instance with the degree and threshold derived for that
    /// size (which is the round size participants pin and check); the
    /// coordinator adds the groups' sums. Left out, a new task gets
    /// [`DEFAULT_GROUP_SIZE`]; a stored spec without it predates groups
    /// and runs each round as one.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 2, maximum = 1_048_576)]
    pub group_size: Option<u32>,
}

/// Clients per secure-aggregation group of a new task that does not say:
/// a few hundred, as in Bonawitz et al., "Towards Federated Learning at
/// Scale" (SysML 2019).
pub const DEFAULT_GROUP_SIZE: u32 = 500;

/// How a round's selected clients are split into secure-aggregation
/// groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Groups {
    /// Groups per round.
    pub count: u32,
    /// Clients per group (the n of each protocol instance).
    pub size: u32,
}

impl Groups {
    /// Clients selected per round: every group full.
    pub fn selected(&self) -> u32 {
        self.count.saturating_mul(self.size)
    }
}

impl Default for SecAggSpec {
    fn default() -> Self {
        Self {
            variant: None,
            graph: GraphChoice::Sparse,
            target_dropout: 0.33,
            corruption: 0.05,
            degree: None,
            threshold: None,
            group_size: None,
        }
    }
}

/// Which variant of the protocol a task runs.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[serde(rename_all = "kebab-case")]
#[strum(serialize_all = "kebab-case")]
pub enum VariantChoice {
    /// Signed keys and the consistency check: holds against a coordinator
    /// that deviates from the protocol.
    Active,
    /// No signatures: for a coordinator trusted to follow the protocol.
    SemiHonest,
}

impl VariantChoice {
    /// The name in a task spec.
    pub fn as_str(self) -> &'static str {
        self.into()
    }
}

impl From<VariantChoice> for Variant {
    fn from(choice: VariantChoice) -> Self {
        match choice {
            VariantChoice::Active => Variant::Active,
            VariantChoice::SemiHonest => Variant::SemiHonest,
        }
    }
}

impl SecAggSpec {
    /// The variant this task runs (see [`SecAggSpec::variant`]).
    pub fn variant(&self) -> VariantChoice {
        self.variant.unwrap_or(VariantChoice::SemiHonest)
    }

    /// Fills in what a task being created does not name: it runs the
    /// active variant and is aggregated in groups of at most
    /// [`DEFAULT_GROUP_SIZE`].
    pub fn default_for_new_task(&mut self) {
        self.variant.get_or_insert(VariantChoice::Active);
        self.group_size.get_or_insert(DEFAULT_GROUP_SIZE);
    }
}

/// Quantization and compression of a task's updates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QuantizationConfig {
    /// Update coordinates (after the rotation or sketch) are clipped to
    /// [−clip, clip].
    pub clip: f32,
    /// Bits of the ring the masked vectors live in (ignored when `bits`
    /// is set).
    pub modulus_bits: u8,
    /// Bits per value (4 to 16). In the exact ring, each client's value
    /// has `bits` bits and the ring bits + ⌈log₂ n⌉ for n clients per
    /// group; in a fitted ring (`ring: fitted`) the ring itself has `bits`
    /// bits, whatever n. The upload shrinks accordingly.
    #[schema(minimum = 4, maximum = 16)]
    pub bits: Option<u8>,
    /// How the ring holds the sum (with `bits`): `exact` (the default)
    /// sizes it for n worst-case values, so no sum ever wraps; `fitted`
    /// (with `rotate`) keeps it at `bits` bits and fits each round's scale
    /// to the spread of the last sum the coordinator decoded (modular
    /// clipping: about one coordinate in 400 000 may wrap, which the
    /// rotation spreads thin). Not with validation; under privacy the
    /// privacy plan fits its own ring.
    pub ring: RingSizing,
    /// Randomized Hadamard rotation (blocks of 4096, fresh signs each
    /// round) before quantization; the coordinator inverts it.
    pub rotate: bool,
    /// Count sketch of the update instead of the update itself.
    pub sketch: Option<SketchConfig>,
    /// Largest example count a client may report.
    pub max_weight: u32,
}

/// How a task's ring holds the sum of its clients' values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum RingSizing {
    /// bits + ⌈log₂ n⌉ bits: no sum of n clients' values can wrap.
    #[default]
    Exact,
    /// `bits` bits, each round's values scaled to the spread of the last
    /// sum ([`cohort_crypto::quantize::SumSpread`]); the first round (and
    /// the first after a restart) at the scale that cannot wrap.
    Fitted,
}

/// A count sketch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SketchConfig {
    /// Rows (odd, at most 15).
    pub rows: u32,
    /// Buckets per row.
    pub columns: u32,
    /// Coordinates kept when unsketching (the largest estimates; 0: all).
    #[serde(default)]
    pub top_k: u32,
}

/// Rotation block: large enough to spread energy, small enough that the
/// padding of the last block costs little.
pub const ROTATION_BLOCK: u32 = 4096;

impl Default for QuantizationConfig {
    fn default() -> Self {
        Self {
            clip: 1.0,
            modulus_bits: 32,
            bits: None,
            ring: RingSizing::Exact,
            rotate: false,
            sketch: None,
            max_weight: 1 << 14,
        }
    }
}

impl QuantizationConfig {
    /// Ring bits for rounds of `clients` selected clients.
    pub fn ring_bits(&self, clients: u32) -> Result<u8, SpecError> {
        match (self.bits, self.ring) {
            (None, RingSizing::Fitted) => {
                Err(SpecError::field("quantization.ring", "a fitted ring needs bits"))
            }
            (Some(bits), RingSizing::Fitted) if (4..=16).contains(&bits) => {
                if !self.rotate {
                    return Err(SpecError::field("quantization.ring", "a fitted ring needs rotate"));
                }
                // The first round's scale must leave each input a step.
                match cohort_crypto::quantize::safe_scale(bits, clients, self.clip) {
                    Some(_) => Ok(bits),
                    None => Err(SpecError::field(
                        "quantization.bits",
                        format!(
                            "a fitted ring of {bits} bits holds at most {} clients per group",
                            cohort_crypto::quantize::max_fitted_clients(bits)
                        ),
                    )),
                }
            }
            (None, RingSizing::Exact) => Ok(self.modulus_bits),
            (Some(bits), RingSizing::Exact) if (4..=16).contains(&bits) => {
                cohort_crypto::quantize::modulus_bits_for(bits, clients).ok_or_else(|| {
                    SpecError::field("quantization.bits", "bits plus the clients' headroom exceed 32")
                })
            }
            (Some(_), _) => Err(SpecError::field("quantization.bits", "bits must be between 4 and 16")),
        }
    }

    /// The protocol's quantization for one round; `seed` (public, fresh
    /// per round) picks the rotation's signs or the sketch's hashes, and
    /// the vectors have room for `metrics`.
    pub fn round_spec(
        &self,
        seed: [u8; 32],
        metrics: MetricSet,
        scale: Option<f64>,
    ) -> Result<QuantizationSpec, SpecError> {
        let transform = match (self.rotate, self.sketch) {
            (false, None) => Transform::None,
            (true, None) => Transform::Rotate { block: ROTATION_BLOCK, seed },
            (false, Some(SketchConfig { rows, columns, top_k })) => {
                Transform::Sketch { rows, columns, top_k, seed }
            }
            (true, Some(_)) => {
                return Err(SpecError::field("quantization", "choose either rotate or sketch"));
            }
        };
        Ok(QuantizationSpec {
            clip: self.clip,
            max_weight: self.max_weight,
            transform,
            metrics,
            privacy: None,
            validation: None,
            scale: match self.ring {
                RingSizing::Exact => None,
                RingSizing::Fitted => scale,
            },
        })
    }

    /// The quantizer of a round of `clients` with transform seed `seed`
    /// and room for `metrics`.
    pub fn quantizer(
        &self,
        clients: u32,
        seed: [u8; 32],
        metrics: MetricSet,
    ) -> Result<Quantizer, SpecError> {
        let scale = self.scale_for(clients, None);
        Ok(Quantizer::new(self.round_spec(seed, metrics, scale)?, self.ring_bits(clients)?, clients)?)
    }

    /// The scale of a fitted ring's round of `clients` inputs when the
    /// last sum spread as `last` ([`SumSpread::for_group`] takes it to
    /// this group's size): fitted to it, or the safe scale without one;
    /// `None` for the exact ring.
    pub fn scale_for(&self, clients: u32, last: Option<&SumSpread>) -> Option<f64> {
        if self.ring != RingSizing::Fitted {
            return None;
        }
        let bits = self.ring_bits(clients).ok()?;
        cohort_crypto::quantize::fitted_scale(last, bits, clients, self.clip)
    }
}

/// How long each stage waits for clients, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StageDeadlines {
    /// Waiting for selected clients to advertise keys (includes their
    /// download of the model and local training start).
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub advertise_keys_ms: u64,
    /// Waiting for encrypted shares.
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub share_keys_ms: u64,
    /// Waiting for masked inputs (includes local training).
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub masked_input_ms: u64,
    /// Waiting for unmasking shares.
    #[schema(minimum = 1, maximum = 86_400_000)]
    pub unmasking_ms: u64,
    /// How long a client that stopped checking in still counts as
    /// available for selection (clients waiting for a round check in every
    /// one to two seconds): a client that went away silently is selected
    /// again only within this window.
    #[schema(minimum = 3_000, maximum = 86_400_000)]
    pub availability_ms: u64,
}

impl Default for StageDeadlines {
    fn default() -> Self {
        Self {
            advertise_keys_ms: 30_000,
            share_keys_ms: 30_000,
            masked_input_ms: 300_000,
            unmasking_ms: 30_000,
            availability_ms: crate::round::CHECK_IN_TTL_MS as u64,
        }
    }
}

/// Longest name, architecture or tensor name, in characters (as the
/// OpenAPI document's `maxLength` counts them).
pub const MAX_NAME_CHARS: usize = 200;

/// Whether `name` is at most [`MAX_NAME_CHARS`] characters without control
/// characters.
pub fn name_fits(name: &str) -> bool {
    name.chars().count() <= MAX_NAME_CHARS && !name.chars().any(char::is_control)
}
/// Most rounds a task may run.
pub const MAX_ROUNDS: u32 = 1_000_000;
/// Most completed-round checkpoints a task may keep.
pub const MAX_RETENTION: u32 = 1_000;
/// Shortest availability window: a few of a waiting client's check-ins.
pub const MIN_AVAILABILITY_MS: u64 = 3_000;
/// Longest stage deadline: a day.
pub const MAX_DEADLINE_MS: u64 = 86_400_000;

/// Why a task specification was refused. The coordinator answers every
/// kind with `400 invalid_task` and this message.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// A field is out of its range, or fields contradict each other.
    #[error("invalid task: {reason}")]
    Field {
        /// The field, as the JSON spec names it (`rounds`,
        /// `secure_aggregation.threshold`).
        field: &'static str,
        /// What it must be.
        reason: String,
    },
    /// The model's layout is malformed.
    #[error("invalid task: model.layout: {0}")]
    Layout(#[from] cohort_client::checkpoint::CheckpointError),
    /// The server optimizer's settings are out of range.
    #[error("invalid task: optimizer: {0}")]
    Optimizer(#[from] crate::optimizer::OptimizerError),
    /// The quantization, or the secure-aggregation parameters derived for
    /// the task, are not a valid round.
    #[error("invalid task: {0}")]
    Round(#[from] cohort_crypto::ConfigError),
}

impl SpecError {
    /// `field` is wrong: it must be as `reason` says.
    pub fn field(field: &'static str, reason: impl Into<String>) -> Self {
        SpecError::Field { field, reason: reason.into() }
    }
}

/// A task's spec that passed validation, with what every round derives
/// from it: built once per task ([`TaskPlan::new`]) and the only way to a
/// running task, so a spec is validated and its parameters derived once,
/// not wherever it is needed.
#[derive(Debug, Clone)]
pub struct TaskPlan {
    spec: TaskSpec,
    derived: DerivedRoundParameters,
    security: TaskSecurity,
    privacy: Option<PrivacyPlan>,
    cadence: Cadence,
}

/// How a validated task's clients are scheduled: the spec's `mode` and
/// `async` read as one value, so that a sync task with async parameters,
/// or an async one without, cannot be represented past validation (the
/// spec's JSON keeps its two fields).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Cadence {
    /// Rounds, one at a time.
    Sync,
    /// Buffered asynchronous aggregation with these parameters.
    Async(AsyncSpec),
}

impl TaskPlan {
    /// Validates `spec` and derives its round parameters, its security
    /// parameters and its privacy plan.
    pub fn new(spec: TaskSpec) -> Result<Self, SpecError> {
        let derived = spec.validate()?;
        let security = spec.security(&derived)?;
        let privacy = spec.plan_privacy(&derived)?;
        // `validate` refused every other pairing.
        let cadence = match (spec.mode, spec.asynchronous) {
            (TaskMode::Async, Some(schedule)) => Cadence::Async(schedule),
            _ => Cadence::Sync,
        };
        Ok(Self { spec, derived, security, privacy, cadence })
    }

    /// The plan of a task being created from `spec`: what it does not
    /// name gets a new task's defaults (see
    /// [`SecAggSpec::default_for_new_task`]) first.
    pub fn for_new_task(mut spec: TaskSpec) -> Result<Self, SpecError> {
        spec.secure_aggregation.default_for_new_task();
        if spec.validation.is_none()
            && spec.secure_aggregation.variant() == VariantChoice::Active
            && spec.privacy.is_none()
            && spec.quantization.sketch.is_none()
            && spec.quantization.ring == RingSizing::Exact
        {
            spec.validation = Some(ValidationSpec { norm: NormChoice::L2, l2_clip: None, group_rule: None });
        }
        let default_clip = match &spec.privacy {
            Some(privacy) => privacy.clip_norm,
            None => spec.default_l2_clip(),
        };
        if let Some(validation) = spec.validation.as_mut()
            && validation.norm == NormChoice::L2
        {
            // The default clip is written out, so the task view shows it.
            validation.l2_clip.get_or_insert(default_clip);
        }
        Self::new(spec)
    }

    /// The spec.
    pub fn spec(&self) -> &TaskSpec {
        &self.spec
    }

    /// The degree, threshold and graph of each group.
    pub fn derived(&self) -> DerivedRoundParameters {
        self.derived
    }

    /// The security parameters every round of the task announces: what a
    /// participant pins at enrollment and checks each round against (the
    /// per-round seeds are not part of it).
    pub fn security(&self) -> TaskSecurity {
        self.security
    }

    /// The task's differential-privacy plan, if it asks for privacy.
    pub fn privacy(&self) -> Option<&PrivacyPlan> {
        self.privacy.as_ref()
    }

    /// How its clients are scheduled.
    pub fn cadence(&self) -> Cadence {
        self.cadence
    }

    /// The spec, given back.
    pub fn into_spec(self) -> TaskSpec {
        self.spec
    }
}

/// Parameters derived from a valid spec.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DerivedRoundParameters {
    /// Neighbours per client.
    pub degree: u32,
    /// Threshold.
    pub threshold: u32,
    /// Whether the graph is complete.
    pub complete: bool,
}

impl TaskSpec {
    /// Validates the spec and derives the round parameters.
    pub fn validate(&self) -> Result<DerivedRoundParameters, SpecError> {
        if self.name.trim().is_empty() || !name_fits(&self.name) {
            return Err(SpecError::field(
                "name",
                "name must be 1 to 200 characters, not all white space, without control characters",
            ));
        }
        if !name_fits(&self.model.architecture) {
            return Err(SpecError::field(
                "model.architecture",
                "model.architecture must be at most 200 characters without control characters",
            ));
        }
        if !self.model.layout.tensors.iter().all(|t| name_fits(&t.name)) {
            return Err(SpecError::field(
                "model.layout",
                "tensor names must be at most 200 characters without control characters",
            ));
        }
        self.model.layout.validate()?;
        if self.model.layout.len() > cohort_crypto::config::MAX_VECTOR_LEN as usize - 1 {
            return Err(SpecError::field("model.layout", "the model is too large for secure aggregation"));
        }
        if let ModelInit::Uniform { scale, .. } = self.model.init
            && !(scale.is_finite() && scale > 0.0)
        {
            return Err(SpecError::field("model.init.scale", "model.init.scale must be finite and positive"));
        }
        if self.rounds == 0 || self.rounds > MAX_ROUNDS {
            return Err(SpecError::field("rounds", format!("rounds must be between 1 and {MAX_ROUNDS}")));
        }
        if self.clients_per_round < 2 {
            return Err(SpecError::field("clients_per_round", "clients_per_round must be at least 2"));
        }
        if !(0.0..=10.0).contains(&self.over_selection) {
            return Err(SpecError::field("over_selection", "over_selection must be between 0 and 10"));
        }
        if let Some(size) = self.secure_aggregation.group_size
            && !(2..=cohort_crypto::config::MAX_CLIENTS).contains(&size)
        {
            return Err(SpecError::field(
                "secure_aggregation.group_size",
                format!("group_size must be between 2 and {}", cohort_crypto::config::MAX_CLIENTS),
            ));
        }
        if u64::from(self.wanted_selection()) > u64::from(cohort_crypto::config::MAX_CLIENTS)
            || self.groups().selected() > cohort_crypto::config::MAX_CLIENTS
        {
            return Err(SpecError::field("clients_per_round", "too many clients per round"));
        }
        if self.checkpoint_retention == 0 || self.checkpoint_retention > MAX_RETENTION {
            return Err(SpecError::field(
                "checkpoint_retention",
                format!("checkpoint_retention must be between 1 and {MAX_RETENTION}"),
            ));
        }
        let d = self.deadlines;
        if [d.advertise_keys_ms, d.share_keys_ms, d.masked_input_ms, d.unmasking_ms]
            .iter()
            .any(|ms| !(1..=MAX_DEADLINE_MS).contains(ms))
        {
            return Err(SpecError::field(
                "deadlines",
                format!("deadlines must be between 1 and {MAX_DEADLINE_MS} ms (a day)"),
            ));
        }
        if !(MIN_AVAILABILITY_MS..=MAX_DEADLINE_MS).contains(&d.availability_ms) {
            return Err(SpecError::field(
                "deadlines.availability_ms",
                format!(
                    "availability_ms must be between {MIN_AVAILABILITY_MS} (clients waiting for a round \
                     check in every one to two seconds) and {MAX_DEADLINE_MS} ms"
                ),
            ));
        }

        self.validate_mode()?;
        self.validate_validation()?;
        self.optimizer.validate()?;
        let n = self.groups().size;
        if let Some(privacy) = &self.privacy {
            privacy.validate()?;
            if self.client_metrics.plaintext {
                return Err(SpecError::field(
                    "client_metrics.plaintext",
                    "client_metrics.plaintext would release clients' metrics without noise: not with privacy",
                ));
            }
            let dimension = self.model.layout.len();
            let padded = cohort_crypto::dp::padded_len(dimension, cohort_crypto::dp::block_for(dimension));
            if padded > cohort_crypto::config::MAX_VECTOR_LEN as usize {
                return Err(SpecError::field(
                    "model.layout",
                    "the model is too large for secure aggregation",
                ));
            }
        } else {
            let quantizer = self.quantization.quantizer(n, [0; 32], self.client_metrics.aggregate)?;
            if quantizer.encoded_len(self.model.layout.len()) > cohort_crypto::config::MAX_VECTOR_LEN as usize
            {
                return Err(SpecError::field(
                    "model.layout",
                    "the model is too large for secure aggregation",
                ));
            }
        }
        let sa = &self.secure_aggregation;
        let active = sa.variant() == VariantChoice::Active;
        let target = ParameterTarget {
            dropout: sa.target_dropout,
            corruption: sa.corruption,
            adversary: if active { Adversary::SemiMalicious } else { Adversary::SemiHonest },
            ..ParameterTarget::default()
        };
        let derived = match sa.graph {
            GraphChoice::Complete => derive_complete(n, &target),
            GraphChoice::Sparse => derive_sparse(n, &target),
        };
        let degree = match (sa.graph, sa.degree) {
            (GraphChoice::Complete, Some(_)) => {
                return Err(SpecError::field(
                    "secure_aggregation.degree",
                    "degree applies to the sparse graph only",
                ));
            }
            (GraphChoice::Complete, None) => n - 1,
            (GraphChoice::Sparse, Some(k)) => k.min(n - 1),
            (GraphChoice::Sparse, None) => derived.clone()?.degree,
        };
        let threshold = match sa.threshold {
            Some(t) => t,
            None if sa.degree.is_none() => derived?.threshold,
            None => {
                return Err(SpecError::field(
                    "secure_aggregation.threshold",
                    "a degree override needs a threshold override",
                ));
            }
        };
        if threshold == 0 || threshold > degree || (degree < n - 1 && degree % 2 == 1) {
            return Err(SpecError::field(
                "secure_aggregation.threshold",
                "threshold must be in 1..=degree, and a sparse degree must be even",
            ));
        }
        if active && !active_threshold_holds(threshold, degree) {
            return Err(SpecError::field(
                "secure_aggregation.threshold",
                format!(
                    "the active variant needs a threshold above half of the degree plus one (each client's \
                     neighbours and itself hold its seed's shares): 2 × {threshold} must exceed {degree} + 1"
                ),
            ));
        }
        let wanted = self.inputs_per_group();
        if self.over_selection > 0.0 && threshold > wanted {
            return Err(SpecError::field(
                "secure_aggregation.threshold",
                format!(
                    "with over-selection a group goes on with the first {wanted} of its clients to advertise their \
                     keys (clients_per_round over the groups), fewer than the threshold {threshold}: lower the \
                     threshold or over_selection"
                ),
            ));
        }
        if self.client_metrics.plaintext && active {
            return Err(SpecError::field(
                "client_metrics.plaintext",
                "client_metrics.plaintext needs the semi-honest variant: an untrusted coordinator \
                 learns clients' metrics only in aggregate",
            ));
        }
        Ok(DerivedRoundParameters { degree, threshold, complete: degree >= n - 1 })
    }

    /// The mode's own rules: an async task's buffer is its only group.
    fn validate_mode(&self) -> Result<(), SpecError> {
        match (self.mode, &self.asynchronous) {
            (TaskMode::Sync, None) => Ok(()),
            (TaskMode::Sync, Some(_)) => {
                Err(SpecError::field("async", "async parameters need mode \"async\""))
            }
            (TaskMode::Async, None) => {
                Err(SpecError::field("async", "mode \"async\" needs async: {concurrency, buffer_size}"))
            }
            (TaskMode::Async, Some(schedule)) => {
                schedule.validate()?;
                if self.clients_per_round != schedule.buffer_size {
                    return Err(SpecError::field(
                        "clients_per_round",
                        "in an async task each buffer is one group: clients_per_round must equal \
                         async.buffer_size",
                    ));
                }
                if self.over_selection != 0.0 {
                    return Err(SpecError::field(
                        "over_selection",
                        "an async task selects no rounds: over_selection must be 0",
                    ));
                }
                if self.secure_aggregation.group_size.is_some_and(|size| size < schedule.buffer_size) {
                    return Err(SpecError::field(
                        "secure_aggregation.group_size",
                        "in an async task each buffer is one group: group_size must be at least buffer_size",
                    ));
                }
                if self.privacy.is_some() {
                    return Err(SpecError::field(
                        "privacy",
                        "differential privacy is accounted for synchronous rounds only",
                    ));
                }
                Ok(())
            }
        }
    }

    /// The security parameters every round of this task announces: what a
    /// participant pins at enrollment and checks each round against (the
    /// engine builds each round from the same spec; the per-round seeds are
    /// not part of it).
    /// The L2 clip every client's update is held to, when the task
    /// validates its inputs (under privacy, the privacy clip).
    pub fn validation_clip(&self) -> Option<f32> {
        match (self.validation, &self.privacy) {
            (Some(ValidationSpec { norm: NormChoice::L2, .. }), Some(privacy)) => Some(privacy.clip_norm),
            (Some(ValidationSpec { norm: NormChoice::L2, l2_clip, .. }), None) => {
                Some(l2_clip.unwrap_or_else(|| self.default_l2_clip()))
            }
            _ => None,
        }
    }

    /// `quantization.clip` times √(parameters): the longest update clipped
    /// per coordinate, the L2 clip when the spec names none.
    fn default_l2_clip(&self) -> f32 {
        self.quantization.clip * (self.model.layout.len() as f32).sqrt()
    }

    fn validate_validation(&self) -> Result<(), SpecError> {
        match self.validation.and_then(|v| v.group_rule) {
            Some(GroupRule::Norm { max }) if !(max.is_finite() && max > 0.0 && max <= 1.0e9) => {
                return Err(SpecError::field(
                    "validation.group_rule.max",
                    "max must be above 0 and at most 10^9",
                ));
            }
            Some(GroupRule::TrimmedMean { trim }) if !(0.0..0.5).contains(&trim) => {
                return Err(SpecError::field("validation.group_rule.trim", "trim must be in [0, 0.5)"));
            }
            _ => {}
        }
        let Some(ValidationSpec { norm: NormChoice::L2, l2_clip, .. }) = self.validation else {
            return Ok(());
        };
        if l2_clip.is_some_and(|clip| !(clip.is_finite() && clip > 0.0 && clip <= 1.0e9)) {
            return Err(SpecError::field("validation.l2_clip", "l2_clip must be above 0 and at most 10^9"));
        }
        if let Some(privacy) = &self.privacy {
            // The proof bounds the rounded update before its noise by the
            // privacy clip's sensitivity; the noise rides on edges its
            // neighbours verify (`cohort_crypto::validation::noise`).
            if privacy.mechanism != cohort_crypto::dp::Mechanism::Skellam {
                return Err(SpecError::field(
                    "privacy.mechanism",
                    "validation under privacy needs the skellam mechanism: its noise is split over verified edges, and only Skellam's parts add up exactly",
                ));
            }
            if l2_clip.is_some_and(|clip| clip != privacy.clip_norm) {
                return Err(SpecError::field(
                    "validation.l2_clip",
                    "under privacy validation bounds updates by privacy.clip_norm: leave l2_clip out or set it to that clip",
                ));
            }
            if self.groups().size < 4 {
                return Err(SpecError::field(
                    "validation",
                    "validation under privacy needs groups of at least four clients: each client's noise is verified by three of its neighbours",
                ));
            }
        }
        if self.quantization.sketch.is_some() {
            return Err(SpecError::field(
                "validation",
                "validation needs a norm-preserving transform: not with a sketch",
            ));
        }
        if self.quantization.ring == RingSizing::Fitted {
            return Err(SpecError::field(
                "validation",
                "validation needs the exact ring: its sum check opens the commitments to a sum that never wraps",
            ));
        }
        Ok(())
    }

    fn security(&self, derived: &DerivedRoundParameters) -> Result<TaskSecurity, SpecError> {
        let n = self.groups().size;
        let variant = self.secure_aggregation.variant().into();
        let graph = if derived.complete { GraphKind::Complete } else { GraphKind::Sparse };
        if let Some(plan) = self.plan_privacy(derived)? {
            return Ok(TaskSecurity {
                variant,
                clients: n,
                graph,
                degree: derived.degree,
                threshold: derived.threshold,
                modulus_bits: plan.modulus_bits,
                clip: plan.params.clip_norm,
                max_weight: 1,
                transform: TransformKind::Rotate { block: plan.block },
                privacy: Some(plan.params),
                model_bound: self.mode == TaskMode::Sync,
            });
        }
        let round = self.quantization.round_spec([0; 32], MetricSet::NONE, None)?;
        Ok(TaskSecurity {
            variant,
            clients: n,
            graph,
            degree: derived.degree,
            threshold: derived.threshold,
            modulus_bits: self.quantization.ring_bits(n)?,
            clip: round.clip,
            max_weight: round.max_weight,
            transform: TransformKind::from(&round.transform),
            privacy: None,
            model_bound: self.mode == TaskMode::Sync,
        })
    }

    /// The task's differential-privacy plan (noise, scale, ring and
    /// accountant), if it asks for privacy.
    fn plan_privacy(&self, derived: &DerivedRoundParameters) -> Result<Option<PrivacyPlan>, SpecError> {
        let Some(privacy) = &self.privacy else { return Ok(None) };
        let validated = self.validation_clip().is_some();
        let plan = privacy.plan(
            self.groups().size,
            derived.threshold,
            self.model.layout.len(),
            self.rounds,
            validated,
        )?;
        // A validated client may put all of Δ₂ into one direction, where an
        // honest one's rounding spreads its share of it: Δ₂ must stay within
        // twice the clip (in steps), or the bound lets a client weigh more
        // than twice an honest one.
        let scaled_clip = plan.params.scale * f64::from(plan.params.clip_norm);
        if validated && plan.params.sensitivity(plan.padded).l2 > 2.0 * scaled_clip {
            return Err(SpecError::field(
                "privacy.bits",
                format!(
                    "a {}-bit ring rounds too coarsely for validation: the rounding's part of the sensitivity exceeds the clip; raise privacy.bits",
                    privacy.bits
                ),
            ));
        }
        Ok(Some(plan))
    }

    /// The client policy that accepts this task, weaker than
    /// [`Policy::default`] only where the task needs it (see
    /// [`Policy::accepting`]): for demos and tests whose tasks are smaller
    /// than a deployment's, and which say so.
    pub fn accepting_policy(&self) -> Result<Policy, SpecError> {
        Ok(Policy::accepting(&self.security(&self.validate()?)?))
    }

    /// Clients selected per round: the target plus over-selection, rounded
    /// up so that every group is full (see [`TaskSpec::groups`]).
    pub fn selected_per_round(&self) -> u32 {
        self.groups().selected()
    }

    /// The target plus over-selection: ⌈clients_per_round × (1 + over_selection)⌉.
    fn wanted_selection(&self) -> u32 {
        let selected = (f64::from(self.clients_per_round) * (1.0 + self.over_selection)).ceil();
        if selected >= f64::from(u32::MAX) { u32::MAX } else { selected as u32 }
    }

    /// How each round's selection is split: ⌈wanted / group_size⌉ groups
    /// of ⌈wanted / groups⌉ clients, so that no group is larger than
    /// `group_size` and all are the same size (the round size every
    /// participant pins); one group when the spec sets no size.
    pub fn groups(&self) -> Groups {
        let wanted = self.wanted_selection().max(1);
        let cap = self.secure_aggregation.group_size.unwrap_or(u32::MAX).max(1);
        let count = wanted.div_ceil(cap);
        Groups { count, size: wanted.div_ceil(count) }
    }

    /// Masked inputs each group waits for before it closes its
    /// masked-input stage early: its share of `clients_per_round`.
    pub fn inputs_per_group(&self) -> u32 {
        self.clients_per_round.div_ceil(self.groups().count)
    }

    /// The initial weights.
    pub fn initial_weights(&self) -> Vec<f32> {
        let len = self.model.layout.len();
        match self.model.init {
            ModelInit::Zeros {} => vec![0.0; len],
            ModelInit::FanIn { seed } => self.model.layout.fan_in_init(seed),
            ModelInit::Uniform { scale, seed } => {
                use rand_core::{Rng, SeedableRng};
                let mut rng = rand_chacha::ChaCha20Rng::seed_from_u64(seed);
                (0..len)
                    .map(|_| ((rng.next_u32() as f64 / u32::MAX as f64) * 2.0 - 1.0) as f32 * scale)
                    .collect()
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::checkpoint::TensorSpec;

    pub(crate) fn small_spec() -> TaskSpec {
        TaskSpec {
            name: "test".into(),
            model: ModelSpec {
                architecture: "linear".into(),
                layout: ModelLayout { tensors: vec![TensorSpec { name: "w".into(), shape: vec![4] }] },
                init: ModelInit::Zeros {},
            },
            rounds: 3,
            clients_per_round: 6,
            over_selection: 0.0,
            // Six clients cannot meet the 2^-20 bound at 33 % dropout: set t.
            secure_aggregation: SecAggSpec {
                graph: GraphChoice::Complete,
                threshold: Some(3),
                ..SecAggSpec::default()
            },
            quantization: QuantizationConfig::default(),
            deadlines: StageDeadlines::default(),
            optimizer: ServerOptimizer::default(),
            checkpoint_retention: 2,
            client_metrics: ClientMetricsSpec::default(),
            privacy: None,
            mode: TaskMode::Sync,
            asynchronous: None,
            validation: None,
        }
    }

    /// Validation combines with privacy: Skellam noise, the privacy clip
    /// as the bound, groups of four or more, and a ring fine enough that
    /// the rounding does not outweigh the clip; anything else is refused,
    /// named by its field.
    #[test]
    fn validation_under_privacy_is_planned_or_refused_by_its_field() {
        use crate::privacy::PrivacySpec;
        use cohort_crypto::dp::Mechanism;
        let privacy = PrivacySpec {
            mechanism: Mechanism::Skellam,
            epsilon: None,
            delta: 1e-5,
            clip_norm: 0.5,
            noise_multiplier: Some(1.0),
            sample_rate: None,
            bits: 20,
        };
        let validated = |privacy: PrivacySpec| {
            let mut spec = small_spec();
            // A new task runs the active variant: t above (degree + 1) / 2.
            spec.secure_aggregation.threshold = Some(4);
            spec.privacy = Some(privacy);
            spec.validation = Some(ValidationSpec { norm: NormChoice::L2, l2_clip: None, group_rule: None });
            spec
        };
        let plan = TaskPlan::for_new_task(validated(privacy)).unwrap();
        assert_eq!(plan.spec().validation.unwrap().l2_clip, Some(0.5), "the privacy clip, written out");
        assert_eq!(plan.spec().validation_clip(), Some(0.5));
        // Nine standard deviations leave a smaller scale than four.
        let unvalidated = {
            let mut spec = validated(privacy);
            spec.validation = None;
            TaskPlan::new(spec).unwrap()
        };
        assert!(plan.privacy().unwrap().params.scale < unvalidated.privacy().unwrap().params.scale);
        let field = |spec: TaskSpec| match TaskPlan::for_new_task(spec) {
            Err(SpecError::Field { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(
            field(validated(PrivacySpec { mechanism: Mechanism::DiscreteGaussian, ..privacy })),
            "privacy.mechanism"
        );
        let mut other_clip = validated(privacy);
        other_clip.validation.as_mut().unwrap().l2_clip = Some(0.7);
        assert_eq!(field(other_clip), "validation.l2_clip");
        let mut three = validated(privacy);
        three.clients_per_round = 3;
        three.secure_aggregation.threshold = Some(2);
        assert_eq!(field(three), "validation");
        // A ring so coarse that the rounding dominates Δ₂: refused for
        // validation, planned without it.
        let mut wide = validated(PrivacySpec { bits: 10, ..privacy });
        wide.model.layout.tensors[0].shape = vec![8_192];
        assert_eq!(field(wide.clone()), "privacy.bits");
        wide.validation = None;
        TaskPlan::for_new_task(wide).unwrap();
    }

    #[test]
    fn defaults_fill_in_and_parameters_are_derived() {
        let json = r#"{"name":"mnist","rounds":5,"clients_per_round":100,
            "model":{"architecture":"logreg","layout":{"tensors":[{"name":"w","shape":[784,10]}]}}}"#;
        let spec: TaskSpec = serde_json::from_str(json).unwrap();
        assert_eq!(spec.secure_aggregation, SecAggSpec::default());
        assert_eq!(spec.optimizer, ServerOptimizer::FedAvg { learning_rate: 1.0 });
        let derived = spec.validate().unwrap();
        assert_eq!((derived.degree, derived.threshold, derived.complete), (32, 9, false));
        assert_eq!(spec.initial_weights().len(), 7840);
    }

    /// A new task of the active variant validates its inputs unless it says
    /// otherwise, with the default clip written out; a semi-honest one, a
    /// stored spec and one that opts out do not.
    #[test]
    fn a_new_active_task_validates_its_inputs_by_default() {
        let active = || {
            let mut spec = small_spec();
            spec.secure_aggregation.threshold = Some(4); // a majority of six
            spec
        };
        let plan = TaskPlan::for_new_task(active()).unwrap();
        let validation = plan.spec().validation.unwrap();
        assert_eq!((validation.norm, validation.l2_clip), (NormChoice::L2, Some(2.0)), "clip 1 × √4");
        assert_eq!(plan.spec().validation_clip(), Some(2.0));
        let mut semi = small_spec();
        semi.secure_aggregation.variant = Some(VariantChoice::SemiHonest);
        assert_eq!(TaskPlan::for_new_task(semi).unwrap().spec().validation, None);
        assert_eq!(TaskPlan::new(small_spec()).unwrap().spec().validation_clip(), None, "a stored spec");
        let mut off = active();
        off.validation = Some(ValidationSpec { norm: NormChoice::None, l2_clip: None, group_rule: None });
        let off = TaskPlan::for_new_task(off).unwrap();
        assert_eq!(off.spec().validation_clip(), None);
        // The section survives the JSON a task view shows.
        let json = serde_json::to_value(plan.spec()).unwrap();
        assert_eq!(json["validation"], serde_json::json!({ "norm": "l2", "l2_clip": 2.0 }));
    }

    /// A fitted ring: `bits` bits whatever the clients, with the rotation,
    /// room for the first round's safe scale, and without validation (a
    /// new active task in a fitted ring is not validated by default); the
    /// JSON names it, and a spec without the field is the exact ring.
    #[test]
    fn a_fitted_ring_is_the_bits_with_the_rotation_and_no_validation() {
        let fitted = || {
            let mut spec = small_spec();
            spec.quantization.bits = Some(9);
            spec.quantization.ring = RingSizing::Fitted;
            spec.quantization.rotate = true;
            spec
        };
        let plan = TaskPlan::new(fitted()).unwrap();
        assert_eq!(plan.security().modulus_bits, 9);
        assert_eq!(fitted().quantization.ring_bits(127).ok(), Some(9));
        let refusal = |spec: TaskSpec| TaskPlan::new(spec).unwrap_err().to_string();
        assert!(
            fitted().quantization.ring_bits(128).unwrap_err().to_string().contains("at most 127 clients")
        );
        assert!(
            refusal(TaskSpec {
                quantization: QuantizationConfig { rotate: false, ..fitted().quantization },
                ..fitted()
            })
            .contains("needs rotate")
        );
        assert!(
            refusal(TaskSpec {
                quantization: QuantizationConfig { bits: None, ..fitted().quantization },
                ..fitted()
            })
            .contains("needs bits")
        );
        let validated = TaskSpec {
            validation: Some(ValidationSpec { norm: NormChoice::L2, l2_clip: None, group_rule: None }),
            ..fitted()
        };
        assert!(refusal(validated).contains("exact ring"));
        let mut active = fitted();
        active.secure_aggregation.threshold = Some(4);
        let plan = TaskPlan::for_new_task(active).unwrap();
        assert_eq!(plan.security().variant, Variant::Active);
        assert_eq!(plan.spec().validation, None);
        let json = serde_json::to_value(fitted().quantization).unwrap();
        assert_eq!(json["ring"], "fitted");
        let exact: QuantizationConfig = serde_json::from_str(r#"{"bits": 8, "rotate": true}"#).unwrap();
        assert_eq!(exact.ring, RingSizing::Exact);
        assert_eq!(exact.ring_bits(100).ok(), Some(15));
        // The exact ring never announces a scale; a fitted one always does.
        assert_eq!(exact.scale_for(100, None), None);
        assert_eq!(fitted().quantization.scale_for(6, None), cohort_crypto::quantize::safe_scale(9, 6, 1.0));
    }

    #[test]
    fn invalid_specs_are_refused_with_a_reason() {
        type Mutation = fn(&mut TaskSpec);
        let cases: Vec<(Mutation, &str)> = vec![
            (|s| s.rounds = 0, "rounds"),
            (|s| s.clients_per_round = 1, "clients_per_round"),
            (|s| s.over_selection = -0.5, "over_selection"),
            (|s| s.name = " ".into(), "name"),
            (|s| s.deadlines.unmasking_ms = 0, "deadlines"),
            (|s| s.deadlines.advertise_keys_ms = i64::MAX as u64, "a day"),
            (|s| s.deadlines.masked_input_ms = MAX_DEADLINE_MS + 1, "a day"),
            (|s| s.deadlines.availability_ms = MIN_AVAILABILITY_MS - 1, "availability_ms"),
            (|s| s.rounds = MAX_ROUNDS + 1, "rounds must be between"),
            (|s| s.checkpoint_retention = MAX_RETENTION + 1, "checkpoint_retention"),
            (|s| s.name = "a\0b".into(), "control characters"),
            (|s| s.name = "é".repeat(201), "200 characters"),
            (|s| s.model.architecture = "lin\0ear".into(), "model.architecture"),
            (|s| s.model.layout.tensors[0].name = "w\u{7}".into(), "tensor names"),
            // Shapes whose product wraps around a 64-bit count.
            (|s| s.model.layout.tensors[0].shape = vec![(1 << 62) + 1, 4], "too large"),
            (|s| s.model.layout.tensors[0].shape = vec![usize::MAX, usize::MAX], "too large"),
            (|s| s.model.layout.tensors[0].shape = vec![1 << 63, 2], "too large"),
            (|s| s.quantization.modulus_bits = 40, "modulus bits"),
            (|s| s.quantization.bits = Some(3), "between 4 and 16"),
            (|s| s.quantization.bits = Some(17), "between 4 and 16"),
            (|s| s.quantization.clip = 0.0, "clip"),
            (
                |s| {
                    s.quantization.rotate = true;
                    s.quantization.sketch = Some(SketchConfig { rows: 3, columns: 10, top_k: 0 });
                },
                "either rotate or sketch",
            ),
            (
                |s| s.quantization.sketch = Some(SketchConfig { rows: 2, columns: 10, top_k: 0 }),
                "odd number of rows",
            ),
            (|s| s.optimizer = ServerOptimizer::FedAvg { learning_rate: -1.0 }, "learning_rate"),
            (
                |s| {
                    s.validation =
                        Some(ValidationSpec { norm: NormChoice::L2, l2_clip: Some(-1.0), group_rule: None })
                },
                "l2_clip",
            ),
            (
                |s| {
                    s.validation =
                        Some(ValidationSpec { norm: NormChoice::L2, l2_clip: None, group_rule: None });
                    s.quantization.sketch = Some(SketchConfig { rows: 3, columns: 10, top_k: 0 });
                },
                "not with a sketch",
            ),
            (
                |s| {
                    s.validation = Some(ValidationSpec {
                        norm: NormChoice::None,
                        l2_clip: None,
                        group_rule: Some(GroupRule::TrimmedMean { trim: 0.5 }),
                    })
                },
                "trim",
            ),
            (
                |s| {
                    s.validation = Some(ValidationSpec {
                        norm: NormChoice::None,
                        l2_clip: None,
                        group_rule: Some(GroupRule::Norm { max: f32::NAN }),
                    })
                },
                "max",
            ),
            (|s| s.secure_aggregation.threshold = Some(9), "threshold"),
            (
                |s| {
                    // Twelve selected, the first six to advertise their
                    // keys go on: never the seven the threshold needs.
                    s.over_selection = 1.0;
                    s.secure_aggregation.threshold = Some(7);
                },
                "the first 6 of its clients to advertise their keys (clients_per_round over the groups), fewer \
                 than the threshold 7",
            ),
            (
                |s| {
                    // Half the six clients corrupt and half dropping out: no
                    // threshold both survives the dropouts and outnumbers them.
                    s.secure_aggregation.threshold = None;
                    s.secure_aggregation.corruption = 0.5;
                    s.secure_aggregation.target_dropout = 0.5;
                },
                "no graph degree and threshold meet",
            ),
            (|s| s.model.layout.tensors.clear(), "tensor"),
        ];
        for (mutate, needle) in cases {
            let mut spec = small_spec();
            mutate(&mut spec);
            let error = spec.validate().unwrap_err().to_string();
            assert!(error.contains(needle), "{error} should mention {needle}");
        }
        assert!(serde_json::from_str::<TaskSpec>(r#"{"name":"x","bogus":1}"#).is_err());
        // Each kind of fault keeps its type: the field, the layout, the
        // optimizer, the round parameters.
        let refused = |mutate: fn(&mut TaskSpec)| {
            let mut spec = small_spec();
            mutate(&mut spec);
            spec.validate().unwrap_err()
        };
        assert!(matches!(refused(|s| s.rounds = 0), SpecError::Field { field: "rounds", .. }));
        assert!(matches!(
            refused(|s| s.secure_aggregation.threshold = Some(9)),
            SpecError::Field { field: "secure_aggregation.threshold", .. }
        ));
        assert!(matches!(refused(|s| s.model.layout.tensors.clear()), SpecError::Layout(_)));
        assert!(matches!(
            refused(|s| s.optimizer = ServerOptimizer::FedAvg { learning_rate: -1.0 }),
            SpecError::Optimizer(_)
        ));
        assert!(matches!(refused(|s| s.quantization.modulus_bits = 40), SpecError::Round(_)));
    }

    /// The example in the README is a valid spec and shows the defaults.
    /// Plaintext client metrics are for a trusted (semi-honest) coordinator only.
    #[test]
    fn plaintext_metrics_need_the_semi_honest_variant() {
        let mut spec = small_spec();
        spec.client_metrics.plaintext = true;
        spec.secure_aggregation.variant = Some(VariantChoice::Active);
        spec.secure_aggregation.threshold = Some(4);
        let refused = spec.validate().unwrap_err();
        assert!(matches!(refused, SpecError::Field { field: "client_metrics.plaintext", .. }), "{refused:?}");
        assert!(refused.to_string().contains("semi-honest"), "{refused}");
        spec.secure_aggregation.variant = Some(VariantChoice::SemiHonest);
        spec.validate().unwrap();
        // The metrics a round's vectors carry cost their coordinates.
        let none = ClientMetricsSpec { aggregate: MetricSet::NONE, plaintext: false };
        let q = |metrics: MetricSet| spec.quantization.quantizer(6, [0; 32], metrics).unwrap().encoded_len(4);
        assert!(q(ClientMetricsSpec::default().aggregate) > q(none.aggregate));
        let parsed: ClientMetricsSpec = serde_json::from_str(r#"{"aggregate": ["train_loss"]}"#).unwrap();
        assert_eq!(parsed.aggregate.iter().collect::<Vec<_>>(), [cohort_crypto::Metric::TrainLoss]);
        assert!(serde_json::from_str::<ClientMetricsSpec>(r#"{"aggregate": ["f1"]}"#).is_err());
    }

    #[test]
    fn the_readme_example_is_valid() {
        let readme = include_str!("../../README.md");
        let block = readme
            .split("```json\n")
            .skip(1)
            .filter_map(|rest| rest.split_once("```").map(|(block, _)| block))
            .find(|block| block.contains("\"clients_per_round\""))
            .unwrap();
        let spec: TaskSpec = serde_json::from_str(block).unwrap();
        spec.validate().unwrap();
        // The defaults, with the variant a new task gets spelled out.
        let active = SecAggSpec {
            variant: Some(VariantChoice::Active),
            group_size: Some(DEFAULT_GROUP_SIZE),
            ..SecAggSpec::default()
        };
        assert_eq!(spec.secure_aggregation, active);
        assert_eq!(spec.quantization, QuantizationConfig::default());
        assert_eq!(spec.deadlines, StageDeadlines::default());
        assert_eq!(spec.optimizer, ServerOptimizer::default());
        assert_eq!(spec.checkpoint_retention, default_retention());
        assert_eq!(spec.over_selection, 0.0);
        assert_eq!(spec.client_metrics, ClientMetricsSpec::default());
    }

    #[test]
    fn a_round_is_split_into_full_groups_no_larger_than_the_group_size() {
        let mut spec = small_spec();
        let groups = |spec: &TaskSpec| (spec.groups().count, spec.groups().size, spec.selected_per_round());
        // No group size (a spec stored before groups): one group, as before.
        spec.clients_per_round = 1_000;
        spec.over_selection = 0.3;
        assert_eq!(groups(&spec), (1, 1_300, 1_300));
        spec.secure_aggregation.group_size = Some(500);
        assert_eq!(groups(&spec), (3, 434, 1_302));
        assert_eq!(spec.inputs_per_group(), 334);
        spec.secure_aggregation.group_size = Some(1_300);
        assert_eq!(groups(&spec), (1, 1_300, 1_300));
        spec.clients_per_round = 12;
        spec.over_selection = 0.0;
        spec.secure_aggregation.group_size = Some(5);
        assert_eq!(groups(&spec), (3, 4, 12));
        // The pinned round size is the group's, and so are k and t.
        spec.secure_aggregation.threshold = Some(3);
        spec.secure_aggregation.graph = GraphChoice::Complete;
        let security = TaskPlan::new(spec.clone()).unwrap().security();
        assert_eq!((security.clients, security.degree, security.threshold), (4, 3, 3));
        for bad in [0, 1] {
            spec.secure_aggregation.group_size = Some(bad);
            let refused = spec.validate().unwrap_err();
            assert!(
                matches!(refused, SpecError::Field { field: "secure_aggregation.group_size", .. }),
                "{refused:?}"
            );
        }
        // A new task gets the default; an explicit size stays.
        let mut sa = SecAggSpec::default();
        sa.default_for_new_task();
        assert_eq!(sa.group_size, Some(DEFAULT_GROUP_SIZE));
        let mut sa = SecAggSpec { group_size: Some(50), ..SecAggSpec::default() };
        sa.default_for_new_task();
        assert_eq!(sa.group_size, Some(50));
    }

    #[test]
    fn uniform_init_is_deterministic_and_bounded() {
        let mut spec = small_spec();
        spec.model.init = ModelInit::Uniform { scale: 0.1, seed: 3 };
        let a = spec.initial_weights();
        assert_eq!(a, spec.initial_weights());
        assert!(a.iter().all(|w| w.abs() <= 0.1) && a.iter().any(|w| *w != 0.0));
    }

    #[test]
    fn fan_in_init_is_the_client_models_initialisation() {
        let model = cohort_client::model::Model::by_name("cnn", 784, 10).unwrap();
        let mut spec = small_spec();
        spec.model.layout = model.layout();
        spec.model.init = ModelInit::FanIn { seed: 5 };
        assert_eq!(spec.initial_weights(), model.init(5));
        let parsed: ModelInit = serde_json::from_str(r#"{"kind": "fan_in", "seed": 5}"#).unwrap();
        assert_eq!(parsed, ModelInit::FanIn { seed: 5 });
    }

    #[test]
    fn bits_set_the_ring_with_headroom_for_the_selected_clients() {
        let mut spec = small_spec();
        spec.quantization.bits = Some(8);
        spec.validate().unwrap();
        let n = spec.selected_per_round();
        let expected = 8 + (32 - (n - 1).leading_zeros()) as u8;
        assert_eq!(spec.quantization.ring_bits(n).unwrap(), expected);
        let parsed: QuantizationConfig =
            serde_json::from_str(r#"{"bits": 8, "rotate": true, "clip": 0.1}"#).unwrap();
        assert_eq!((parsed.bits, parsed.rotate, parsed.modulus_bits), (Some(8), true, 32));
        let spec = parsed.round_spec([5; 32], MetricSet::NONE, None).unwrap();
        assert_eq!(spec.transform, Transform::Rotate { block: ROTATION_BLOCK, seed: [5; 32] });
    }
}
