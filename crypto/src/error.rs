//! Errors of the protocol core.
//!
//! Cryptographic failures are deliberately opaque ([`CryptoError`] has no
//! reason): telling a peer *why* a decryption or signature check failed only
//! helps an attacker. Protocol errors, in contrast, are precise, because a
//! coordinator must tell a misbehaving or confused client exactly what it did
//! wrong without disturbing the round for everybody else.

use crate::ids::ClientId;
use crate::wire::DecodeError;

/// A cryptographic operation failed (authentication tag, signature, key
/// agreement with a low-order point, inconsistent secret shares).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("cryptographic failure")]
pub struct CryptoError;

/// Which stage of the protocol a message or a state belongs to. Its
/// serialized name is its [`Display`](core::fmt::Display) name (one
/// kebab-case table, for serde and strum alike); stages order as a round
/// runs them.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    strum::Display,
    strum::EnumString,
    strum::IntoStaticStr,
    strum::EnumIter,
)]
#[strum(serialize_all = "kebab-case")]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[cfg_attr(feature = "serde", serde(rename_all = "kebab-case"))]
#[non_exhaustive]
pub enum Stage {
    /// The server announces the round's public parameters.
    Setup,
    /// Clients publish their two X25519 public keys.
    AdvertiseKeys,
    /// Clients send encrypted Shamir shares of their secrets to their neighbours.
    ShareKeys,
    /// Clients send their masked input vector.
    MaskedInputCollection,
    /// Clients sign the survivor list (active variant only).
    ConsistencyCheck,
    /// Clients reveal the shares that let the server remove the masks.
    Unmasking,
    /// The round is over.
    Finished,
}

/// Invalid public round parameters.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Fewer than two clients cannot aggregate anything privately.
    #[error("a round needs at least 2 clients, got {0}")]
    TooFewClients(u32),
    /// More clients than the protocol supports.
    #[error("a round supports at most {max} clients, got {got}")]
    TooManyClients {
        /// The limit.
        max: u32,
        /// The requested number.
        got: u32,
    },
    /// The threshold must lie in `1..=degree`.
    #[error("threshold {threshold} must be between 1 and the neighbourhood size {degree}")]
    BadThreshold {
        /// The requested threshold.
        threshold: u32,
        /// The neighbourhood size.
        degree: u32,
    },
    /// The active variant needs the threshold to be a strict majority of
    /// the holders of a client's seed shares, its k neighbours and itself
    /// (2t > k + 1): otherwise a coordinator can show the client and part
    /// of its neighbours a survivor list where it survived and the rest one
    /// where it dropped, collect t signatures on each, and obtain both the
    /// shares of the client's self-mask seed (its own among them) and those
    /// of its mask key.
    #[error(
        "the active variant needs a threshold above half of the neighbourhood and the client itself: 2 × {threshold} must exceed {degree} + 1"
    )]
    ThresholdBelowMajority {
        /// The requested threshold.
        threshold: u32,
        /// The neighbourhood size.
        degree: u32,
    },
    /// The sparse graph needs an even degree in `2..n-1`.
    #[error("graph degree {degree} is invalid for {clients} clients (need an even number in 2..{clients})")]
    BadDegree {
        /// The requested degree.
        degree: u32,
        /// The number of clients.
        clients: u32,
    },
    /// The ring Z_{2^bits} must have between 2 and 32 bits.
    #[error("modulus bits must be in 2..=32, got {0}")]
    BadModulusBits(u8),
    /// Vector length outside the supported range.
    #[error("vector length must be in 1..={max}, got {got}")]
    BadVectorLength {
        /// The limit.
        max: u32,
        /// The requested length.
        got: u32,
    },
    /// The active variant needs one identity key per client.
    #[error("the active variant needs an identity key for each of the {expected} clients, got {got}")]
    MissingIdentities {
        /// Clients in the roster.
        expected: u32,
        /// Identity keys supplied.
        got: u32,
    },
    /// Two roster entries carry one identity key: a signature of that key
    /// would count for both.
    #[error("clients {first} and {second} of the roster have the same identity key")]
    DuplicateIdentity {
        /// The first client with the key.
        first: u32,
        /// Another client with the same key.
        second: u32,
    },
    /// A quantization parameter is out of range.
    #[error("invalid quantization: {0}")]
    BadQuantization(&'static str),
    /// A dropout or corruption rate outside `[0, 1)`.
    #[error("rate {0} must be in [0, 1)")]
    BadRate(f64),
    /// No (degree, threshold) pair meets the security and correctness targets.
    #[error("no graph degree and threshold meet the targets for {clients} clients")]
    Infeasible {
        /// The number of clients.
        clients: u32,
    },
}

