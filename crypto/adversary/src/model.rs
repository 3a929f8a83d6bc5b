//! What honest clients reveal in response to a malicious coordinator's
//! choices, and what the coordinator can reconstruct from it.
//!
//! [`evaluate`] is the rule book of an honest [`cohort_crypto::Client`],
//! written as a function of a [`Strategy`]: the replay test
//! (`tests/replay.rs`) drives the real state machines through strategies and
//! checks that they answer exactly as [`evaluate`] says.

use std::collections::HashMap;

use cohort_crypto::ClientId;
use cohort_crypto::graph::CommunicationGraph;

/// Whose signatures a client counts in the consistency check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignerScope {
    /// Any t survivors of the round: the rule before the neighbourhood
    /// check, sound on the complete graph only. Kept so that the search can
    /// show what it finds against it.
    Round,
    /// t members of the client's own closed neighbourhood (itself and its
    /// neighbours): the rule of [`cohort_crypto::Client`].
    Neighbourhood,
}

/// One round's public structure: its graph, threshold and signature rule.
#[derive(Debug, Clone)]
pub struct Round {
    threshold: u32,
    scope: SignerScope,
    /// Neighbours of each client (by index), ascending.
    neighbours: Vec<Vec<ClientId>>,
    graph: CommunicationGraph,
}

impl Round {
    /// The round on `graph` with threshold `threshold`, whose clients count
    /// signatures by `scope`.
    pub fn new(graph: CommunicationGraph, threshold: u32, scope: SignerScope) -> Self {
        let neighbours = (1..=graph.clients()).map(|i| graph.neighbours(id(i))).collect();
        Self { threshold, scope, neighbours, graph }
    }

    /// Clients in the round (n).
    pub fn clients(&self) -> u32 {
        self.graph.clients()
    }

    /// Neighbours per client (k).
    pub fn degree(&self) -> u32 {
        self.graph.degree()
    }

    /// The threshold (t).
    pub fn threshold(&self) -> u32 {
        self.threshold
    }

    /// The signature rule.
    pub fn scope(&self) -> SignerScope {
        self.scope
    }

    /// The neighbours of `client`, ascending.
    pub fn neighbours(&self, client: ClientId) -> &[ClientId] {
        &self.neighbours[client.index()]
    }

    /// Whether `a` and `b` are distinct neighbours.
    pub fn are_neighbours(&self, a: ClientId, b: ClientId) -> bool {
        self.graph.are_neighbours(a, b)
    }

    /// Whether `client` counts a signature of `signer` over its list.
    pub fn counts_signer(&self, client: ClientId, signer: ClientId) -> bool {
        match self.scope {
            SignerScope::Round => true,
            SignerScope::Neighbourhood => signer == client || self.are_neighbours(client, signer),
        }
    }
}

/// A malicious coordinator's choices in one round. Every client's keys are
/// relayed to all its neighbours: the coordinator gains nothing by
/// withholding a key (a client hands shares of its own secrets to fewer
/// holders, and masks only with neighbours whose envelopes it is handed,
/// which [`envelopes`](Self::envelopes) chooses anyway).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Strategy {
    /// The coordinator's own clients, by index.
    pub corrupt: Vec<bool>,
    /// For each client, the neighbours whose share envelopes it is handed,
    /// ascending: it masks its input with exactly these and holds their
    /// shares.
    pub envelopes: Vec<Vec<ClientId>>,
    /// The survivor lists the coordinator shows, each ascending (two equal
    /// lists are one list: a signature is over the list's content).
    pub lists: Vec<Vec<ClientId>>,
    /// For each client, the index in [`lists`](Self::lists) of the list it
    /// is shown, or `None` where the coordinator treats it as dropped after
    /// its masked input.
    pub shown: Vec<Option<usize>>,
}

impl Strategy {
    /// The list client `u` is shown.
    pub fn list_of(&self, u: ClientId) -> Option<&[ClientId]> {
        self.shown[u.index()].map(|j| self.lists[j].as_slice())
    }
}

/// How an honest client answers a [`Strategy`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    /// One of the coordinator's own clients.
    Corrupt,
    /// Sent no masked input: it was handed fewer than t envelopes.
    NoInput,
    /// Sent its masked input and was shown no survivor list.
    Dropped,
    /// Refused its survivor list (it is missing from it, the list is
    /// shorter than t, or a surviving neighbour never shared with it).
    RefusedList,
    /// Signed its list, but was not handed t signatures it counts over that
    /// same list, and revealed nothing.
    Signed,
    /// Revealed its shares of the self-mask seeds of `seeds` (its own among
    /// them) and of the mask keys of `keys`.
    Revealed {
        /// Owners of the seed shares revealed, ascending.
        seeds: Vec<ClientId>,
        /// Owners of the mask-key shares revealed, ascending.
        keys: Vec<ClientId>,
    },
}

/// What a [`Strategy`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Each client's answer, by index.
    pub responses: Vec<Response>,
    /// Shares of each client's seed the coordinator holds (revealed by
    /// honest clients, dealt to its own).
    pub seed_shares: Vec<u32>,
    /// Shares of each client's mask key the coordinator holds.
    pub key_shares: Vec<u32>,
    /// Honest clients whose masked input the coordinator can unmask alone:
    /// their seed is recoverable and, for every partner they masked with,
    /// their own mask key or the partner's.
    pub exposed: Vec<ClientId>,
}

/// The client with id `i`.
///
/// # Panics
/// On 0.
pub fn id(i: u32) -> ClientId {
    ClientId::new(i).expect("client ids start at 1")
}

