//! What a client accepts from a coordinator it does not trust.
//!
//! The protocol keeps a client's update private only if the round it joins
//! is one worth joining: the active variant (a coordinator that may lie about
//! dropouts), enough clients, and a threshold high enough that the
//! coordinator cannot gather both kinds of a client's shares even with
//! some clients on its side. A coordinator chooses all of that, so every
//! client checks it itself before it reveals anything:
//!
//! * a [`Policy`] is the client's own floor: the variants, round sizes,
//!   thresholds, rings and transforms it accepts;
//! * a [`TaskSecurity`] is what the task announced when the client enrolled;
//!   the client keeps it and refuses any later round that announces
//!   something else ([`TaskSecurity::compare`]).
//!
//! A round that breaks either gets a [`PolicyViolation`] naming the rule
//! ([`PolicyViolation::rule`]), before any key is drawn.

use crate::config::{
    RoundConfig, Variant, active_threshold_holds, min_active_threshold, threshold_for_margin,
};
use crate::dp::DpParams;
use crate::graph::GraphSpec;
use crate::params::{Adversary, private_threshold};
use crate::quantize::Transform;

/// The collusion a policy's threshold bound must withstand: the privacy
/// constraint of [`crate::params`], evaluated for the announced round.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct Collusion {
    /// Fraction of the round's clients that may side with the coordinator (γ).
    pub corruption: f64,
    /// The bound holds except with probability 2^-`security_bits` (σ).
    pub security_bits: u32,
}

/// The rounds a client is willing to join. [`Policy::default`] is meant for
/// a coordinator the client does not trust; see its fields for what each
/// rule protects.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields, default))]
pub struct Policy {
    /// Whether rounds of the semi-honest variant are acceptable. Without
    /// signed keys and the consistency check, a coordinator that tells
    /// different clients different survivor lists can unmask one update, so
    /// this is only for a coordinator trusted to follow the protocol.
    /// Default: `false`.
    pub allow_semi_honest: bool,
    /// Fewest clients a round may select. Default: 10.
    pub min_clients: u32,
    /// Lowest threshold t accepted, whatever the degree: the coordinator
    /// can only unmask a sum of at least t inputs. Default: 5.
    pub min_threshold: u32,
    /// The threshold must also meet the privacy bound for the announced
    /// clients and degree against this much collusion (`None`: only
    /// [`min_threshold`](Self::min_threshold) and, in the active variant,
    /// 2t > k + 1). Default: 5 % of the clients, σ = 40, the bound of the
    /// published SecAgg+ parameters.
    pub collusion: Option<Collusion>,
    /// Active variant: the fewest clients of the coordinator's own, in one
    /// client's neighbourhood, that could expose that client's update,
    /// whatever the collusion model says: 2t − k − 1 must be at least this
    /// (with fewer than 2t − k − 1 of its own clients in a neighbourhood the
    /// coordinator exposes no client of it; with that many it can, which
    /// the adversary search shows on every complete round up to 12 clients).
    /// Default: 3.
    pub min_collusion_margin: u32,
    /// Narrowest ring accepted, in bits. Default: 2 (any).
    pub min_ring_bits: u8,
    /// Widest ring accepted, in bits (upload size). Default: 32 (any).
    pub max_ring_bits: u8,
    /// Whether the randomized Hadamard rotation is acceptable. Default: yes.
    pub allow_rotation: bool,
    /// Whether count-sketch compression is acceptable. Default: yes.
    pub allow_sketch: bool,
    /// Whether a task must add differential-privacy noise to every sum.
    /// Default: no (a task without it is accepted; one with it must meet
    /// [`min_noise_multiplier`](Self::min_noise_multiplier) and fit the
    /// [`budget`](Self::budget)).
    pub require_privacy: bool,
    /// The least noise multiplier z (noise standard deviation over one
    /// client's sensitivity) a task with differential privacy may announce
    /// and pin; its rounds may only add noise. Default: 0.5.
    pub min_noise_multiplier: f64,
    /// The client's own budget for one task with differential privacy:
    /// the most (ε, δ) its contributions may spend, by its own accounting
    /// ([`client_epsilon`](crate::dp::accountant::client_epsilon): every
    /// masked input it sent, at the noise it pinned, with no amplification
    /// by sampling, since the coordinator chose it). The client stops
    /// contributing to the task before a contribution would exceed it.
    /// `None`: no budget. Default: ε = 30 at δ = 10⁻⁶.
    pub budget: Option<PrivacyBudget>,
}

/// A client's own differential-privacy budget for one task.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct PrivacyBudget {
    /// The most ε the client's contributions may spend.
    pub epsilon: f64,
    /// The δ the budget's ε is for.
    pub delta: f64,
}

impl PrivacyBudget {
    /// Whether both numbers make a budget: ε ≥ 0, 0 < δ < 1.
    pub fn is_valid(&self) -> bool {
        self.epsilon.is_finite() && self.epsilon >= 0.0 && self.delta > 0.0 && self.delta < 1.0
    }
}

impl Default for Policy {
    /// Safe against a coordinator the client does not trust: the active
    /// variant only, at least 10 clients and a threshold of at least 5 that
    /// also withstands 5 % colluding clients (rounded up) and leaves a
    /// margin of 3 (the coordinator would need 3 clients of its own in one
    /// neighbourhood). The ring and the transforms
    /// change what an update costs to send, not what the coordinator learns
    /// from the sum, so every one is accepted (and then pinned).
    fn default() -> Self {
        Self {
            allow_semi_honest: false,
            min_clients: 10,
            min_threshold: 5,
            collusion: Some(Collusion { corruption: 0.05, security_bits: 40 }),
            min_collusion_margin: 3,
            min_ring_bits: 2,
            max_ring_bits: 32,
            allow_rotation: true,
            allow_sketch: true,
            require_privacy: false,
            min_noise_multiplier: 0.5,
            budget: Some(PrivacyBudget { epsilon: 30.0, delta: 1e-6 }),
        }
    }
}

