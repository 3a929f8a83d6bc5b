//! # cohort-crypto: the secure-aggregation core of Cohort
//!
//! A sans-IO implementation of pairwise-masking secure aggregation
//! (Bonawitz et al., *Practical Secure Aggregation for Privacy-Preserving
//! Machine Learning*, CCS 2017) with the sparse communication graphs of
//! SecAgg+ (Bell et al., *Secure Single-Server Aggregation with
//! (Poly)Logarithmic Overhead*, CCS 2020). No async, no clock, no sockets,
//! no files: the [`client`] and [`server`] state machines take messages in and
//! hand messages out, so the same code runs natively, in the browser
//! (`wasm32-unknown-unknown`) and on Android, and the privacy guarantee can be
//! tested without a network.
//!
//! ## The protocol
//! n clients with ids `1..=n`, each holding a vector x_u in Z_{2^b}; a
//! communication graph (complete, or random k-regular, see [`graph`], placed
//! by a seed derived from the round context, not chosen by the server) and a
//! threshold t.
//!
//! 1. **AdvertiseKeys.** Each client draws two X25519 key pairs, (c_sk, c_pk)
//!    for share envelopes and (s_sk, s_pk) for masks, and a self-mask seed
//!    b_u, and sends the public halves with a commitment to b_u (signed with
//!    its identity key in the [`Variant::Active`] variant). The server
//!    relays to each client its neighbours' keys (U1).
//! 2. **ShareKeys.** Each client splits b_u and
//!    s_sk_u t-of-k among its neighbours ([`shamir`]), and seals each
//!    neighbour's pair of shares with AES-256-GCM under a key derived from
//!    X25519(c_sk_u, c_pk_v) ([`envelope`]). The server only relays sealed
//!    envelopes (U2).
//! 3. **MaskedInputCollection.** Each client sends
//!    y_u = x_u + PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv) mod 2^b,
//!    summing over its neighbours in U2, where s_uv comes from
//!    X25519(s_sk_u, s_pk_v) ([`prg`]). The server adds the y_u as they arrive
//!    and keeps only the sum (U3).
//! 4. **ConsistencyCheck** (active variant). Each survivor signs the list U3
//!    (with its own id); the server relays each client t signatures of its
//!    own closed neighbourhood (itself and its neighbours), and a client goes
//!    on only if t of them signed the same list it saw. (Signers anywhere in
//!    the round are not enough on a sparse graph: see the adversary search,
//!    `crypto/adversary`.)
//! 5. **Unmasking.** For each neighbour, a client reveals the share of b_v if
//!    v is in U3 and the share of s_sk_v otherwise, never both. The server
//!    reconstructs, checks each b_v against its commitment and each s_sk_v
//!    against s_pk_v (correcting wrong shares and naming their senders when
//!    enough agree, see [`shamir::Reconstructor::reconstruct_checked`]),
//!    removes the self masks of the survivors and the pairwise masks of the
//!    dropped clients, and obtains Σ_{u∈U3} x_u.
//!
//! Every key is derived with HKDF-SHA256 under a distinct label, with the
//! [`RoundContext`] (a hash of all public round parameters) as salt, so
//! messages, keys and masks never carry over between rounds, pairs or
//! purposes.
//!
//! ## Invariants (each enforced in code and tested)
//! * The server never holds an individual input: it keeps only the running
//!   sum of masked inputs, and refuses to unmask with fewer than t survivors
//!   ([`ProtocolError::BelowThreshold`]); clients refuse too.
//! * An honest client never reveals both shares of the same neighbour.
//! * Duplicate, replayed (another round's context) and out-of-phase messages
//!   are refused with a typed [`ProtocolError`] and change nothing.
//! * Dropouts after AdvertiseKeys, after ShareKeys, after the masked input and
//!   during unmasking are tolerated as long as every affected secret still
//!   has t shareholders among the clients that answer.
//! * No secret the server reconstructs is used unless it matches what its
//!   owner committed to, so wrong shares cannot silently corrupt the sum.
//!
//! ## Choosing k and t
//! [`params`] derives the graph degree and the threshold from the number of
//! clients, the tolerated dropout and corruption rates, and the adversary;
//! its module documentation gives the model and how it compares with the
//! published SecAgg+ parameter table.
//!
//! ## Quantization
//! [`quantize`] clips, scales by the client's example count, and rounds
//! stochastically into Z_{2^b} with headroom for n summands; the example
//! count rides along as the last coordinate, so the server computes a
//! weighted mean without learning any single count.
//!
//! ## Secrets
//! Secret material ([`Secret32`], [`shamir::Share`], key schedules,
//! plaintext envelopes, inputs) is zeroized on drop, implements neither
//! `Debug` nor `Clone`, and compares in constant time.

#![cfg_attr(not(test), warn(missing_docs))]

pub mod agreement;
pub mod client;
pub mod compress;
pub mod config;
mod derive;
pub mod dp;
pub mod envelope;
pub mod error;
pub mod graph;
mod ids;
pub mod kdf;
pub mod limits;
mod masking;
pub mod messages;
pub mod metrics;
pub mod params;
pub mod policy;
pub mod prg;
pub mod quantize;
pub mod secret;
pub mod server;
pub mod shamir;
pub mod signature;
pub mod simulation;
#[cfg(feature = "test-support")]
pub mod testing;
#[cfg(test)]
mod uniformity_tests;
mod unmask;
pub mod validation;
pub mod wire;

pub use client::Client;
pub use config::{RoundConfig, RoundContext, Variant};
pub use error::{ConfigError, CryptoError, ProtocolError, Stage};
pub use graph::GraphSpec;
pub use ids::ClientId;
pub use messages::{ClientMessage, NoiseAttestation, ServerMessage};
pub use metrics::{Metric, MetricSet, MetricSums, MetricValues};
pub use quantize::{QuantizationSpec, QuantizedInput, Quantizer, SumSpread, Transform};
pub use secret::Secret32;
pub use server::{Advanced, Aggregate, FaultyShare, IncomingInput, ServerRound};
pub use wire::DecodeError;