/// Whether honest client `u` accepts a list (`on`: its membership): it is
/// on it, the list has t members, and every neighbour on it shared with
/// `u` ([`cohort_crypto::Client`]'s checks on the survivor list).
fn accepts(round: &Round, u: ClientId, envelopes: &[ClientId], on: &[bool], len: usize) -> bool {
    on[u.index()]
        && len >= round.threshold() as usize
        && round.neighbours(u).iter().all(|v| !on[v.index()] || envelopes.binary_search(v).is_ok())
}

/// How every client answers `strategy`, and whose input it exposes.
///
/// # Panics
/// If the strategy does not fit the round (lengths, a list index out of
/// range, or an envelope from a client that is not a neighbour).
pub fn evaluate(round: &Round, strategy: &Strategy) -> Outcome {
    let n = round.clients() as usize;
    let t = round.threshold() as usize;
    assert!(strategy.corrupt.len() == n && strategy.envelopes.len() == n && strategy.shown.len() == n);
    let honest = |u: ClientId| !strategy.corrupt[u.index()];
    let clients = || (1..=n as u32).map(id);
    for u in clients() {
        assert!(strategy.envelopes[u.index()].iter().all(|&v| round.are_neighbours(u, v)));
    }
    // Lists by content: `canonical[j]` is the first index with list j's
    // content, `members[j]` its membership.
    let mut first: HashMap<&[ClientId], usize> = HashMap::new();
    let canonical: Vec<usize> = strategy
        .lists
        .iter()
        .enumerate()
        .map(|(j, list)| *first.entry(list.as_slice()).or_insert(j))
        .collect();
    let members: Vec<Vec<bool>> = strategy
        .lists
        .iter()
        .map(|list| {
            let mut on = vec![false; n];
            list.iter().for_each(|v| on[v.index()] = true);
            on
        })
        .collect();
    // The list each honest client signs (canonical index).
    let signed: Vec<Option<usize>> = clients()
        .map(|u| {
            let envelopes = &strategy.envelopes[u.index()];
            let j = strategy.shown[u.index()]?;
            let accepted = honest(u)
                && envelopes.len() >= t
                && accepts(round, u, envelopes, &members[j], strategy.lists[j].len());
            accepted.then_some(canonical[j])
        })
        .collect();
    // Signatures over list j by the whole round (for SignerScope::Round).
    let mut round_signers = vec![0usize; strategy.lists.len()];
    for (j, list) in strategy.lists.iter().enumerate() {
        if canonical[j] == j {
            round_signers[j] = list.iter().filter(|&&w| !honest(w) || signed[w.index()] == Some(j)).count();
        }
    }
    let responses: Vec<Response> = clients()
        .map(|u| {
            let envelopes = &strategy.envelopes[u.index()];
            if !honest(u) {
                return Response::Corrupt;
            }
            if envelopes.len() < t {
                return Response::NoInput;
            }
            let Some(shown) = strategy.shown[u.index()] else {
                return Response::Dropped;
            };
            let Some(j) = signed[u.index()] else {
                return Response::RefusedList;
            };
            // Every signature it counts over its own list: the coordinator
            // relays all it has, its own clients signing whatever it likes.
            let on = &members[j];
            let signs = |w: &ClientId| on[w.index()] && (!honest(*w) || signed[w.index()] == Some(j));
            let signers = match round.scope() {
                SignerScope::Round => round_signers[j],
                SignerScope::Neighbourhood => {
                    round.neighbours(u).iter().filter(|w| signs(w)).count() + usize::from(signs(&u))
                }
            };
            if signers < t {
                return Response::Signed;
            }
            let (mut seeds, keys): (Vec<ClientId>, Vec<ClientId>) =
                envelopes.iter().partition(|v| members[shown][v.index()]);
            seeds.push(u);
            seeds.sort_unstable();
            Response::Revealed { seeds, keys }
        })
        .collect();
    tally(round, strategy, responses)
}

/// What the coordinator holds once the clients answered `strategy` with
/// `responses` (from [`evaluate`], or read back from real clients), and
/// whose input that exposes.
///
/// # Panics
/// If the lengths do not fit the round.
pub fn tally(round: &Round, strategy: &Strategy, responses: Vec<Response>) -> Outcome {
    let n = round.clients() as usize;
    let t = round.threshold() as usize;
    assert_eq!(responses.len(), n);
    let honest = |u: ClientId| !strategy.corrupt[u.index()];
    let clients = || (1..=n as u32).map(id);
    // Every honest client dealt shares of both its secrets to all its
    // neighbours, the coordinator's own clients among them.
    let mut seed_shares = vec![0u32; n];
    let mut key_shares = vec![0u32; n];
    for v in clients() {
        let corrupt_holders = round.neighbours(v).iter().filter(|w| !honest(**w)).count() as u32;
        seed_shares[v.index()] = corrupt_holders;
        key_shares[v.index()] = corrupt_holders;
    }
    for response in &responses {
        if let Response::Revealed { seeds, keys } = response {
            seeds.iter().for_each(|v| seed_shares[v.index()] += 1);
            keys.iter().for_each(|v| key_shares[v.index()] += 1);
        }
    }
    let exposed = clients()
        .filter(|&x| honest(x) && strategy.envelopes[x.index()].len() >= t)
        .filter(|&x| seed_shares[x.index()] as usize >= t)
        .filter(|&x| {
            strategy.envelopes[x.index()].iter().all(|&p| {
                !honest(p) || key_shares[x.index()] as usize >= t || key_shares[p.index()] as usize >= t
            })
        })
        .collect();
    Outcome { responses, seed_shares, key_shares, exposed }
}
