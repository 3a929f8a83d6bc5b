//! Prints the degree and threshold `params` derives for the settings of the
//! published SecAgg+ table, for comparison (see docs/BENCHMARKS.md).

use cohort_crypto::params::{Adversary, ParameterTarget, derive_sparse};

fn main() {
    let rows = [
        ("5% / 33%, semi-honest", 0.05, Adversary::SemiHonest),
        ("33% / 33%, semi-honest", 0.33, Adversary::SemiHonest),
        ("5% / 33%, semi-malicious", 0.05, Adversary::SemiMalicious),
    ];
    println!("| adversarial / dropout | n=10^2 | 10^3 | 10^4 | 10^5 | 10^6 |");
    println!("|---|---|---|---|---|---|");
    for (label, corruption, adversary) in rows {
        let target = ParameterTarget { corruption, adversary, ..ParameterTarget::default() };
        let cells: Vec<String> = [100u32, 1_000, 10_000, 100_000, 1_000_000]
            .iter()
            .map(|&n| match derive_sparse(n, &target) {
                Ok(p) => format!("{}/{}", p.degree, p.threshold),
                Err(_) => "infeasible".to_string(),
            })
            .collect();
        println!("| {label} | {} |", cells.join(" | "));
    }
}
