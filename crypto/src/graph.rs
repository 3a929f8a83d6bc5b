//! Communication graphs: who shares secrets and masks with whom.
//!
//! * [`GraphSpec::Complete`]: every client is every other client's neighbour
//!   (SecAgg, Bonawitz et al. 2017).
//! * [`GraphSpec::Harary`]: a random k-regular graph (SecAgg+, Bell et al.
//!   2020): the Harary graph H(k, n), which joins each position to the k/2
//!   positions on either side of it on a ring, with clients placed on the ring
//!   by a random permutation.
//!
//! The permutation is not the coordinator's to choose: its seed is derived
//! from the round context (see [`crate::RoundConfig::placement_seed`]), so
//! every client computes the same placement from the parameters it already
//! checks, and a coordinator that wants another placement must announce
//! another round (another roster, round number or parameter set), which the
//! clients see. Trying many placements until a target client lands among
//! clients the coordinator controls therefore costs one whole round
//! composition per try, instead of one free 32-byte seed per try.

use rand_chacha::ChaCha20Rng;
use rand_core::{Rng, SeedableRng};

use crate::ids::ClientId;

/// The public description of a round's communication graph.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphSpec {
    /// Everybody is everybody's neighbour.
    Complete,
    /// A random k-regular Harary graph; `degree` is even. The placement on
    /// the ring follows from the round context.
    Harary {
        /// Neighbours per client (k).
        degree: u32,
    },
}

/// The materialised graph of one round.
#[derive(Debug, Clone)]
pub struct CommunicationGraph {
    clients: u32,
    layout: Layout,
}

#[derive(Debug, Clone)]
enum Layout {
    Complete,
    Harary {
        half_degree: u32,
        /// `position[i]`: ring position of the client with index i.
        position: Vec<u32>,
        /// `occupant[p]`: index of the client at ring position p.
        occupant: Vec<u32>,
    },
}

impl CommunicationGraph {
    /// Builds the graph for `clients` clients, placing them on the ring
    /// with the permutation drawn from `placement_seed`. The spec must have
    /// been validated (see [`crate::RoundConfig::validate`]); rounds build
    /// their graph with [`crate::RoundConfig::communication_graph`].
    pub fn new(clients: u32, spec: &GraphSpec, placement_seed: &[u8; 32]) -> Self {
        let layout = match spec {
            GraphSpec::Harary { degree } if *degree < clients - 1 => {
                let occupant = ring_placement(clients, placement_seed);
                let mut position = vec![0; clients as usize];
                for (p, &client) in occupant.iter().enumerate() {
                    position[client as usize] = p as u32;
                }
                Layout::Harary { half_degree: degree / 2, position, occupant }
            }
            // A Harary graph of degree n − 1 is the complete graph.
            _ => Layout::Complete,
        };
        Self { clients, layout }
    }

    /// Number of clients.
    pub fn clients(&self) -> u32 {
        self.clients
    }

    /// Neighbours per client.
    pub fn degree(&self) -> u32 {
        match &self.layout {
            Layout::Complete => self.clients - 1,
            Layout::Harary { half_degree, .. } => 2 * half_degree,
        }
    }

    /// A Harary graph's placement, `(occupant, position)` (none for the
    /// complete graph): the client index at each ring position, and each
    /// client's position.
    pub(crate) fn placement(&self) -> Option<(&[u32], &[u32], u32)> {
        match &self.layout {
            Layout::Complete => None,
            Layout::Harary { half_degree, position, occupant } => Some((occupant, position, *half_degree)),
        }
    }

    /// Whether `a` and `b` are distinct neighbours.
    pub fn are_neighbours(&self, a: ClientId, b: ClientId) -> bool {
        if a == b || a.get() > self.clients || b.get() > self.clients {
            return false;
        }
        match &self.layout {
            Layout::Complete => true,
            Layout::Harary { half_degree, position, .. } => {
                let pa = position[a.index()];
                let pb = position[b.index()];
                let forward = pa.abs_diff(pb);
                forward.min(self.clients - forward) <= *half_degree
            }
        }
    }

    /// The neighbours of `client`, in ascending id order.
    pub fn neighbours(&self, client: ClientId) -> Vec<ClientId> {
        match &self.layout {
            Layout::Complete => {
                (1..=self.clients).filter(|&id| id != client.get()).filter_map(ClientId::new).collect()
            }
            Layout::Harary { half_degree, position, occupant } => {
                let n = self.clients;
                let p = position[client.index()];
                let mut ids: Vec<ClientId> = (1..=*half_degree)
                    .flat_map(|offset| [(p + offset) % n, (p + n - offset) % n])
                    .map(|q| ClientId::from_index(occupant[q as usize] as usize))
                    .collect();
                ids.sort_unstable();
                ids
            }
        }
    }
}

/// A random placement of `clients` clients on a ring, drawn from `seed`
/// (Fisher–Yates with ChaCha20): `occupant[p]` is the index of the client at
/// position p.
pub(crate) fn ring_placement(clients: u32, seed: &[u8; 32]) -> Vec<u32> {
    let mut occupant: Vec<u32> = (0..clients).collect();
    let mut rng = ChaCha20Rng::from_seed(*seed);
    for i in (1..occupant.len()).rev() {
        occupant.swap(i, uniform_below(&mut rng, i as u64 + 1) as usize);
    }
    occupant
}

/// Uniform integer in `[0, bound)` by rejection (no modulo bias).
fn uniform_below(rng: &mut ChaCha20Rng, bound: u64) -> u64 {
    let zone = u64::MAX - (u64::MAX % bound);
    loop {
        let value = rng.next_u64();
        if value < zone {
            return value % bound;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(i: u32) -> ClientId {
        ClientId::new(i).unwrap()
    }

    #[test]
    fn harary_graph_is_regular_and_symmetric() {
        let graph = CommunicationGraph::new(50, &GraphSpec::Harary { degree: 8 }, &[3; 32]);
        assert_eq!(graph.degree(), 8);
        for a in 1..=50 {
            let neighbours = graph.neighbours(id(a));
            assert_eq!(neighbours.len(), 8);
            assert!(!neighbours.contains(&id(a)));
            for b in 1..=50 {
                assert_eq!(graph.are_neighbours(id(a), id(b)), neighbours.contains(&id(b)));
                assert_eq!(graph.are_neighbours(id(a), id(b)), graph.are_neighbours(id(b), id(a)));
            }
        }
    }

    #[test]
    fn seed_changes_the_graph() {
        let a = CommunicationGraph::new(100, &GraphSpec::Harary { degree: 6 }, &[1; 32]);
        let b = CommunicationGraph::new(100, &GraphSpec::Harary { degree: 6 }, &[2; 32]);
        assert!((1..=100).any(|i| a.neighbours(id(i)) != b.neighbours(id(i))));
    }

    #[test]
    fn complete_graph_links_everybody() {
        let graph = CommunicationGraph::new(5, &GraphSpec::Complete, &[0; 32]);
        assert_eq!(graph.neighbours(id(3)), vec![id(1), id(2), id(4), id(5)]);
        assert!(!graph.are_neighbours(id(3), id(3)));
        assert!(!graph.are_neighbours(id(3), id(6)));
    }
}
