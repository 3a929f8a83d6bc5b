//! A targeted search for rounds too large for the exact one.
//!
//! A coordinator that wants client x must rebuild b_x, which needs t
//! holders of its shares that see x survive, and for each partner p of x
//! the key s_p (or s_x), which needs t holders of p's shares that see p
//! drop. Every such attack splits the round into clients that see x's
//! partners survive and clients that see them drop. The search starts from
//! the splits that make this easiest: x masks with exactly t partners P
//! (the t farthest from x, the t nearest, or a random t), P and x are shown
//! a list on which they all survived and everybody else one on which they
//! dropped. It then moves single clients between the two lists and swaps
//! partners in and out of P, keeping a change when it does not take the
//! coordinator further from its goal ([`deficit`]), and stops at the first
//! strategy that exposes x or when its budget of evaluations is spent.
//!
//! It proves nothing when it finds nothing: it is a search for attacks,
//! whose value is that it finds the known one (and anything near it) at the
//! parameters deployments run.

use cohort_crypto::ClientId;
use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

use crate::model::{Outcome, Round, Strategy, evaluate, id};

/// What a targeted search found.
#[derive(Debug, Clone)]
pub struct Found {
    /// The strategy that exposes the target.
    pub strategy: Strategy,
    /// Strategies evaluated before it.
    pub evaluations: usize,
}

/// How far a strategy's outcome is from exposing `x`: the shares of b_x
/// still missing, plus for every honest partner the fewer of the shares
/// still missing of s_x and of its own key. Zero exactly when x is exposed
/// (with x's masked input sent).
pub fn deficit(round: &Round, strategy: &Strategy, outcome: &Outcome, x: ClientId) -> u32 {
    let t = round.threshold();
    let missing = |have: u32| t.saturating_sub(have);
    let envelopes = &strategy.envelopes[x.index()];
    let no_input = t.saturating_sub(envelopes.len() as u32);
    let partners: u32 = envelopes
        .iter()
        .filter(|p| !strategy.corrupt[p.index()])
        .map(|p| missing(outcome.key_shares[x.index()]).min(missing(outcome.key_shares[p.index()])))
        .sum();
    no_input + missing(outcome.seed_shares[x.index()]) + partners
}

/// The two-list strategy: the clients `on_x_side` (x and its `partners`
/// among them) see the list of exactly themselves, everybody else the list
/// of everybody but x and its partners.
fn split(
    round: &Round,
    x: ClientId,
    corrupt: &[bool],
    partners: &[ClientId],
    on_x_side: &[bool],
) -> Strategy {
    let n = round.clients();
    let everyone: Vec<ClientId> = (1..=n).map(id).collect();
    let gone = |v: &ClientId| *v == x || partners.binary_search(v).is_ok();
    let without: Vec<ClientId> = everyone.iter().copied().filter(|v| !gone(v)).collect();
    let envelopes = everyone
        .iter()
        .map(|&u| if u == x { partners.to_vec() } else { round.neighbours(u).to_vec() })
        .collect();
    let with: Vec<ClientId> = everyone.iter().copied().filter(|v| on_x_side[v.index()]).collect();
    let shown = everyone.iter().map(|u| Some(usize::from(!on_x_side[u.index()]))).collect();
    Strategy { corrupt: corrupt.to_vec(), envelopes, lists: vec![with, without], shown }
}

/// Searches for a strategy that exposes `target` with the coordinator
/// owning `corrupt`, evaluating at most `budget` strategies per starting
/// point. `seed` fixes the random choices.
pub fn search(round: &Round, target: ClientId, corrupt: &[bool], budget: usize, seed: u64) -> Option<Found> {
    let t = round.threshold() as usize;
    let x = target;
    let neighbours = round.neighbours(x).to_vec();
    // Partners ordered from farthest (fewest shared neighbours) to nearest.
    let mut by_distance = neighbours.clone();
    let shared = |p: &ClientId| round.neighbours(*p).iter().filter(|v| round.are_neighbours(x, **v)).count();
    by_distance.sort_by_key(|p| (shared(p), *p));
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut shuffled = neighbours.clone();
    for i in (1..shuffled.len()).rev() {
        shuffled.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let starts =
        [by_distance[..t].to_vec(), by_distance[by_distance.len() - t..].to_vec(), shuffled[..t].to_vec()];
    let n = round.clients() as usize;
    let mut evaluations = 0;
    for start in starts {
        let mut partners = start;
        partners.sort_unstable();
        let mut side: Vec<bool> =
            (0..n).map(|i| i == x.index() || partners.contains(&ClientId::from_index(i))).collect();
        let mut strategy = split(round, x, corrupt, &partners, &side);
        let mut outcome = evaluate(round, &strategy);
        evaluations += 1;
        let mut score = deficit(round, &strategy, &outcome, x);
        for _ in 0..budget {
            if outcome.exposed.contains(&x) {
                return Some(Found { strategy, evaluations });
            }
            let (mut next_partners, mut next_side) = (partners.clone(), side.clone());
            if rng.next_u64() % 4 == 0 {
                // Swap one partner for another neighbour of x.
                let out = (rng.next_u64() % next_partners.len() as u64) as usize;
                let candidate = neighbours[(rng.next_u64() % neighbours.len() as u64) as usize];
                if next_partners.contains(&candidate) {
                    continue;
                }
                next_side[next_partners[out].index()] = false;
                next_partners[out] = candidate;
                next_partners.sort_unstable();
                next_side[candidate.index()] = true;
            } else {
                let moved = (rng.next_u64() % n as u64) as usize;
                if moved == x.index() {
                    continue;
                }
                next_side[moved] = !next_side[moved];
            }
            let candidate = split(round, x, corrupt, &next_partners, &next_side);
            let candidate_outcome = evaluate(round, &candidate);
            evaluations += 1;
            let candidate_score = deficit(round, &candidate, &candidate_outcome, x);
            if candidate_score <= score {
                (partners, side, strategy, outcome, score) =
                    (next_partners, next_side, candidate, candidate_outcome, candidate_score);
            }
        }
        if outcome.exposed.contains(&x) {
            return Some(Found { strategy, evaluations });
        }
    }
    None
}