/// The security parameters of a task, as the coordinator announces them at
/// enrollment and as each round's [`RoundConfig`] must repeat them. Only the
/// per-round randomness (session, transform seeds, roster) may change.
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct TaskSecurity {
    /// Adversary model.
    pub variant: Variant,
    /// Clients selected per round (n).
    pub clients: u32,
    /// Communication graph.
    pub graph: GraphKind,
    /// Neighbours per client (k; n − 1 for the complete graph).
    pub degree: u32,
    /// Shares needed to reconstruct a secret (t).
    pub threshold: u32,
    /// The ring Z_{2^bits}.
    pub modulus_bits: u8,
    /// Coordinates are clipped to [−clip, clip].
    pub clip: f32,
    /// Largest example count a client may report.
    pub max_weight: u32,
    /// Transform applied before quantization (its seed is per round).
    pub transform: TransformKind,
    /// Distributed differential privacy: the noise every round must carry
    /// at least ([`TaskSecurity::compare`] refuses a round whose noise
    /// multiplier is lower, or whose clip norm, scale, mechanism or noise
    /// split differ). Absent: no DP.
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "Option::is_none"))]
    pub privacy: Option<DpParams>,
    /// Every round names the model its clients train from
    /// ([`RoundConfig::model`]): a sync task. Pinned one way: a client that
    /// enrolled in such a task refuses a round (or an async group) that
    /// names none, so a coordinator cannot switch a client to the async
    /// flow to serve it a model of its own (THREAT_MODEL claim 56).
    #[cfg_attr(feature = "serde", serde(default, skip_serializing_if = "std::ops::Not::not"))]
    pub model_bound: bool,
}

/// The shape of the communication graph.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum GraphKind {
    /// Every client shares with every other (SecAgg).
    Complete,
    /// The random Harary graph (SecAgg+).
    Sparse,
}

/// A [`Transform`] without its per-round seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields))]
pub enum TransformKind {
    /// None.
    None,
    /// Randomized Hadamard rotation in blocks of `block`.
    Rotate {
        /// Block size.
        block: u32,
    },
    /// Count sketch.
    Sketch {
        /// Rows.
        rows: u32,
        /// Buckets per row.
        columns: u32,
        /// Coordinates kept when unsketching.
        top_k: u32,
    },
}

impl From<&Transform> for TransformKind {
    fn from(transform: &Transform) -> Self {
        match *transform {
            Transform::None => TransformKind::None,
            Transform::Rotate { block, .. } => TransformKind::Rotate { block },
            Transform::Sketch { rows, columns, top_k, .. } => TransformKind::Sketch { rows, columns, top_k },
        }
    }
}

impl TransformKind {
    fn name(self) -> &'static str {
        match self {
            TransformKind::None => "none",
            TransformKind::Rotate { .. } => "rotate",
            TransformKind::Sketch { .. } => "sketch",
        }
    }
}

/// Why a client refuses a task or a round. Each names the rule it broke
/// ([`rule`](Self::rule)); the client has revealed nothing when it is
/// returned.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyViolation {
    /// A semi-honest round, which the policy does not accept.
    #[error(
        "the round runs the semi-honest variant, which trusts the coordinator; the policy accepts only the active variant"
    )]
    SemiHonest,
    /// Fewer clients than the policy's minimum.
    #[error("the round selects {got} clients; the policy needs at least {min}")]
    TooFewClients {
        /// The policy's minimum.
        min: u32,
        /// Announced.
        got: u32,
    },
    /// A threshold below what the policy accepts for the announced degree.
    #[error("threshold {got} with {degree} neighbours is too low: the policy needs at least {min}")]
    ThresholdTooLow {
        /// The least threshold the policy accepts for this round.
        min: u32,
        /// Announced.
        got: u32,
        /// Announced degree.
        degree: u32,
    },
    /// A ring outside the policy's range.
    #[error("a {got}-bit ring is outside the policy's {min}..={max} bits")]
    Ring {
        /// The policy's narrowest ring.
        min: u8,
        /// The policy's widest ring.
        max: u8,
        /// Announced.
        got: u8,
    },
    /// A transform the policy does not accept.
    #[error("the {0} transform is not accepted by the policy")]
    Transform(&'static str),
    /// A security parameter differs from what the task announced at
    /// enrollment.
    #[error("the task's {parameter} changed since enrollment: {pinned} then, {announced} now")]
    Changed {
        /// Which parameter.
        parameter: &'static str,
        /// At enrollment.
        pinned: String,
        /// In this round.
        announced: String,
    },
    /// A noise multiplier below the one the task promised at enrollment.
    #[error(
        "the round's noise multiplier {announced} is below the {promised} the task promised at enrollment"
    )]
    TooLittleNoise {
        /// At enrollment.
        promised: f64,
        /// In this round.
        announced: f64,
    },
    /// The round's setup is not the round the client was selected for.
    #[error("the setup is for round {got}, the client was selected for round {expected}")]
    WrongRound {
        /// The round of the selection.
        expected: u64,
        /// The round of the setup.
        got: u64,
    },
    /// The setup's session is not the one the selection named.
    #[error("the setup's session is not the session the client was selected for")]
    WrongSession,
    /// A round the client already sent a masked input for: taking part
    /// again would let the coordinator subtract two sums that differ only
    /// by this client's update.
    #[error("round {round} is not after round {last}, the last this client contributed to")]
    Replayed {
        /// Announced round.
        round: u64,
        /// The last round this client sent a masked input for.
        last: u64,
    },
    /// The roster does not list this client's identity key.
    #[error("the roster does not list this client's identity key")]
    NotOurIdentity,
    /// A task without differential privacy, which the policy requires.
    #[error("the task adds no differential-privacy noise; the policy requires it")]
    NoPrivacy,
    /// A noise multiplier below the policy's least.
    #[error("the noise multiplier {got} is below the policy's least, {min}")]
    NoiseBelowPolicy {
        /// The policy's least.
        min: f64,
        /// Announced.
        got: f64,
    },
    /// One more contribution would spend more than the client's own
    /// privacy budget for the task: the client contributes no more to it.
    #[error(
        "one more contribution would spend ε = {would_spend:.3} (δ = {delta}), over this client's budget of {budget}"
    )]
    BudgetSpent {
        /// The budget's ε.
        budget: f64,
        /// Its δ.
        delta: f64,
        /// ε after the contribution refused.
        would_spend: f64,
    },
    /// A model this client already sent an update of (by
    /// [`model_digest`], whatever its version label): a second update
    /// from the same model in another group or round would let the
    /// coordinator solve for both.
    #[error("the coordinator served model {digest} again, which this client already sent an update of")]
    ModelReused {
        /// The model's digest (hex).
        digest: String,
    },
    /// The round names a model other than the one this client was served
    /// and trained from: the others in the round may have been served
    /// another one.
    #[error("the round names model {announced}, this client was served model {served}")]
    WrongModel {
        /// The round configuration's digest (hex).
        announced: String,
        /// The digest of the model this client trained from (hex), or
        /// "none".
        served: String,
    },
    /// The round's parameters are not a valid round at all.
    #[error("invalid round parameters: {0}")]
    Invalid(String),
}

