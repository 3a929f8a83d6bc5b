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
//! ([`NoiseVerifiers::of`]): the clients at the next three positions of
//! the round's placement ring (on a Harary graph the graph's own ring, the
//! next two and the previous one at degree 4; on the complete graph a ring
//! drawn from the round context), so every client verifies exactly three
//! others. For each verifier j, u and j derive the same edge seed from
//! their one key agreement on the cipher keys (`derive::noise_edge_seed`: HKDF
//! with the round context and both ids, directional), and from it
//! (`EdgeNoise::derive`): the edge's noise, independent Skellam variates
//! of variance σ²/E for every coordinate, drawn by a sampler that gives
//! the same values on every platform (`crate::dp`), and the blindings of
//! the noise's row commitments.
//!
//! With its shares (stage 2) every client sends, for each edge it is an end
//! of, its commitment to the edge's noise ([`EdgeNoise::commit`]): the row
//! commitments for the edges of the three clients it verifies (the sum
//! check adds them up), and a digest of them ([`commitment_digest`]) for
//! its own edges to the verifiers that advertised keys. The coordinator
//! refuses a message whose list is not exactly those edges, and when the
//! stage closes compares the two ends' digests of each edge: they are the
//! same when both ends are honest. Where they differ one end lies, and both are taken out of the
//! round as a client with a refused proof is (named in the round's
//! `refused`). When u masks (stage 3) it knows which of its verifiers
//! completed stage 2 (their envelopes reached it); it adds the noise of the
//! first [`NOISE_EDGES`] = E of them, in rank order, and adds those edges'
//! blindings to its own input's, which ride in its masked vector as
//! before. The coordinator takes the same E edges from the same list, and
//! the sum check ([`super::check_sum`]) asks the unmasked sum to open the
//! survivors' input commitments plus their edges' commitments. A client
//! with fewer than E verifiers left cannot mask and leaves the round (it is
//! a dropout, and the coordinator refuses a masked input from it); one
//! verifier may drop out without costing its clients.
//!
//! ## What it guarantees
//! * *Influence.* The proven part of a client's input has norm at most Δ₂,
//!   the sensitivity an honest client's own clip gives; its noise is the
//!   edges', of the mechanism's distribution, fixed by key agreements the
//!   client cannot steer (the keys are fresh each round and the coordinator
//!   relays them only once all are in). Neither end of an edge can shift
//!   its noise alone: the other end's commitment would differ. A client
//!   that adds anything else makes its group's sum check fail (claim 64)
//!   and is found as every cheater is (claim 68). So a client's influence
//!   on a private round is at most Δ₂, as an honest client's, unless one of
//!   its counted verifiers colludes with it: two colluding ends can agree
//!   on any noise for their edge. A client also knows its edges' noise
//!   before it commits, and may drop out when it dislikes it: that steers
//!   its contribution by about one noise standard deviation in a chosen
//!   direction, (z·Δ₂)/√t per coordinate, small beside the sum's noise.
//! * *Disputes.* A client that lies about an edge takes itself and the
//!   other end out of the round: it costs that neighbour one round's
//!   contribution, never the sum. The coordinator takes the dispute as a
//!   failed test of the two (the cheater search of claim 68), so a client
//!   that keeps lying is narrowed down beside cleared partners and
//!   excluded.
//! * *Privacy.* A verifier learns the noise of the edges it verifies, σ²/E
//!   of its client's variance each. A coordinator that colludes with c
//!   clients learns their own noise and that of up to three edges each
//!   (the third counts when one of the first two drops out, which a
//!   coordinator can arrange by withholding): in the worst case 2.5·c
//!   clients' worth of noise, where a round without validation loses c.
//!   The guarantee holds at noise multiplier z·√((t + 1 − 2.5c)/t) for
//!   such a coalition (`docs/THREAT_MODEL.md`). The coordinator itself
//!   sees commitments whose blindings come from the edge seed: they hide
//!   the noise computationally (as the masks do), not perfectly. The
//!   placement follows from the round context, which the coordinator
//!   composes: like the graph's (claim 33), it can try many rounds to seat
//!   its own clients as a target's verifiers, one whole round per try.
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
use crate::config::RoundConfig;
use crate::graph::ring_placement;
use crate::ids::ClientId;
use crate::kdf::hkdf_sha256;
use crate::secret::Secret32;

/// Verifiers each client has.
pub const NOISE_VERIFIERS: usize = 3;
/// Noise edges a client adds: the first this many of its verifiers that
/// completed the round's second stage.
pub const NOISE_EDGES: usize = 2;

