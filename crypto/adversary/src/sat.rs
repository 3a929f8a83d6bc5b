//! The search as a satisfiability problem: is there a [`Strategy`] that
//! exposes a given honest client?
//!
//! The encoding follows [`crate::model::evaluate`] rule by rule (the names
//! below are the model's). A satisfying assignment is decoded into a
//! [`Strategy`] and checked with [`evaluate`] before it is returned, so an
//! encoding that claimed an attack the rules do not allow would fail
//! loudly rather than report a false attack. The other direction (no
//! attack missed) is checked against attacks known by hand: the search
//! finds the split-list attack wherever the old signature rule allows it,
//! and the collusion attack on every complete round at exactly 2t − k − 1
//! of the coordinator's clients (`tests/search.rs`).
//!
//! Variables, for clients u, v, w, views j (a view is one survivor list;
//! with as many views as clients, every client may see its own):
//! * `corrupt[v]`: v is the coordinator's;
//! * `envelope[u][v]` (v a neighbour of u): u is handed v's envelope;
//! * `view[u][j]`: honest u is shown list j (at most one j); `shown[u]` that
//!   it is shown one; `member[j][v]`: v is on list j;
//! * `signs[w][j]`: w's signature over list j is available (honest and
//!   shown j, or the coordinator's and on list j);
//! * `reveals[u]`: u was handed t signatures it counts over its list;
//! * `seed[u][v]`, `key[u][v]`: u reveals its share of v's seed, of v's
//!   mask key (only for the target and its neighbours, whose secrets the
//!   goal counts).

use cohort_crypto::ClientId;
use rustsat::encodings::card::{BoundLower, BoundUpper, Totalizer};
use rustsat::instances::{BasicVarManager, Cnf, ManageVars};
use rustsat::solvers::{Solve, SolverResult};
use rustsat::types::{Clause, Lit, TernaryVal};

use crate::model::{Round, Strategy, evaluate, id};

/// Which clients the coordinator may own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Corruption {
    /// Exactly these (by index).
    Fixed(Vec<bool>),
    /// Any set of at most this many clients (never the target).
    AtMost(u32),
    /// Any set with at most this many clients in every closed neighbourhood
    /// (a client and its neighbours), never the target: the collusion the
    /// protocol's claim is stated for, many more clients in all on a large
    /// sparse round.
    PerNeighbourhood(u32),
}

/// What to search.
#[derive(Debug, Clone)]
pub struct Query {
    /// The client whose input the coordinator wants.
    pub target: ClientId,
    /// Whom it may own.
    pub corruption: Corruption,
    /// Distinct survivor lists it may show (at most the number of clients;
    /// with that many the search is over every assignment of lists).
    pub views: u32,
}

/// The result of one search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// No strategy within the query exposes the target.
    Safe,
    /// A strategy that exposes the target (checked with [`evaluate`]).
    Exposed(Strategy),
}

struct Encoder {
    vars: BasicVarManager,
    cnf: Cnf,
}

impl Encoder {
    fn lit(&mut self) -> Lit {
        self.vars.new_var().pos_lit()
    }

    fn clause(&mut self, lits: impl IntoIterator<Item = Lit>) {
        self.cnf.add_clause(lits.into_iter().collect::<Clause>());
    }

    /// `conditions` (all true) imply that at least `bound` of `inputs` hold.
    fn at_least(&mut self, conditions: &[Lit], inputs: Vec<Lit>, bound: usize) {
        let negated = conditions.iter().map(|&c| !c);
        if bound == 0 {
            return;
        }
        if inputs.len() < bound {
            let clause: Vec<Lit> = negated.collect();
            self.clause(clause);
            return;
        }
        let mut totalizer = Totalizer::from(inputs);
        totalizer.encode_lb(bound..=bound, &mut self.cnf, &mut self.vars).expect("memory for the encoding");
        let outputs = totalizer.enforce_lb(bound).expect("the bound was encoded");
        for output in outputs {
            let clause: Vec<Lit> = negated.clone().chain([output]).collect();
            self.clause(clause);
        }
    }