/// The digest by which a client recognises a model it already sent an
/// update of: SHA-256 over a label, each tensor's name and shape, and the
/// weights' IEEE-754 bits (−0 counted as +0), truncated to 16 bytes. What
/// the coordinator attaches to a model (its version label, the round) is
/// left out, so that relabelling a model does not make it new. Sixteen
/// bytes suffice: two different models collide with probability 2⁻¹²⁸, and
/// the coordinator gains nothing from a collision, since what it needs is
/// the *same* model twice (THREAT_MODEL claim 55).
pub fn model_digest<'a>(
    tensors: impl IntoIterator<Item = (&'a str, &'a [usize])>,
    weights: &[f32],
) -> [u8; 16] {
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    hash.update(b"cohort/model-digest/v1");
    for (name, shape) in tensors {
        hash.update(&(name.len() as u64).to_le_bytes());
        hash.update(name.as_bytes());
        hash.update(&(shape.len() as u64).to_le_bytes());
        for &dimension in shape {
            hash.update(&(dimension as u64).to_le_bytes());
        }
    }
    hash.update(&(weights.len() as u64).to_le_bytes());
    let mut block = [0u8; 4096];
    for chunk in weights.chunks(block.len() / 4) {
        for (out, &w) in block.chunks_exact_mut(4).zip(chunk) {
            let w = if w == 0.0 { 0.0f32 } else { w };
            out.copy_from_slice(&w.to_bits().to_le_bytes());
        }
        hash.update(&block[..chunk.len() * 4]);
    }
    let mut digest = [0u8; 16];
    digest.copy_from_slice(&hash.finish().as_ref()[..16]);
    digest
}

impl PolicyViolation {
    /// A stable, machine-readable name of the rule.
    pub fn rule(&self) -> &'static str {
        match self {
            PolicyViolation::SemiHonest => "variant",
            PolicyViolation::TooFewClients { .. } => "min_clients",
            PolicyViolation::ThresholdTooLow { .. } => "min_threshold",
            PolicyViolation::Ring { .. } => "ring",
            PolicyViolation::Transform(_) => "transform",
            PolicyViolation::Changed { .. } => "pinned",
            PolicyViolation::TooLittleNoise { .. } => "noise",
            PolicyViolation::WrongRound { .. } => "round",
            PolicyViolation::WrongSession => "session",
            PolicyViolation::Replayed { .. } => "replay",
            PolicyViolation::NotOurIdentity => "identity",
            PolicyViolation::NoPrivacy => "privacy",
            PolicyViolation::NoiseBelowPolicy { .. } => "noise",
            PolicyViolation::BudgetSpent { .. } => "budget",
            PolicyViolation::ModelReused { .. } => "model",
            PolicyViolation::WrongModel { .. } => "model",
            PolicyViolation::Invalid(_) => "invalid",
        }
    }

    /// Whether the violation is about one round only (a replay or a setup
    /// that is not the round announced) rather than the task: a client may
    /// skip such a round and take part in the next.
    pub fn round_only(&self) -> bool {
        matches!(
            self,
            PolicyViolation::WrongRound { .. }
                | PolicyViolation::WrongSession
                | PolicyViolation::Replayed { .. }
                | PolicyViolation::NotOurIdentity
                | PolicyViolation::ModelReused { .. }
                | PolicyViolation::WrongModel { .. }
        )
    }
}

impl Policy {
    /// The least threshold this policy accepts for a round of `clients`
    /// clients with `degree` neighbours in `variant`.
    pub fn min_threshold_for(&self, variant: Variant, clients: u32, degree: u32) -> u32 {
        let mut min = self.min_threshold.max(1);
        if variant == Variant::Active {
            // 2t − k − 1 ≥ margin, and at least 2t > k + 1.
            let k = degree.min(clients.saturating_sub(1));
            min =
                min.max(min_active_threshold(degree)).max(threshold_for_margin(k, self.min_collusion_margin));
        }
        if let Some(collusion) = self.collusion {
            let adversary = match variant {
                Variant::SemiHonest => Adversary::SemiHonest,
                Variant::Active => Adversary::SemiMalicious,
            };
            min = min.max(private_threshold(
                clients,
                degree,
                collusion.corruption,
                collusion.security_bits,
                adversary,
            ));
        }
        min
    }

    /// The default policy, weakened only where `security` needs it: for
    /// deployments (demos, tests) that know their task is below the default
    /// and say so. [`relaxations`](Self::relaxations) lists what changed.
    pub fn accepting(security: &TaskSecurity) -> Self {
        let default = Self::default();
        let mut policy = Self {
            allow_semi_honest: security.variant == Variant::SemiHonest,
            min_clients: default.min_clients.min(security.clients),
            min_threshold: default.min_threshold.min(security.threshold),
            // The margin is a rule of the active variant; a semi-honest task
            // is accepted (or not) by `allow_semi_honest`.
            min_collusion_margin: match security.variant {
                Variant::Active => default.min_collusion_margin.min(security.collusion_margin()),
                Variant::SemiHonest => default.min_collusion_margin,
            },
            min_ring_bits: default.min_ring_bits.min(security.modulus_bits),
            max_ring_bits: default.max_ring_bits.max(security.modulus_bits),
            min_noise_multiplier: security.privacy.map_or(default.min_noise_multiplier, |p| {
                default.min_noise_multiplier.min(p.noise_multiplier)
            }),
            // The task's length is not known here: its own budget is the
            // coordinator's accountant's.
            budget: if security.privacy.is_some() { None } else { default.budget },
            ..default
        };
        if policy.check(security).is_err() {
            policy.collusion = None;
        }
        policy
    }