const LABEL_RING: &[u8] = b"cohort/validation/v1/noise-ring";
const LABEL_VALUES: &[u8] = b"cohort/validation/v1/noise-values";
const LABEL_BLINDINGS: &[u8] = b"cohort/validation/v1/noise-blindings";
const LABEL_DIGEST: &[u8] = b"cohort/validation/v1/noise-commitment-digest";

/// Who verifies whose noise in one round.
#[derive(Debug, Clone)]
pub struct NoiseVerifiers {
    /// The ring the verifiers follow on: `occupant[p]` is the index of the
    /// client at position p, `position[i]` that of client index i.
    occupant: Vec<u32>,
    position: Vec<u32>,
    /// The ring offsets of a client's verifiers, in rank order.
    offsets: [i64; NOISE_VERIFIERS],
}

impl NoiseVerifiers {
    /// The verifiers of `config`'s round: on a Harary graph the clients at
    /// the next three positions of its placement ring (the next two and
    /// the previous one at degree 4), all neighbours; on the complete graph
    /// the same on a ring drawn from the round context. Every client then
    /// verifies exactly three others. Refuses a graph with fewer than
    /// [`NOISE_VERIFIERS`] neighbours per client.
    pub fn new(config: &RoundConfig) -> Result<Self, ValidationError> {
        let graph = config.communication_graph();
        if (graph.degree() as usize) < NOISE_VERIFIERS {
            return Err(ValidationError::Parameters(
                "a private, validated round needs at least three neighbours per client",
            ));
        }
        let (occupant, position, offsets) = match graph.placement() {
            Some((occupant, position, half_degree)) => {
                let offsets = if half_degree >= 3 { [1, 2, 3] } else { [1, 2, -1] };
                (occupant.to_vec(), position.to_vec(), offsets)
            }
            None => {
                let mut seed = [0u8; 32];
                hkdf_sha256(&config.context().0, &[], &[LABEL_RING], &mut seed);
                let occupant = ring_placement(config.clients, &seed);
                let mut position = vec![0u32; occupant.len()];
                for (p, &client) in occupant.iter().enumerate() {
                    position[client as usize] = p as u32;
                }
                (occupant, position, [1, 2, 3])
            }
        };
        Ok(Self { occupant, position, offsets })
    }

    /// `owner`'s verifiers in rank order (the order in which its edges are
    /// taken).
    pub fn of(&self, owner: ClientId) -> Vec<ClientId> {
        let n = self.occupant.len() as i64;
        let p = i64::from(self.position[owner.index()]);
        self.offsets
            .iter()
            .map(|offset| ClientId::from_index(self.occupant[(p + offset).rem_euclid(n) as usize] as usize))
            .collect()
    }

    /// The clients `verifier` verifies (the owners of its edges).
    pub fn verified_by(&self, verifier: ClientId) -> Vec<ClientId> {
        let n = self.occupant.len() as i64;
        let p = i64::from(self.position[verifier.index()]);
        self.offsets
            .iter()
            .map(|offset| ClientId::from_index(self.occupant[(p - offset).rem_euclid(n) as usize] as usize))
            .collect()
    }

    /// The edges `owner` adds: the first [`NOISE_EDGES`] of its verifiers
    /// for which `completed` holds, or `None` when fewer did.
    pub fn edges(&self, owner: ClientId, completed: impl Fn(ClientId) -> bool) -> Option<Vec<ClientId>> {
        let edges: Vec<ClientId> =
            self.of(owner).into_iter().filter(|&j| completed(j)).take(NOISE_EDGES).collect();
        (edges.len() == NOISE_EDGES).then_some(edges)
    }
}

/// The digest an edge's owner sends of its commitment to the edge's noise
/// (SHA-256 of a label and the commitment's bytes): the coordinator
/// compares it with the digest of the verifier's commitment, which it needs
/// whole for the sum check, so the owner's upload carries 32 bytes per edge
/// where the commitment has 32 per row.
pub fn commitment_digest(commitment: &[u8]) -> [u8; 32] {
    let mut context = ring::digest::Context::new(&ring::digest::SHA256);
    context.update(LABEL_DIGEST);
    context.update(commitment);
    let mut digest = [0u8; 32];
    digest.copy_from_slice(context.finish().as_ref());
    digest
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
    pub fn derive(seed: &Secret32, bound: &NormBound, variance: f64) -> Self {
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
