//! # cohort-adversary: a malicious coordinator's choices, searched
//!
//! Cohort's privacy claim against a coordinator that does not follow the
//! protocol (the active variant, `cohort_crypto::Variant::Active`) is that it
//! never learns one honest client's input. This crate checks the claim by
//! program instead of in prose: it searches everything such a coordinator
//! chooses in a round for a way to expose a target client, given the rules
//! an honest client follows.
//!
//! ## The model
//! A round has n clients on a communication graph with degree k (complete,
//! or the SecAgg+ Harary graph, built by `cohort_crypto`'s own
//! [`CommunicationGraph`](cohort_crypto::graph::CommunicationGraph)) and
//! threshold t. Every honest client u Shamir-shares its self-mask seed b_u
//! among its neighbours and itself, and its mask key s_u among its
//! neighbours, t of them needed to reconstruct either.
//!
//! The coordinator chooses ([`Strategy`]):
//! * which clients are its own (a fixed set, any set up to a size, or any
//!   set with at most so many in every closed neighbourhood:
//!   [`Corruption`]);
//! * which neighbours' share envelopes each client is handed: a client masks
//!   its input with exactly those neighbours and holds exactly their shares;
//! * which survivor list each client is shown, if any (every client may be
//!   shown a different one), which stands for which clients "dropped";
//! * which signatures each client is relayed: the search assumes the most
//!   it can, every signature over that client's list by an honest client
//!   that was shown the same list, and by any of its own clients on it.
//!
//! An honest client ([`model::evaluate`], kept in step with
//! `cohort_crypto::Client` by `tests/search.rs`'s
//! `the_model_answers_as_the_real_clients_do`, which plays strategies
//! against the real state machines through [`replay`]) sends
//! its masked input only with t envelopes; signs its list only if it is on
//! it, the list has t members and every neighbour on it shared with it;
//! and reveals only with t signatures it counts over that same list
//! ([`SignerScope`]): then the share of b_v for each partner v on its list
//! (and its own), the share of s_v for each partner v not on it.
//!
//! The coordinator exposes client x if it can rebuild b_x (t shares: those
//! revealed plus those dealt to its own clients) and, for every partner p
//! that x masked with, s_x or s_p (or p is its own). Then every mask on
//! x's masked input can be removed, and x's update, example count and
//! metrics are the coordinator's.
//!
//! ## Why the rule suffices
//! Let the coordinator own c clients in the closed neighbourhood (a client
//! and its neighbours) of x and of each of x's neighbours, with
//! 2t > k + 1 + c, and suppose it exposes honest x.
//! 1. x sent its masked input, so it masked with a set E of at least t
//!    partners; at most k + 1 − t of x's k + 1 share holders are outside E.
//! 2. b_x came back: t shares, at most c from its own clients, so at least
//!    t − c from honest holders that saw x survive. Fewer than that are
//!    outside E (k + 1 − t < t − c), so some honest partner p ∈ E revealed
//!    its share of b_x: p saw a list L with p on it, and t members of p's
//!    own closed neighbourhood had signed L.
//! 3. An honest client signs one list. At least t − c honest members of
//!    p's neighbourhood signed L, on which p survived; at most
//!    (k + 1 − c) − (t − c) = k + 1 − t honest ones are left to see p drop
//!    and reveal shares of s_p, with c more from the coordinator's clients:
//!    k + 1 − t + c < t, so s_p does not come back.
//! 4. Nor does s_x: its honest revealers saw x drop, b_x's saw x survive,
//!    both within x's k + 1 − c honest holders, and 2(t − c) > k + 1 − c.
//! 5. So the mask x added with p stays on x's masked input: x is not
//!    exposed.
//!
//! Step 2 is where counting t signers anywhere in the round fails: p's t
//! signers could then be strangers to its neighbourhood, and every member
//! of it could see p drop (the split-list attack the tests find).
//!
//! ## The searches
//! * [`sat::search`] decides the question exactly, for one target and a
//!   number of distinct survivor lists, as a SAT problem (totalizer
//!   cardinality encodings, a CDCL solver). With as many lists as clients
//!   it covers every strategy; the tests run it on every round the
//!   protocol accepts up to n = 12, complete and sparse.
//! * [`targeted::search`] is for the rounds the parameter finder derives at
//!   n = 100, 500 and 1 000, too large for the exact search: it starts from
//!   the attacks that split a target's neighbourhood between two lists and
//!   improves them by local search, each candidate scored by
//!   [`model::evaluate`]. It finds attacks, it proves nothing; at those
//!   sizes the guarantee rests on the counting argument in THREAT_MODEL
//!   (claim 6), which the exact search confirms where it can run.
//!
//! ## Limits
//! * The model is the protocol's combinatorics: who can gather which t
//!   shares. It assumes the primitives hold (a coordinator cannot forge an
//!   Ed25519 signature, open an envelope not meant for it, or invert the
//!   mask PRG), and that an honest client's identity key is its own.
//! * One round at a time: what a coordinator learns by combining rounds
//!   (the same update masked into two groups, a re-run without one client)
//!   is the business of other checks (THREAT_MODEL claims 38 and 48).
//! * "Exposed" means one input alone. A sum of the target and a single other
//!   client is not exposure here; the threshold and the graph keep each
//!   unmasked sum at t inputs or more only for a coordinator that follows
//!   the protocol.

// A checker: a broken invariant of its own (a strategy that does not fit
// the round, a solver that fails, an encoding the model contradicts) is a
// bug to be seen at once, not an error for a caller to handle.
#![allow(clippy::expect_used, clippy::panic)]

pub mod model;
pub mod replay;
pub mod sat;
pub mod targeted;

pub use model::{Outcome, Response, Round, SignerScope, Strategy, evaluate, tally};
pub use sat::{Corruption, Query, Verdict};