    /// How this policy is weaker than [`Policy::default`], in words (empty
    /// when it is not).
    pub fn relaxations(&self) -> Vec<String> {
        let default = Self::default();
        let mut weaker = Vec::new();
        if self.allow_semi_honest {
            weaker.push("accepts the semi-honest variant (trusts the coordinator)".to_string());
        }
        if self.min_clients < default.min_clients {
            weaker.push(format!(
                "accepts rounds of {} clients (default {})",
                self.min_clients, default.min_clients
            ));
        }
        if self.min_threshold < default.min_threshold {
            weaker.push(format!(
                "accepts a threshold of {} (default {})",
                self.min_threshold, default.min_threshold
            ));
        }
        if self.min_collusion_margin < default.min_collusion_margin {
            weaker.push(format!(
                "accepts rounds that {} of the coordinator's own clients in one neighbourhood could break \
                 (default {})",
                self.min_collusion_margin.max(1),
                default.min_collusion_margin
            ));
        }
        if self.min_noise_multiplier < default.min_noise_multiplier {
            weaker.push(format!(
                "accepts a noise multiplier of {} (default {})",
                self.min_noise_multiplier, default.min_noise_multiplier
            ));
        }
        match (self.budget, default.budget) {
            (None, Some(_)) => weaker.push("keeps no privacy budget of its own".to_string()),
            (Some(own), Some(theirs)) if own.epsilon > theirs.epsilon || own.delta > theirs.delta => weaker
                .push(format!(
                    "spends up to ε = {} at δ = {} (default ε = {} at δ = {})",
                    own.epsilon, own.delta, theirs.epsilon, theirs.delta
                )),
            _ => {}
        }
        match (self.collusion, default.collusion) {
            (None, Some(_)) => {
                weaker.push("does not check the threshold against colluding clients".to_string())
            }
            (Some(own), Some(theirs))
                if own.corruption < theirs.corruption || own.security_bits < theirs.security_bits =>
            {
                weaker.push(format!(
                    "checks the threshold against {} % colluding clients at 2^-{} (default {} % at 2^-{})",
                    own.corruption * 100.0,
                    own.security_bits,
                    theirs.corruption * 100.0,
                    theirs.security_bits
                ));
            }
            _ => {}
        }
        weaker
    }

    /// Checks a task's (or a round's) security parameters.
    pub fn check(&self, security: &TaskSecurity) -> Result<(), PolicyViolation> {
        if security.variant == Variant::SemiHonest && !self.allow_semi_honest {
            return Err(PolicyViolation::SemiHonest);
        }
        if security.clients < self.min_clients {
            return Err(PolicyViolation::TooFewClients { min: self.min_clients, got: security.clients });
        }
        let min = self.min_threshold_for(security.variant, security.clients, security.degree);
        if security.threshold < min {
            return Err(PolicyViolation::ThresholdTooLow {
                min,
                got: security.threshold,
                degree: security.degree,
            });
        }
        debug_assert!(
            security.variant == Variant::SemiHonest || active_threshold_holds(min, security.degree)
        );
        if !(self.min_ring_bits..=self.max_ring_bits).contains(&security.modulus_bits) {
            return Err(PolicyViolation::Ring {
                min: self.min_ring_bits,
                max: self.max_ring_bits,
                got: security.modulus_bits,
            });
        }
        match security.transform {
            TransformKind::Rotate { .. } if !self.allow_rotation => {
                return Err(PolicyViolation::Transform(security.transform.name()));
            }
            TransformKind::Sketch { .. } if !self.allow_sketch => {
                return Err(PolicyViolation::Transform(security.transform.name()));
            }
            _ => {}
        }
        match security.privacy {
            None if self.require_privacy => Err(PolicyViolation::NoPrivacy),
            // A NaN multiplier is refused too.
            Some(params)
                if params
                    .noise_multiplier
                    .partial_cmp(&self.min_noise_multiplier)
                    .is_none_or(|order| order == std::cmp::Ordering::Less) =>
            {
                Err(PolicyViolation::NoiseBelowPolicy {
                    min: self.min_noise_multiplier,
                    got: params.noise_multiplier,
                })
            }
            _ => Ok(()),
        }
    }

    /// Whether a client that already sent `contributions` masked inputs
    /// to a task with `security` may send one more, by its
    /// [`budget`](Self::budget): the accounting of
    /// [`client_epsilon`](crate::dp::accountant::client_epsilon) for a
    /// model of `dimension` parameters (padded to the task's rotation
    /// block), at the noise the task pinned; the ε it would then have
    /// spent. A task without differential privacy, or a policy without a
    /// budget, has no budget to spend (`None`).
    pub fn check_budget(
        &self,
        security: &TaskSecurity,
        dimension: usize,
        contributions: u64,
    ) -> Result<Option<f64>, PolicyViolation> {
        let (Some(budget), Some(params)) = (self.budget, security.privacy) else {
            return Ok(None);
        };
        let block = match security.transform {
            TransformKind::Rotate { block } => block,
            _ => 1,
        };
        let padded = crate::dp::padded_len(dimension, block);
        let after = crate::dp::accountant::client_epsilon(&params, padded, contributions + 1, budget.delta);
        // An invalid budget, or an ε that is not a number, admits nothing.
        let within = after.epsilon.partial_cmp(&budget.epsilon).is_some_and(|order| order.is_le());
        if !budget.is_valid() || !within {
            return Err(PolicyViolation::BudgetSpent {
                budget: budget.epsilon,
                delta: budget.delta,
                would_spend: after.epsilon,
            });
        }
        Ok(Some(after.epsilon))
    }
}

impl TaskSecurity {
    /// How many clients of the coordinator's own in one client's
    /// neighbourhood would let it expose that client's update: 2t − k − 1
    /// in the active variant (0 where that is not positive); none are
    /// needed in the semi-honest one, which trusts the coordinator.
    pub fn collusion_margin(&self) -> u32 {
        match self.variant {
            Variant::Active => (2 * self.threshold).saturating_sub(self.degree + 1),
            Variant::SemiHonest => 0,
        }
    }

    /// The security parameters a round announces. The round must be valid
    /// ([`RoundConfig::validate`]); an invalid one is refused here too.
    pub fn of_round(config: &RoundConfig) -> Result<Self, PolicyViolation> {
        config.validate().map_err(|e| PolicyViolation::Invalid(e.to_string()))?;
        Ok(Self {
            variant: config.variant,
            clients: config.clients,
            graph: match config.graph {
                GraphSpec::Complete => GraphKind::Complete,
                GraphSpec::Harary { .. } => GraphKind::Sparse,
            },
            degree: config.degree(),
            threshold: config.threshold,
            modulus_bits: config.modulus_bits,
            clip: config.quantization.clip,
            max_weight: config.quantization.max_weight,
            transform: TransformKind::from(&config.quantization.transform),
            privacy: config.quantization.privacy,
            model_bound: config.model.is_some(),
        })
    }

