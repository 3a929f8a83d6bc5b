//! `cohort privacy`: the accountant on its own. Prints ε of the
//! Poisson-sampled Gaussian mechanism composed over rounds (the accountant
//! the coordinator runs, see `cohort_crypto::dp::accountant`), or, given a
//! budget, the least noise multiplier that meets it.

use anyhow::{Result, bail};
use clap::Args;
use cohort_crypto::dp::accountant::{RoundMechanism, RoundPrivacy, noise_multiplier_for};
use serde_json::json;

#[derive(Debug, Args)]
pub struct PrivacyArgs {
    /// The noise multiplier z (noise standard deviation over the L2
    /// sensitivity).
    #[arg(long, required_unless_present = "epsilon")]
    noise_multiplier: Option<f64>,
    /// Instead of z: the budget ε to solve z for.
    #[arg(long, conflicts_with = "noise_multiplier")]
    epsilon: Option<f64>,
    /// The probability q that a client takes part in a round (1: no
    /// amplification by sampling).
    #[arg(long, default_value_t = 1.0)]
    sample_rate: f64,
    /// Rounds (compositions).
    #[arg(long)]
    rounds: u64,
    /// δ.
    #[arg(long)]
    delta: f64,
    /// One JSON object instead of a sentence.
    #[arg(long)]
    json: bool,
}

pub fn run(args: &PrivacyArgs) -> Result<()> {
    if !(args.sample_rate > 0.0 && args.sample_rate <= 1.0) {
        bail!("--sample-rate must be in (0, 1]");
    }
    if !(args.delta > 0.0 && args.delta < 1.0) {
        bail!("--delta must be in (0, 1)");
    }
    let privacy = |z: f64| RoundPrivacy {
        mechanism: RoundMechanism::Gaussian { noise_multiplier: z },
        sample_rate: args.sample_rate,
    };
    let z = match (args.noise_multiplier, args.epsilon) {
        (Some(z), _) if z.is_finite() && z > 0.0 => z,
        (Some(_), _) => bail!("--noise-multiplier must be positive"),
        (None, Some(epsilon)) if epsilon.is_finite() && epsilon > 0.0 => {
            match noise_multiplier_for(epsilon, args.delta, args.rounds, privacy) {
                Some(z) => z,
                None => {
                    bail!("no noise multiplier up to 10⁴ meets ε = {epsilon} over {} rounds", args.rounds)
                }
            }
        }
        (None, _) => bail!("--epsilon must be positive"),
    };
    let spent = privacy(z).epsilon(args.rounds, args.delta);
    if args.json {
        println!(
            "{}",
            json!({
                "mechanism": "poisson_sampled_gaussian",
                "noise_multiplier": z,
                "sample_rate": args.sample_rate,
                "rounds": args.rounds,
                "delta": args.delta,
                "epsilon": spent.epsilon,
                "order": spent.order,
            })
        );
    } else {
        println!(
            "ε = {:.6} at δ = {} after {} rounds of the Gaussian mechanism with noise multiplier {z:.6}, each on a Poisson sample of rate {} (best Rényi order {}).",
            spent.epsilon, args.delta, args.rounds, args.sample_rate, spent.order
        );
    }
    Ok(())
}
