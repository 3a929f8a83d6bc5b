//! Runs the adversary search and prints what it finds, per round:
//!
//! ```sh
//! cargo run --release -p cohort-adversary --example search            # both searches
//! cargo run --release -p cohort-adversary --example search -- 2000     # targeted budget
//! ```
//!
//! The exact search covers every active round up to 12 clients with the
//! coordinator owning up to 2t − k − 2 clients in every neighbourhood (the
//! most the claim allows) and,
//! against the rule before the fix, none; the targeted search runs at the
//! parameter finder's rounds of 100, 500 and 1 000 clients, before and
//! after the fix.

#![allow(clippy::expect_used)]

use std::time::Instant;

use cohort_adversary::model::id;
use cohort_adversary::replay::active_round;
use cohort_adversary::sat::{Corruption, Query, Verdict, search};
use cohort_adversary::{Round, SignerScope};
use cohort_crypto::config::min_active_threshold;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::params::{Adversary, ParameterTarget, derive_sparse};

fn round(n: u32, k: u32, t: u32, scope: SignerScope) -> Round {
    let graph = if k >= n - 1 { GraphSpec::Complete } else { GraphSpec::Harary { degree: k } };
    let (config, _) = active_round(n, graph, t, 0);
    Round::new(config.communication_graph(), t, scope)
}

fn main() {
    let budget: usize = std::env::args().nth(1).and_then(|b| b.parse().ok()).unwrap_or(1000);
    println!("exact search, every active round up to 12 clients");
    println!("| rule | corrupt | rounds | exposed | seconds |");
    println!("|---|---|---|---|---|");
    for scope in [SignerScope::Round, SignerScope::Neighbourhood] {
        let start = Instant::now();
        let (mut rounds, mut exposed) = (0, Vec::new());
        for n in 3..=12u32 {
            for k in (2..n - 1).step_by(2).chain([n - 1]) {
                for t in min_active_threshold(k)..=k {
                    let c = if scope == SignerScope::Round { 0 } else { 2 * t - k - 2 };
                    let query =
                        Query { target: id(1), corruption: Corruption::PerNeighbourhood(c), views: n };
                    rounds += 1;
                    if let Verdict::Exposed(_) = search(&round(n, k, t, scope), &query) {
                        exposed.push(format!("{n}/{k}/{t}"));
                    }
                }
            }
        }
        let corrupt = if scope == SignerScope::Round { "0" } else { "2t − k − 2" };
        let list = if exposed.is_empty() { "none".to_string() } else { exposed.join(", ") };
        println!("| {scope:?} | {corrupt} | {rounds} | {list} | {:.1} |", start.elapsed().as_secs_f64());
    }
    println!();
    println!("targeted search at the finder's parameters, {budget} evaluations per start");
    println!("| n | k / t | rule | found after | seconds |");
    println!("|---|---|---|---|---|");
    let target = ParameterTarget { adversary: Adversary::SemiMalicious, ..ParameterTarget::default() };
    for n in [100u32, 500, 1000] {
        let p = derive_sparse(n, &target).expect("feasible");
        for scope in [SignerScope::Round, SignerScope::Neighbourhood] {
            let round = round(n, p.degree, p.threshold, scope);
            let start = Instant::now();
            let found =
                cohort_adversary::targeted::search(&round, id(1), &vec![false; n as usize], budget, 1);
            let verdict = found.map_or("nothing".to_string(), |f| format!("{} evaluations", f.evaluations));
            let seconds = start.elapsed().as_secs_f64();
            println!("| {n} | {} / {} | {scope:?} | {verdict} | {seconds:.1} |", p.degree, p.threshold);
        }
    }
}