    /// At most `bound` of `inputs` hold.
    fn at_most(&mut self, inputs: Vec<Lit>, bound: usize) {
        if inputs.len() <= bound {
            return;
        }
        let mut totalizer = Totalizer::from(inputs);
        totalizer.encode_ub(bound..=bound, &mut self.cnf, &mut self.vars).expect("memory for the encoding");
        for unit in totalizer.enforce_ub(bound).expect("the bound was encoded") {
            self.cnf.add_unit(unit);
        }
    }

    /// A literal that implies the conjunction of `lits`.
    fn and(&mut self, lits: &[Lit]) -> Lit {
        let out = self.lit();
        for &lit in lits {
            self.clause([!out, lit]);
        }
        out
    }
}

/// Searches every strategy of the query for one that exposes the target.
///
/// # Panics
/// If the solver fails, or returns a strategy that [`evaluate`] does not
/// confirm (an encoding error).
pub fn search(round: &Round, query: &Query) -> Verdict {
    let n = round.clients() as usize;
    let t = round.threshold() as usize;
    let m = query.views.clamp(1, n as u32) as usize;
    let x = query.target;
    let mut enc = Encoder { vars: BasicVarManager::default(), cnf: Cnf::new() };
    let clients: Vec<ClientId> = (1..=n as u32).map(id).collect();

    let corrupt: Vec<Lit> = (0..n).map(|_| enc.lit()).collect();
    match &query.corruption {
        Corruption::Fixed(set) => {
            for (v, &is) in set.iter().enumerate() {
                enc.clause([if is { corrupt[v] } else { !corrupt[v] }]);
            }
        }
        Corruption::AtMost(c) => enc.at_most(corrupt.clone(), *c as usize),
        Corruption::PerNeighbourhood(c) => {
            for &v in &clients {
                let closed = round.neighbours(v).iter().chain([&v]).map(|w| corrupt[w.index()]).collect();
                enc.at_most(closed, *c as usize);
            }
        }
    }
    enc.clause([!corrupt[x.index()]]);

    // envelope[u][i] for the i-th neighbour of u.
    let envelope: Vec<Vec<Lit>> =
        clients.iter().map(|&u| round.neighbours(u).iter().map(|_| enc.lit()).collect()).collect();
    let envelope_of = |u: ClientId, v: ClientId| {
        let i = round.neighbours(u).binary_search(&v).expect("a neighbour");
        envelope[u.index()][i]
    };
    let view: Vec<Vec<Lit>> = (0..n).map(|_| (0..m).map(|_| enc.lit()).collect()).collect();
    let member: Vec<Vec<Lit>> = (0..m).map(|_| (0..n).map(|_| enc.lit()).collect()).collect();
    let shown: Vec<Lit> = (0..n).map(|_| enc.lit()).collect();
    let reveals: Vec<Lit> = (0..n).map(|_| enc.lit()).collect();

    for list in &member {
        enc.at_least(&[], list.clone(), t);
    }
    for &u in &clients {
        let ui = u.index();
        // At most one list, and only for an honest client. Lists are
        // numbered in the order of the first client shown each (which
        // loses no strategy), so the i-th client is shown one of the
        // first i + 1.
        for a in 0..m {
            if a > ui {
                enc.clause([!view[ui][a]]);
            }
            enc.clause([!view[ui][a], !corrupt[ui]]);
            for b in a + 1..m {
                enc.clause([!view[ui][a], !view[ui][b]]);
            }
        }
        let mut shown_clause = vec![!shown[ui]];
        shown_clause.extend(&view[ui]);
        enc.clause(shown_clause);
        for j in 0..m {
            enc.clause([!view[ui][j], shown[ui]]);
            // On its own list, and every neighbour on it shared with u.
            enc.clause([!view[ui][j], member[j][ui]]);
            for &v in round.neighbours(u) {
                enc.clause([!view[ui][j], !member[j][v.index()], envelope_of(u, v)]);
            }
        }
        // A client shown a list sent its masked input: t envelopes.
        enc.at_least(&[shown[ui]], envelope[ui].clone(), t);
        enc.clause([!reveals[ui], shown[ui]]);
    }
    // The target sent its masked input.
    enc.at_least(&[], envelope[x.index()].clone(), t);

    // signs[w][j]
    let signs: Vec<Vec<Lit>> = clients
        .iter()
        .map(|&w| {
            let wi = w.index();
            (0..m)
                .map(|j| {
                    let own = enc.and(&[corrupt[wi], member[j][wi]]);
                    let out = enc.lit();
                    enc.clause([!out, view[wi][j], own]);
                    out
                })
                .collect()
        })
        .collect();
    // A client reveals only with t signatures it counts over its own list.
    for &u in &clients {
        for j in 0..m {
            let counted: Vec<Lit> = clients
                .iter()
                .filter(|&&w| round.counts_signer(u, w))
                .map(|&w| signs[w.index()][j])
                .collect();
            enc.at_least(&[reveals[u.index()], view[u.index()][j]], counted, t);
        }
    }

    // Shares revealed of the secrets of `owner` by each of its neighbours.
    let revealed = |enc: &mut Encoder, owner: ClientId, seed: bool| -> Vec<Lit> {
        round
            .neighbours(owner)
            .iter()
            .map(|&u| {
                let ui = u.index();
                let out = enc.lit();
                // out → corrupt[u] ∨ (reveals[u] ∧ envelope[u][owner] ∧ on/off u's list)
                let honest = enc.lit();
                enc.clause([!out, corrupt[ui], honest]);
                enc.clause([!honest, reveals[ui]]);
                enc.clause([!honest, envelope_of(u, owner)]);
                if seed {
                    // Some list j that u is shown has the owner on it.
                    let mut some = vec![!honest];
                    for j in 0..m {
                        let both = enc.and(&[view[ui][j], member[j][owner.index()]]);
                        some.push(both);
                    }
                    enc.clause(some);
                } else {
                    for j in 0..m {
                        enc.clause([!honest, !view[ui][j], !member[j][owner.index()]]);
                    }
                }
                out
            })
            .collect()
    };
    // The target's seed: its neighbours' shares and its own.
    let mut seed_holders = revealed(&mut enc, x, true);
    seed_holders.push(reveals[x.index()]);
    enc.at_least(&[], seed_holders, t);
    // Mask keys: the target's and each partner's.
    let key_known = |enc: &mut Encoder, owner: ClientId| -> Lit {
        let known = enc.lit();
        let holders = revealed(enc, owner, false);
        enc.at_least(&[known], holders, t);
        known
    };
    let target_key = key_known(&mut enc, x);
    for &p in round.neighbours(x) {
        let partner_key = key_known(&mut enc, p);
        enc.clause([!envelope_of(x, p), corrupt[p.index()], target_key, partner_key]);
    }

    let mut solver = rustsat_batsat::BasicSolver::default();
    solver.add_cnf(enc.cnf).expect("the solver takes the formula");
    match solver.solve().expect("the solver runs") {
        SolverResult::Unsat => Verdict::Safe,
        SolverResult::Sat => {
            let value = |lit: Lit| solver.lit_val(lit).expect("a model") == TernaryVal::True;
            let corrupt: Vec<bool> = corrupt.iter().map(|&c| value(c)).collect();
            let envelopes: Vec<Vec<ClientId>> = clients
                .iter()
                .map(|&u| {
                    round
                        .neighbours(u)
                        .iter()
                        .zip(&envelope[u.index()])
                        .filter(|(_, lit)| value(**lit))
                        .map(|(v, _)| *v)
                        .collect()
                })
                .collect();
            let lists: Vec<Vec<ClientId>> = member
                .iter()
                .map(|list| clients.iter().copied().filter(|v| value(list[v.index()])).collect())
                .collect();
            let shown = clients.iter().map(|u| (0..m).find(|&j| value(view[u.index()][j]))).collect();
            let strategy = Strategy { corrupt, envelopes, lists, shown };
            let outcome = evaluate(round, &strategy);
            assert!(
                outcome.exposed.contains(&x),
                "the encoding found a strategy the model does not confirm: {strategy:?} -> {outcome:?}"
            );
            Verdict::Exposed(strategy)
        }
        SolverResult::Interrupted => panic!("the solver was interrupted"),
    }
}
