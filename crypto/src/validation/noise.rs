//! The noise of a private, validated round, bound as tightly as the input.
//!
//! Under differential privacy every client adds integer noise of variance
//! σ² = (z·Δ₂)²/m to its vector before masking (see [`crate::dp`]). A norm
//! proof over the noisy vector would have to allow the noise's norm, about
//! σ·√d, which for any useful model dwarfs the clip: a client could put
//! anything of that norm into the sum. Here the client proves the norm of
//! its vector *before* the noise (‖x‖₂ ≤ Δ₂, [`super::NormBound`]), and its
//! noise is not its own to choose.
//!
//! ## Noise edges
//! Each client u has [`NOISE_VERIFIERS`] verifiers among its neighbours
//! ([`NoiseVerifiers::of`]: on the complete graph the next three clients on
//! a ring placed by the round context; on a Harary graph the three
//! neighbours w with the least SHA-256(context, u, w)). Nobody chooses
//! them: they follow from the round context like the graph itself. For each
//! verifier j, u and j derive the same edge seed from their one key
//! agreement on the cipher keys ([`crate::derive`]: HKDF with the round
//! context and both ids, directional), and from it ([`EdgeNoise::derive`]):
//! the edge's noise, independent Skellam variates of variance σ²/E for
//! every coordinate, drawn by a sampler that gives the same values on every
//! platform (`crate::dp`), and the blindings of the noise's row commitments.
//!
//! With its shares (stage 2), j sends the row commitments of the noise of
//! every neighbour it verifies ([`EdgeNoise::commit`]): the attestation.
//! When u masks (stage 3) it knows which of its verifiers completed stage 2
//! (their envelopes reached it); it adds the noise of the first
//! [`NOISE_EDGES`] = E of them, in their rank order, and adds those edges'
//! blindings to its own input's, which ride in its masked vector as
//! before. The coordinator takes the same E edges from the same list, and
//! the sum check ([`super::check_sum`]) asks the unmasked sum to open the
//! survivors' input commitments plus their edges' attestations. A client
//! with fewer than E verifiers left cannot mask and leaves the round (it is
//! a dropout); one verifier may drop out without costing its clients.
//!
//! ## What it guarantees
//! * *Influence.* The proven part of a client's input has norm at most Δ₂,
//!   the sensitivity an honest client's own clip gives; its noise is the
//!   verifiers' draw, of the mechanism's distribution, fixed by key
//!   agreements the client cannot steer (the keys are fresh each round and
//!   the coordinator relays them only once all are in). A client that adds
//!   anything else makes its group's sum check fail (claim 64) and is found
//!   as every cheater is (claim 68). So a client's influence on a private
//!   round is at most Δ₂, as an honest client's, unless one of its E
//!   verifiers colludes with it: two colluding neighbours can agree on any
//!   noise for an edge between them. With verifiers placed at random by the
//!   round context, a client is paired with a colluder on a given edge with
//!   probability about c/n for c colluders among n clients.
//! * *A lying verifier* (an attestation that does not commit to the edge's
//!   noise) fails its group's sum check like a cheating client, and is
//!   found the same way: it is a member of that group.
//! * *Privacy.* A verifier learns the noise of the edges it verifies, σ²/E
//!   of its client's variance each. A coordinator that colludes with c
//!   clients learns their own noise and that of the edges they verify: in
//!   the worst case 2c clients' worth of noise, where a round without
//!   validation loses c. The guarantee holds at noise multiplier
//!   z·√((t + 1 − 2c)/t) for such a coalition (`docs/THREAT_MODEL.md`).
//!   The coordinator itself learns only commitments, which hide perfectly.
//! * *Exactly the mechanism.* The sum of E Skellam variates of variance
//!   σ²/E is Skellam of variance σ²: each client's noise, and so every sum,
//!   has the distribution the accountant assumes. The discrete Gaussian's
//!   shares do not add up to a discrete Gaussian, so a validated round asks
//!   for Skellam.

use curve25519_dalek::scalar::Scalar;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use zeroize::Zeroizing;

use super::group::random_scalar;
use super::{Commitment, NormBound, ValidationError};
use crate::config::{RoundConfig, RoundContext};
use crate::graph::{CommunicationGraph, GraphSpec, ring_placement};
use crate::ids::ClientId;
use crate::kdf::hkdf_sha256;
use crate::secret::Secret32;

/// Verifiers each client has.
pub const NOISE_VERIFIERS: usize = 3;
/// Noise edges a client adds: the first this many of its verifiers that
/// completed the round's second stage.
pub const NOISE_EDGES: usize = 2;

const LABEL_RING: &[u8] = b"cohort/validation/v1/noise-ring";
const LABEL_RANK: &[u8] = b"cohort/validation/v1/noise-rank";
const LABEL_VALUES: &[u8] = b"cohort/validation/v1/noise-values";
const LABEL_BLINDINGS: &[u8] = b"cohort/validation/v1/noise-blindings";

/// Who verifies whose noise in one round.
#[derive(Debug, Clone)]
pub struct NoiseVerifiers {
    context: RoundContext,
    graph: CommunicationGraph,
    /// The complete graph's ring: `occupant[p]` is the index of the client
    /// at position p, `position[i]` that of client index i.
    ring: Option<(Vec<u32>, Vec<u32>)>,
    /// Every client's verifiers, once [`tabulated`](Self::tabulated).
    table: Option<Vec<Vec<ClientId>>>,
}