    /// Checks that `announced` (a round's parameters) repeats these, the
    /// parameters pinned at enrollment; names the first that differs.
    pub fn compare(&self, announced: &TaskSecurity) -> Result<(), PolicyViolation> {
        fn differ(
            parameter: &'static str,
            pinned: impl ToString,
            announced: impl ToString,
        ) -> PolicyViolation {
            PolicyViolation::Changed {
                parameter,
                pinned: pinned.to_string(),
                announced: announced.to_string(),
            }
        }
        let variant = |v: Variant| match v {
            Variant::Active => "active",
            Variant::SemiHonest => "semi-honest",
        };
        let graph = |g: GraphKind| match g {
            GraphKind::Complete => "complete",
            GraphKind::Sparse => "sparse",
        };
        if self.variant != announced.variant {
            return Err(differ("variant", variant(self.variant), variant(announced.variant)));
        }
        if self.clients != announced.clients {
            return Err(differ("clients per round", self.clients, announced.clients));
        }
        if self.graph != announced.graph {
            return Err(differ("graph", graph(self.graph), graph(announced.graph)));
        }
        if self.degree != announced.degree {
            return Err(differ("degree", self.degree, announced.degree));
        }
        if self.threshold != announced.threshold {
            return Err(differ("threshold", self.threshold, announced.threshold));
        }
        if self.modulus_bits != announced.modulus_bits {
            return Err(differ("ring bits", self.modulus_bits, announced.modulus_bits));
        }
        if self.clip.to_bits() != announced.clip.to_bits() {
            return Err(differ("clip", self.clip, announced.clip));
        }
        if self.max_weight != announced.max_weight {
            return Err(differ("max weight", self.max_weight, announced.max_weight));
        }
        if self.transform != announced.transform {
            return Err(differ(
                "transform",
                format!("{:?}", self.transform),
                format!("{:?}", announced.transform),
            ));
        }
        if self.model_bound && !announced.model_bound {
            return Err(differ("model binding", "every round names its model", "a round that names none"));
        }
        match (&self.privacy, &announced.privacy) {
            (None, None) => Ok(()),
            (Some(_), None) => Err(differ("differential privacy", "on", "off")),
            (None, Some(_)) => Err(differ("differential privacy", "off", "on")),
            (Some(pinned), Some(now)) => {
                if pinned.mechanism != now.mechanism {
                    return Err(differ("DP mechanism", pinned.mechanism.as_str(), now.mechanism.as_str()));
                }
                if pinned.clip_norm.to_bits() != now.clip_norm.to_bits() {
                    return Err(differ("DP clip norm", pinned.clip_norm, now.clip_norm));
                }
                if pinned.scale.to_bits() != now.scale.to_bits() {
                    return Err(differ("DP scale", pinned.scale, now.scale));
                }
                if pinned.noise_shares != now.noise_shares {
                    return Err(differ("DP noise shares", pinned.noise_shares, now.noise_shares));
                }
                if now.noise_multiplier < pinned.noise_multiplier {
                    return Err(PolicyViolation::TooLittleNoise {
                        promised: pinned.noise_multiplier,
                        announced: now.noise_multiplier,
                    });
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::QuantizationSpec;

    /// Known answer (Python's hashlib over the same bytes), −0 read as +0,
    /// and every part of the layout and every weight counts.
    #[test]
    fn the_model_digest_is_sha256_of_the_layout_and_the_weights() {
        let layout = [("w", &[2usize, 2][..]), ("b", &[2][..])];
        let weights = [1.0, -0.0, 0.5, -2.0, 3.25, 0.0];
        let digest = model_digest(layout, &weights);
        assert_eq!(hex::encode(digest), "bb1e1fff0b5b163fd0486e1c8a72868e");
        let positive = [1.0, 0.0, 0.5, -2.0, 3.25, 0.0];
        assert_eq!(model_digest(layout, &positive), digest);
        let mut nudged = weights;
        nudged[4] = f32::from_bits(3.25f32.to_bits() + 1);
        assert_ne!(model_digest(layout, &nudged), digest);
        assert_ne!(model_digest([("w", &[2usize, 2][..]), ("c", &[2][..])], &weights), digest);
        assert_ne!(model_digest([("w", &[4usize][..]), ("b", &[2][..])], &weights), digest);
        // More weights than one hashing block, split at any point.
        let long: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        assert_ne!(
            model_digest([("w", &[3000usize][..])], &long),
            model_digest([("w", &[3000usize][..])], &long[..2999])
        );
    }

    fn round(variant: Variant, clients: u32, graph: GraphSpec, threshold: u32) -> RoundConfig {
        RoundConfig {
            session: [7; 16],
            round: 3,
            variant,
            clients,
            identities: match variant {
                Variant::Active => (0..clients)
                    .map(|i| {
                        let mut key = [0; 32];
                        key[..4].copy_from_slice(&i.to_le_bytes());
                        key
                    })
                    .collect(),
                Variant::SemiHonest => Vec::new(),
            },
            graph,
            threshold,
            vector_len: 8,
            modulus_bits: 24,
            quantization: QuantizationSpec {
                clip: 1.0,
                max_weight: 64,
                transform: Transform::None,
                metrics: crate::MetricSet::NONE,
                privacy: None,
                validation: None,
                scale: None,
            },
            model: None,
        }
    }

    fn security(config: &RoundConfig) -> TaskSecurity {
        let Ok(security) = TaskSecurity::of_round(config) else { panic!("valid round") };
        security
    }

    #[test]
    fn the_default_policy_accepts_the_published_active_parameters_and_nothing_weaker() {
        let policy = Policy::default();
        // Bell et al.'s semi-malicious row at n = 1000.
        let published = security(&round(Variant::Active, 1000, GraphSpec::Harary { degree: 398 }, 223));
        assert_eq!(policy.check(&published), Ok(()));
        let min = policy.min_threshold_for(Variant::Active, 1000, 398);
        assert!(min > 199 && min <= 223, "{min}");
        let low = security(&round(Variant::Active, 1000, GraphSpec::Harary { degree: 398 }, min - 1));
        assert_eq!(
            policy.check(&low),
            Err(PolicyViolation::ThresholdTooLow { min, got: min - 1, degree: 398 })
        );
        // The smallest round the default accepts: ten clients and a
        // threshold that three clients of the coordinator's own cannot
        // break (2t − k − 1 ≥ 3). t = 6 is a strict majority of the ten
        // holders of each seed's shares (2t > k + 1), and two of the
        // coordinator's own clients would expose an update (the adversary
        // search's `the_collusion_margin_is_exact...`).
        let ten = |t| security(&round(Variant::Active, 10, GraphSpec::Complete, t));
        assert_eq!(policy.check(&ten(7)), Ok(()));
        assert_eq!((ten(7).collusion_margin(), ten(6).collusion_margin()), (4, 2));
        assert_eq!(
            policy.check(&ten(6)),
            Err(PolicyViolation::ThresholdTooLow { min: 7, got: 6, degree: 9 })
        );
        let lenient = Policy { min_collusion_margin: 2, ..policy };
        assert_eq!(lenient.check(&ten(6)), Ok(()));
        assert!(lenient.relaxations().iter().any(|r| r.contains("2 of the coordinator's own clients")));
        assert!(TaskSecurity::of_round(&round(Variant::Active, 10, GraphSpec::Complete, 5)).is_err());
        assert_eq!(
            policy.check(&security(&round(Variant::Active, 9, GraphSpec::Complete, 6))),
            Err(PolicyViolation::TooFewClients { min: 10, got: 9 })
        );
        let semi_honest = security(&round(Variant::SemiHonest, 100, GraphSpec::Complete, 60));
        assert_eq!(policy.check(&semi_honest), Err(PolicyViolation::SemiHonest));
        assert_eq!(PolicyViolation::SemiHonest.rule(), "variant");
        let trusting = Policy { allow_semi_honest: true, ..policy };
        assert_eq!(trusting.check(&semi_honest), Ok(()));
    }

    #[test]
    fn the_absolute_minimum_binds_where_the_bound_is_weaker() {
        let policy = Policy { min_clients: 2, ..Policy::default() };
        // Four neighbours: 2t > k + 1 asks for 3; the policy's floor is 5.
        let sparse = security(&round(Variant::Active, 20, GraphSpec::Harary { degree: 4 }, 3));
        assert_eq!(
            policy.check(&sparse),
            Err(PolicyViolation::ThresholdTooLow { min: 5, got: 3, degree: 4 })
        );
        // Without the floor and the collusion bound, the margin binds:
        // 2t − k − 1 ≥ 3 asks for 4.
        let weaker = Policy { min_threshold: 2, collusion: None, ..policy };
        assert_eq!(
            weaker.check(&sparse),
            Err(PolicyViolation::ThresholdTooLow { min: 4, got: 3, degree: 4 })
        );
        let weakest = Policy { min_collusion_margin: 0, ..weaker };
        assert_eq!(weakest.check(&sparse), Ok(()));
        assert_eq!(weakest.min_threshold_for(Variant::Active, 20, 4), 3);
        assert_eq!(weakest.min_threshold_for(Variant::SemiHonest, 20, 4), 2);
    }

    #[test]
    fn rings_and_transforms_outside_the_policy_are_named() {
        let policy = Policy { min_ring_bits: 8, max_ring_bits: 16, allow_sketch: false, ..Policy::default() };
        let mut config = round(Variant::Active, 10, GraphSpec::Complete, 7);
        assert_eq!(policy.check(&security(&config)), Err(PolicyViolation::Ring { min: 8, max: 16, got: 24 }));
        config.modulus_bits = 16;
        assert_eq!(policy.check(&security(&config)), Ok(()));
        config.quantization.transform = Transform::Sketch { rows: 3, columns: 64, top_k: 0, seed: [1; 32] };
        config.vector_len = 3 * 64 + 1;
        let refused = policy.check(&security(&config));
        assert_eq!(refused, Err(PolicyViolation::Transform("sketch")));
        assert_eq!(refused.map_err(|e| e.rule()), Err("transform"));
        let sketches = Policy { allow_sketch: true, ..policy };
        assert_eq!(sketches.check(&security(&config)), Ok(()), "an accepted transform is accepted");
        let no_rotation = Policy { allow_rotation: false, ..Policy::default() };
        config.quantization.transform = Transform::Rotate { block: 8, seed: [1; 32] };
        config.vector_len = 9;
        assert_eq!(no_rotation.check(&security(&config)), Err(PolicyViolation::Transform("rotate")));
    }

    #[test]
    fn every_pinned_parameter_is_compared_and_only_the_seeds_may_change() {
        let config = round(Variant::Active, 10, GraphSpec::Complete, 6);
        let pinned = security(&config);
        let mut next = config.clone();
        next.session = [9; 16];
        next.round = 4;
        next.identities[0] = [0xee; 32];
        assert_eq!(pinned.compare(&security(&next)), Ok(()));
        type Change = Box<dyn Fn(&mut RoundConfig)>;
        let changes: Vec<(&str, Change)> = vec![
            (
                "variant",
                Box::new(|c| {
                    c.variant = Variant::SemiHonest;
                    c.identities.clear();
                }),
            ),
            (
                "clients per round",
                Box::new(|c| {
                    c.clients = 11;
                    c.identities.push([11; 32]);
                }),
            ),
            ("graph", Box::new(|c| c.graph = GraphSpec::Harary { degree: 9 })),
            ("threshold", Box::new(|c| c.threshold = 7)),
            ("ring bits", Box::new(|c| c.modulus_bits = 20)),
            ("clip", Box::new(|c| c.quantization.clip = 2.0)),
            ("max weight", Box::new(|c| c.quantization.max_weight = 32)),
            (
                "transform",
                Box::new(|c| c.quantization.transform = Transform::Rotate { block: 8, seed: [0; 32] }),
            ),
        ];
        for (parameter, change) in changes {
            let mut changed = config.clone();
            change(&mut changed);
            let Err(PolicyViolation::Changed { parameter: named, .. }) = pinned.compare(&security(&changed))
            else {
                panic!("{parameter}: not refused");
            };
            assert_eq!(named, parameter);
        }
        let mut sparse = round(Variant::Active, 12, GraphSpec::Harary { degree: 6 }, 4);
        let pinned = security(&sparse);
        sparse.graph = GraphSpec::Harary { degree: 8 };
        sparse.threshold = 5;
        let Err(PolicyViolation::Changed { parameter: "degree", .. }) = pinned.compare(&security(&sparse))
        else {
            panic!("degree: not refused");
        };
    }

    #[test]
    fn a_policy_accepting_a_small_task_is_weakened_only_where_needed_and_says_so() {
        assert!(Policy::default().relaxations().is_empty());
        let demo = security(&round(Variant::Active, 3, GraphSpec::Complete, 2));
        let policy = Policy::accepting(&demo);
        assert_eq!(policy.check(&demo), Ok(()));
        assert_eq!((policy.min_clients, policy.min_threshold, policy.allow_semi_honest), (3, 2, false));
        // One client of the coordinator's own (5 % of 3, rounded up) would
        // expose an update of so small a round (2t − k − 1 = 1): the margin
        // is lowered to it and the collusion bound dropped, and both are
        // said.
        assert_eq!((policy.min_collusion_margin, policy.collusion), (1, None));
        assert_eq!(policy.relaxations().len(), 4, "{:?}", policy.relaxations());
        // Still refuses what the task does not need.
        let semi_honest = security(&round(Variant::SemiHonest, 3, GraphSpec::Complete, 2));
        assert_eq!(policy.check(&semi_honest), Err(PolicyViolation::SemiHonest));
        let smaller = security(&round(Variant::SemiHonest, 2, GraphSpec::Complete, 1));
        let trusting = Policy { allow_semi_honest: true, ..policy };
        assert_eq!(trusting.check(&smaller), Err(PolicyViolation::TooFewClients { min: 3, got: 2 }));
        // A complete graph of 100 with a bare majority (2t = k + 3) misses
        // the collusion bound: only then is the bound dropped.
        let majority = security(&round(Variant::Active, 100, GraphSpec::Complete, 51));
        let policy = Policy::accepting(&majority);
        assert_eq!((policy.collusion, policy.check(&majority)), (None, Ok(())));
        assert!(policy.relaxations().iter().any(|r| r.contains("colluding")));
    }

    #[test]
    fn an_invalid_round_is_refused_as_such() {
        let mut config = round(Variant::Active, 10, GraphSpec::Complete, 4);
        assert!(matches!(TaskSecurity::of_round(&config), Err(PolicyViolation::Invalid(_))));
        config.threshold = 6;
        config.identities.pop();
        assert!(matches!(TaskSecurity::of_round(&config), Err(PolicyViolation::Invalid(_))));
    }

    /// A round under differential privacy, as a coordinator announces it.
    fn private_round(noise_multiplier: f64) -> RoundConfig {
        let mut config = round(Variant::Active, 10, GraphSpec::Complete, 6);
        config.modulus_bits = 16;
        config.quantization = QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: Transform::Rotate { block: 8, seed: [1; 32] },
            metrics: crate::MetricSet::NONE,
            privacy: Some(DpParams {
                mechanism: crate::dp::Mechanism::Skellam,
                clip_norm: 1.0,
                noise_multiplier,
                scale: 300.0,
                noise_shares: 6,
            }),
            validation: None,
            scale: None,
        };
        config
    }

    /// A client refuses a round whose noise is below what the task
    /// promised at enrollment, and any other change to the pinned DP
    /// parameters; more noise is fine.
    #[test]
    fn a_round_with_less_noise_than_promised_is_refused() {
        let pinned = security(&private_round(1.0));
        assert_eq!(pinned.compare(&security(&private_round(1.0))), Ok(()));
        assert_eq!(pinned.compare(&security(&private_round(1.5))), Ok(()));
        let less = pinned.compare(&security(&private_round(0.9)));
        assert_eq!(less, Err(PolicyViolation::TooLittleNoise { promised: 1.0, announced: 0.9 }));
        assert_eq!(less.unwrap_err().rule(), "noise");
        let change = |f: fn(&mut DpParams)| {
            let mut config = private_round(1.0);
            if let Some(p) = config.quantization.privacy.as_mut() {
                f(p);
            }
            pinned.compare(&security(&config))
        };
        for (f, parameter) in [
            ((|p| p.mechanism = crate::dp::Mechanism::DiscreteGaussian) as fn(&mut DpParams), "DP mechanism"),
            (|p| p.clip_norm = 2.0, "DP clip norm"),
            (|p| p.scale = 301.0, "DP scale"),
            (|p| p.noise_shares = 5, "DP noise shares"),
        ] {
            assert!(
                matches!(change(f), Err(PolicyViolation::Changed { parameter: named, .. }) if named == parameter),
                "{parameter}"
            );
        }
        let mut plain = private_round(1.0);
        plain.quantization.privacy = None;
        assert!(matches!(
            pinned.compare(&security(&plain)),
            Err(PolicyViolation::Changed { parameter: "differential privacy", .. })
        ));
        // A split into more shares than the threshold would let a sum of
        // threshold + 1 inputs carry less than the full noise: invalid.
        let mut split = private_round(1.0);
        if let Some(p) = split.quantization.privacy.as_mut() {
            p.noise_shares = 7;
        }
        assert!(matches!(TaskSecurity::of_round(&split), Err(PolicyViolation::Invalid(_))));
    }

    /// THREAT_MODEL claim 57: the default policy refuses a private task
    /// whose noise multiplier is below 0.5 (the z = 1e-9 of a coordinator
    /// that announces privacy and adds none) and accepts z = 1; a policy
    /// that requires privacy refuses a task without it; `accepting` lowers
    /// the floor to the task's noise, drops the budget of a private task,
    /// and says both.
    #[test]
    fn the_policy_asks_for_noise_where_a_task_has_privacy_and_can_require_it() {
        // t = 7 of 10: the default policy's margin holds.
        let private_round = |z| RoundConfig { threshold: 7, ..private_round(z) };
        let policy = Policy::default();
        let faint = security(&private_round(1e-9));
        assert_eq!(policy.check(&faint), Err(PolicyViolation::NoiseBelowPolicy { min: 0.5, got: 1e-9 }));
        assert_eq!(policy.check(&faint).unwrap_err().rule(), "noise");
        assert_eq!(policy.check(&security(&private_round(1.0))), Ok(()));
        let mut plain = private_round(1.0);
        plain.quantization.privacy = None;
        let plain = security(&plain);
        assert_eq!(policy.check(&plain), Ok(()));
        let strict = Policy { require_privacy: true, ..policy };
        assert_eq!(strict.check(&plain), Err(PolicyViolation::NoPrivacy));
        assert_eq!(strict.check(&security(&private_round(1.0))), Ok(()));
        let lenient = Policy::accepting(&faint);
        assert_eq!(lenient.check(&faint), Ok(()));
        assert_eq!(lenient.budget, None);
        let said = lenient.relaxations().join("; ");
        assert!(
            said.contains("noise multiplier of 0.000000001") && said.contains("no privacy budget"),
            "{said}"
        );
        assert_eq!(Policy::accepting(&plain).budget, Policy::default().budget, "no privacy, nothing to drop");
    }

    /// THREAT_MODEL claim 57: a client's own budget admits contributions
    /// while the ε of all of them, by `client_epsilon` at the pinned noise
    /// and the padded dimension, stays within it, and refuses the first
    /// that would exceed it; more noise buys more contributions; no budget
    /// or no privacy spends nothing; an invalid budget admits nothing.
    #[test]
    fn a_clients_budget_admits_contributions_until_the_next_would_exceed_it() {
        let task = security(&private_round(1.0));
        let Some(params) = task.privacy else { panic!("a private round") };
        let TransformKind::Rotate { block } = task.transform else { panic!("private rounds rotate") };
        let dimension = 5;
        let padded = crate::dp::padded_len(dimension, block);
        let delta = 1e-6;
        let spent = |k| crate::dp::accountant::client_epsilon(&params, padded, k, delta).epsilon;
        assert_eq!(spent(0), 0.0);
        assert!(spent(1) > 0.0 && spent(2) > spent(1) && spent(3) > spent(2));
        let policy = Policy { budget: Some(PrivacyBudget { epsilon: spent(3), delta }), ..Policy::default() };
        for k in 0..3 {
            assert_eq!(
                policy.check_budget(&task, dimension, k),
                Ok(Some(spent(k + 1))),
                "contribution {}",
                k + 1
            );
        }
        let refused = policy.check_budget(&task, dimension, 3);
        assert_eq!(
            refused,
            Err(PolicyViolation::BudgetSpent { budget: spent(3), delta, would_spend: spent(4) })
        );
        assert_eq!(refused.unwrap_err().rule(), "budget");
        // Twice the noise: the fourth contribution fits.
        let noisier = security(&private_round(2.0));
        assert!(policy.check_budget(&noisier, dimension, 3).is_ok());
        // No budget, or no privacy: nothing to spend.
        let unlimited = Policy { budget: None, ..policy };
        assert_eq!(unlimited.check_budget(&task, dimension, 1_000), Ok(None));
        let mut plain = private_round(1.0);
        plain.quantization.privacy = None;
        assert_eq!(policy.check_budget(&security(&plain), dimension, 1_000), Ok(None));
        // A budget that is not one admits nothing: ε not a number, infinite
        // or negative, δ outside (0, 1) (at δ = 1 the accountant's ε would
        // be small and admit everything).
        assert!(PrivacyBudget { epsilon: 0.0, delta }.is_valid());
        for broken in [
            PrivacyBudget { epsilon: f64::NAN, delta },
            PrivacyBudget { epsilon: f64::INFINITY, delta },
            PrivacyBudget { epsilon: -1.0, delta },
            PrivacyBudget { epsilon: 1e6, delta: 0.0 },
            PrivacyBudget { epsilon: 1e6, delta: 1.0 },
        ] {
            assert!(!broken.is_valid(), "{broken:?}");
            let policy = Policy { budget: Some(broken), ..policy };
            assert!(policy.check_budget(&task, dimension, 0).is_err(), "{broken:?}");
        }
        // The default budget: ε = 30 at δ = 1e-6; a larger ε or δ is a
        // relaxation and says so, a smaller one is not.
        let default = Policy::default();
        assert_eq!(default.budget, Some(PrivacyBudget { epsilon: 30.0, delta: 1e-6 }));
        for (epsilon, delta, weaker) in
            [(31.0, 1e-6, true), (30.0, 1e-5, true), (10.0, 1e-6, false), (30.0, 1e-9, false)]
        {
            let said = Policy { budget: Some(PrivacyBudget { epsilon, delta }), ..default }.relaxations();
            assert_eq!(
                said.iter().any(|s| s.starts_with("spends up to")),
                weaker,
                "ε {epsilon}, δ {delta}: {said:?}"
            );
        }
    }

    /// The refusals that end one round only (a client may take part in the
    /// next) and those that end the client's part in the task.
    #[test]
    fn a_violation_says_whether_it_ends_the_round_or_the_task() {
        let digest = "00".repeat(16);
        for round_only in [
            PolicyViolation::WrongRound { expected: 2, got: 3 },
            PolicyViolation::WrongSession,
            PolicyViolation::Replayed { round: 2, last: 2 },
            PolicyViolation::NotOurIdentity,
            PolicyViolation::ModelReused { digest: digest.clone() },
            PolicyViolation::WrongModel { announced: digest.clone(), served: "none".into() },
        ] {
            assert!(round_only.round_only(), "{round_only:?}");
        }
        for task in [
            PolicyViolation::SemiHonest,
            PolicyViolation::NoPrivacy,
            PolicyViolation::NoiseBelowPolicy { min: 0.5, got: 0.1 },
            PolicyViolation::BudgetSpent { budget: 1.0, delta: 1e-6, would_spend: 2.0 },
            PolicyViolation::TooLittleNoise { promised: 1.0, announced: 0.5 },
            PolicyViolation::Changed {
                parameter: "model binding",
                pinned: "a".into(),
                announced: "b".into(),
            },
        ] {
            assert!(!task.round_only(), "{task:?}");
        }
    }

    /// THREAT_MODEL claim 56: a task whose rounds name their model keeps
    /// them naming it; one that did not may start.
    #[test]
    fn the_model_binding_is_pinned_one_way() {
        let plain = round(Variant::Active, 10, GraphSpec::Complete, 7);
        let bound = RoundConfig { model: Some([3; 16]), ..plain.clone() };
        let other = RoundConfig { model: Some([4; 16]), ..plain.clone() };
        let (plain, bound, other) = (security(&plain), security(&bound), security(&other));
        assert!(bound.model_bound && other.model_bound && !plain.model_bound);
        assert_eq!(bound.compare(&other), Ok(()), "the digest changes every round");
        assert_eq!(plain.compare(&bound), Ok(()));
        assert!(matches!(
            bound.compare(&plain),
            Err(PolicyViolation::Changed { parameter: "model binding", .. })
        ));
    }
}