/// A protocol rule was broken, by a peer or by the local caller.
///
/// Every variant names what went wrong precisely enough for a coordinator to
/// return it to the offending client; none carries secret material.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// The message could not be decoded.
    #[error("malformed message: {0}")]
    Decode(#[from] DecodeError),
    /// The round parameters are invalid.
    #[error("invalid round configuration: {0}")]
    Config(#[from] ConfigError),
    /// A cryptographic check failed.
    #[error(transparent)]
    Crypto(#[from] CryptoError),
    /// The message belongs to another round (for example, a replay).
    #[error("message belongs to a different round")]
    WrongRound,
    /// The message does not belong to the current stage.
    #[error("message for stage {got} arrived during stage {expected}")]
    OutOfPhase {
        /// The stage the receiver is in.
        expected: Stage,
        /// The stage the message belongs to.
        got: Stage,
    },
    /// The sender is not part of this round.
    #[error("client {0} is not in this round's roster")]
    UnknownClient(ClientId),
    /// The sender already sent its message for this stage.
    #[error("client {0} already sent its message for this stage")]
    Duplicate(ClientId),
    /// The sender dropped out of an earlier stage and may not take part now.
    #[error("client {client} is not eligible for stage {stage}")]
    NotEligible {
        /// The sender.
        client: ClientId,
        /// The current stage.
        stage: Stage,
    },
    /// Too few clients remain for the threshold; the round must abort.
    #[error("only {have} clients remain at stage {stage}, the threshold is {need}")]
    BelowThreshold {
        /// The stage that fell short.
        stage: Stage,
        /// Clients remaining.
        have: u32,
        /// Clients required.
        need: u32,
    },
    /// The message is well-formed but its content breaks a protocol rule.
    #[error("invalid message from client {client}: {reason}")]
    InvalidMessage {
        /// The sender (the server is reported as client 0).
        client: ClientId,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The shares of a client's secret do not reconstruct the value it
    /// committed to, and too few of them agree to correct the wrong ones
    /// (or the client dealt shares of another value): the round ends
    /// without unmasking anything.
    #[error("the {shares} shares of client {owner}'s secret do not reconstruct the value it committed to")]
    UnverifiableSecret {
        /// Whose secret it is.
        owner: ClientId,
        /// Shares that were revealed for it.
        shares: u32,
    },
    /// The server's survivor list or signatures are inconsistent with what
    /// this client saw; an honest client aborts rather than reveal anything.
    #[error("the server's view of the round is inconsistent: {0}")]
    Inconsistent(&'static str),
    /// The local input does not match the round parameters.
    #[error("input has length {got}, the round expects {expected}")]
    InputLength {
        /// The round's vector length.
        expected: u32,
        /// The input's length.
        got: u32,
    },
    /// The round already finished or was abandoned.
    #[error("the round is over")]
    Finished,
    /// Masked inputs are still arriving in pieces: each must be finished
    /// or retracted before the stage closes (see
    /// [`crate::ServerRound::begin_input`]).
    #[error("{0} masked inputs are still arriving")]
    InputsArriving(u32),
    /// A masked input that broke off could not be taken back out of the
    /// running sum (its bytes could not be read back): the round ends
    /// without unmasking anything.
    #[error("a masked input that broke off could not be taken back out of the sum")]
    SumDamaged,
    /// A client could not prove its input within the round's norm bound
    /// (its own input: the update was not clipped as the round asks).
    #[error(transparent)]
    Validation(#[from] crate::validation::ValidationError),
    /// The unmasked sum of a validated round does not open the sum of the
    /// contributors' commitments: one of them masked another vector than
    /// the one it committed to and proved. The sum is withheld; every
    /// contributor is a suspect.
    #[error("the unmasked sum does not match the contributors' commitments")]
    CommitmentMismatch {
        /// The clients whose inputs were in the sum, ascending.
        suspects: Vec<ClientId>,
    },
}

/// Why an update could not be quantized or a sum decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// The update contains NaN or an infinity.
    #[error("update contains a non-finite value at coordinate {0}")]
    NonFinite(usize),
    /// The example count exceeds the round's `max_weight`.
    #[error("example count {got} exceeds the round's maximum of {max}")]
    WeightTooLarge {
        /// The round's maximum.
        max: u32,
        /// The reported count.
        got: u32,
    },
    /// The vector has the wrong length.
    #[error("expected {expected} coordinates, got {got}")]
    Length {
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// More summands than the headroom was sized for, or none.
    #[error("cannot decode a sum of {summands} inputs (headroom is for 1..={max})")]
    Summands {
        /// Inputs in the sum.
        summands: u32,
        /// The headroom.
        max: u32,
    },
    /// The summed example count is zero: there is nothing to average.
    #[error("the aggregate carries no examples")]
    NoExamples,
    /// A noisy sum of fewer inputs than the noise was split into: it
    /// carries less noise than the round promised, so it is not decoded.
    #[error("a sum of {summands} inputs carries less than the full noise of {shares} shares")]
    TooLittleNoise {
        /// Inputs in the sum.
        summands: u32,
        /// The shares the noise was split into.
        shares: u32,
    },
    /// Conditional randomized rounding kept overshooting the sensitivity
    /// bound (it succeeds with probability above 0.39 per try).
    #[error("randomized rounding did not meet the sensitivity bound")]
    Rounding,
    /// A metric's value is out of its range.
    #[error("metric {metric} {reason}")]
    Metric {
        /// The metric's name.
        metric: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
}