impl NoiseVerifiers {
    /// The verifiers of `config`'s round. Refuses a graph in which a
    /// client has fewer than [`NOISE_VERIFIERS`] neighbours.
    pub fn new(config: &RoundConfig) -> Result<Self, ValidationError> {
        let graph = config.communication_graph();
        if (graph.degree() as usize) < NOISE_VERIFIERS {
            return Err(ValidationError::Parameters(
                "a private, validated round needs at least three neighbours per client",
            ));
        }
        let context = config.context();
        let ring = match config.graph {
            GraphSpec::Harary { degree } if degree < config.clients - 1 => None,
            _ => {
                let mut seed = [0u8; 32];
                hkdf_sha256(&context.0, &[], &[LABEL_RING], &mut seed);
                let occupant = ring_placement(config.clients, &seed);
                let mut position = vec![0u32; occupant.len()];
                for (p, &client) in occupant.iter().enumerate() {
                    position[client as usize] = p as u32;
                }
                Some((occupant, position))
            }
        };
        Ok(Self { context, graph, ring, table: None })
    }

    /// The same, with every client's verifiers computed once (the
    /// coordinator asks for all of them).
    pub fn tabulated(mut self) -> Self {
        let table = (0..self.graph.clients()).map(|i| self.of(ClientId::from_index(i as usize))).collect();
        self.table = Some(table);
        self
    }

    /// `owner`'s verifiers in rank order (the order in which its edges are
    /// taken).
    pub fn of(&self, owner: ClientId) -> Vec<ClientId> {
        if let Some(table) = &self.table {
            return table[owner.index()].clone();
        }
        match &self.ring {
            Some((occupant, position)) => {
                let n = occupant.len() as u32;
                let p = position[owner.index()];
                (1..=NOISE_VERIFIERS as u32)
                    .map(|step| ClientId::from_index(occupant[((p + step) % n) as usize] as usize))
                    .collect()
            }
            None => {
                let mut ranked: Vec<([u8; 32], ClientId)> = self
                    .graph
                    .neighbours(owner)
                    .into_iter()
                    .map(|w| {
                        let mut input = Vec::with_capacity(LABEL_RANK.len() + 40);
                        input.extend_from_slice(LABEL_RANK);
                        input.extend_from_slice(&self.context.0);
                        input.extend_from_slice(&owner.get().to_be_bytes());
                        input.extend_from_slice(&w.get().to_be_bytes());
                        let digest = ring::digest::digest(&ring::digest::SHA256, &input);
                        let mut key = [0u8; 32];
                        key.copy_from_slice(digest.as_ref());
                        (key, w)
                    })
                    .collect();
                ranked.sort_unstable();
                ranked.into_iter().take(NOISE_VERIFIERS).map(|(_, w)| w).collect()
            }
        }
    }

    /// The edges `owner` adds: the first [`NOISE_EDGES`] of its verifiers
    /// for which `completed` holds, or `None` when fewer did.
    pub fn edges(&self, owner: ClientId, completed: impl Fn(ClientId) -> bool) -> Option<Vec<ClientId>> {
        let edges: Vec<ClientId> =
            self.of(owner).into_iter().filter(|&j| completed(j)).take(NOISE_EDGES).collect();
        (edges.len() == NOISE_EDGES).then_some(edges)
    }
}

/// One edge's noise and the blindings of its row commitments (secret to the
/// client that adds it and the one that verifies it).
pub struct EdgeNoise {
    values: Zeroizing<Vec<i64>>,
    blindings: Zeroizing<Vec<Scalar>>,
}

impl EdgeNoise {
    /// The noise of variance `variance` per coordinate for `bound`'s
    /// dimension, and its blindings, from the edge's seed.
    pub(crate) fn derive(seed: &Secret32, bound: &NormBound, variance: f64) -> Self {
        let stream = |label: &[u8]| {
            let mut key = [0u8; 32];
            hkdf_sha256(&[], seed.expose(), &[label], &mut key);
            let rng = ChaCha20Rng::from_seed(key);
            zeroize::Zeroize::zeroize(&mut key);
            rng
        };
        let mut values = Zeroizing::new(vec![0i64; bound.dimension()]);
        crate::dp::add_skellam_portable(&mut values, variance, &mut stream(LABEL_VALUES));
        let mut rng = stream(LABEL_BLINDINGS);
        let blindings = Zeroizing::new((0..bound.input_rows()).map(|_| random_scalar(&mut rng)).collect());
        Self { values, blindings }
    }

    /// The noise, one value per coordinate.
    pub fn values(&self) -> &[i64] {
        &self.values
    }

    /// The blindings of the noise's row commitments.
    pub fn blindings(&self) -> &[Scalar] {
        &self.blindings
    }

    /// The row commitments of the noise: a verifier's attestation.
    pub fn commit(&self, bound: &NormBound) -> Result<Commitment, ValidationError> {
        super::proof::commit(bound, &self.values, &self.blindings)
    }
}
