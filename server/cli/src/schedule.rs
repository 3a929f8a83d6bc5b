//! The simulated clock of `cohort simulate`: how long each client takes to
//! train, and the two ways of scheduling clients against it, synchronous
//! rounds (with over-selection) and buffered asynchronous aggregation
//! (FedBuff) with bounded staleness.
//!
//! A client's training takes `multiplier × epochs × examples ÷ rate`
//! simulated seconds, with its multiplier drawn once from the speed model
//! (lognormal, and a fraction of stragglers slower still). Communication
//! and unmasking take no simulated time: the clock measures what the
//! schedules differ in, waiting for clients.

use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use cohort_crypto::policy::Policy;
use cohort_server::spec::AsyncSpec;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;
use rand_distr::{Distribution, LogNormal};

/// Examples a client at speed 1 trains on per simulated second, unless
/// told otherwise.
const EXAMPLES_PER_SECOND: f64 = 1000.0;

/// How rounds are scheduled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Mode {
    /// Rounds: K clients (plus over-selection) train on the same model,
    /// the round closes when K finished.
    Sync,
    /// Buffered asynchronous aggregation: C clients train at once, each
    /// buffer of K finished updates is one secure-aggregation group and
    /// one model update.
    Async,
}

/// The clock, the speeds and the schedule of a simulation.
#[derive(Debug, Clone, Args)]
pub struct ScheduleArgs {
    /// Synchronous rounds or buffered asynchronous aggregation.
    #[arg(long, value_enum, default_value = "sync")]
    pub(crate) mode: Mode,
    /// Each client's training-time multiplier: lognormal:SIGMA (e^N(0, σ²),
    /// drawn once per client). Default: every client at speed 1.
    #[arg(long, value_parser = parse_speed)]
    pub(crate) speed: Option<f64>,
    /// F:X — a fraction F of the clients X times slower still.
    #[arg(long, value_parser = parse_stragglers)]
    pub(crate) stragglers: Option<(f64, f64)>,
    /// Examples a client at speed 1 trains on per simulated second.
    #[arg(long, default_value_t = EXAMPLES_PER_SECOND)]
    pub(crate) examples_per_second: f64,
    /// Sync: extra clients selected per round, as a fraction; the round
    /// closes when --clients-per-round of them finished training, and the
    /// slowest are cut (as the coordinator cuts those that have not
    /// advertised their keys by then).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) over_selection: f64,
    /// Async: training slots (C): clients training at once, not counting
    /// slow ones that gave up their slot and train on.
    #[arg(long)]
    pub(crate) concurrency: Option<u32>,
    /// Async: updates per buffer (K), each buffer one secure-aggregation
    /// group.
    #[arg(long)]
    pub(crate) buffer_size: Option<u32>,
    /// Async: the most model versions an update may lag behind (S); a
    /// staler one is refused and its client re-bases. A client gives up
    /// its training slot sooner, once it lags ⌈C / K⌉ versions, and its
    /// update still counts if it arrives within S.
    #[arg(long, default_value_t = 4)]
    pub(crate) max_staleness: u32,
    /// Async: an update s versions stale is weighted (1 + s)^−a.
    #[arg(long, default_value_t = 0.5)]
    pub(crate) staleness_exponent: f64,
}

fn parse_speed(text: &str) -> Result<f64, String> {
    let sigma = text
        .strip_prefix("lognormal:")
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("expected lognormal:SIGMA, got {text:?}"))?;
    if !(sigma.is_finite() && (0.0..=5.0).contains(&sigma)) {
        return Err(format!("the lognormal σ must be between 0 and 5, got {sigma}"));
    }
    Ok(sigma)
}

fn parse_stragglers(text: &str) -> Result<(f64, f64), String> {
    let parsed =
        text.split_once(':').and_then(|(f, x)| Some((f.parse::<f64>().ok()?, x.parse::<f64>().ok()?)));
    match parsed {
        Some((fraction, factor))
            if (0.0..=1.0).contains(&fraction) && factor.is_finite() && factor >= 1.0 =>
        {
            Ok((fraction, factor))
        }
        Some(_) => Err(format!("stragglers F:X needs 0 ≤ F ≤ 1 and X ≥ 1, got {text:?}")),
        None => Err(format!("expected F:X (a fraction and a slowdown), got {text:?}")),
    }
}

impl ScheduleArgs {
    /// The asynchronous schedule, checked against the population and the
    /// default client policy; `None` in sync mode (whose own flags are
    /// checked here too).
    pub(crate) fn async_spec(&self, clients: usize) -> Result<Option<AsyncSpec>> {
        match self.mode {
            Mode::Sync => {
                if self.concurrency.is_some() || self.buffer_size.is_some() {
                    bail!("--concurrency and --buffer-size are for --mode async");
                }
                if !(0.0..=10.0).contains(&self.over_selection) {
                    bail!("--over-selection must be between 0 and 10");
                }
                Ok(None)
            }
            Mode::Async => {
                if self.over_selection != 0.0 {
                    bail!("--over-selection is for --mode sync: an async task has no rounds to over-select");
                }
                let (Some(concurrency), Some(buffer_size)) = (self.concurrency, self.buffer_size) else {
                    bail!("--mode async needs --concurrency and --buffer-size");
                };
                let spec = AsyncSpec {
                    concurrency,
                    buffer_size,
                    max_staleness: self.max_staleness,
                    staleness_exponent: self.staleness_exponent,
                };
                spec.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
                if concurrency as usize > clients {
                    bail!("--concurrency {concurrency} is more than the {clients} clients");
                }
                let minimum = Policy::default().min_clients;
                if buffer_size < minimum {
                    bail!(
                        "--buffer-size {buffer_size} is below the client policy's minimum of {minimum} clients per \
                         group: clients would refuse every group"
                    );
                }
                Ok(Some(spec))
            }
        }
    }
}

/// Each client's training time on the simulated clock.
#[derive(Debug, Clone)]
pub(crate) struct Clock {
    seconds: Vec<f64>,
}

impl Clock {
    /// Client `k` at speed multiplier `m_k` (from the speed model, seeded
    /// with `seed`) trains `epochs` passes over `examples[k]` examples.
    pub(crate) fn new(schedule: &ScheduleArgs, examples: &[usize], epochs: usize, seed: u64) -> Self {
        let multipliers = multipliers(examples.len(), schedule.speed, schedule.stragglers, seed);
        let seconds = examples
            .iter()
            .zip(multipliers)
            .map(|(&n, m)| m * (epochs.max(1) * n.max(1)) as f64 / schedule.examples_per_second)
            .collect();
        Self { seconds }
    }

    /// Every client at speed 1, at the default rate.
    pub(crate) fn uniform(examples: &[usize], epochs: usize) -> Self {
        let seconds =
            examples.iter().map(|&n| (epochs.max(1) * n.max(1)) as f64 / EXAMPLES_PER_SECOND).collect();
        Self { seconds }
    }

    /// How long client `k` trains, in simulated seconds.
    pub(crate) fn training(&self, k: usize) -> f64 {
        self.seconds[k]
    }
}

/// Speed multipliers: lognormal(0, σ) each (1 without σ), and a fraction
/// of the clients, chosen at random, `factor` times slower.
fn multipliers(clients: usize, sigma: Option<f64>, stragglers: Option<(f64, f64)>, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed ^ 0x5bd1_e995_c10c_0000);
    let mut multipliers: Vec<f64> = match sigma.and_then(|s| LogNormal::new(0.0, s).ok()) {
        Some(lognormal) => (0..clients).map(|_| lognormal.sample(&mut rng)).collect(),
        None => vec![1.0; clients],
    };
    if let Some((fraction, factor)) = stragglers {
        let mut order: Vec<usize> = (0..clients).collect();
        order.shuffle(&mut rng);
        let count = (fraction * clients as f64).round() as usize;
        for &k in &order[..count.min(clients)] {
            multipliers[k] *= factor;
        }
    }
    multipliers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(flags: &[&str]) -> ScheduleArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            schedule: ScheduleArgs,
        }
        let args = std::iter::once("cohort").chain(flags.iter().copied());
        <Cli as clap::Parser>::try_parse_from(args).map(|cli| cli.schedule).unwrap()
    }

    #[test]
    fn the_speed_model_has_its_stragglers_and_its_spread() {
        let stragglers = multipliers(1000, None, Some((0.2, 10.0)), 7);
        assert_eq!(stragglers.iter().filter(|&&m| m == 10.0).count(), 200);
        assert_eq!(stragglers.iter().filter(|&&m| m == 1.0).count(), 800);
        let logs: Vec<f64> = multipliers(4000, Some(1.0), None, 7).iter().map(|m| m.ln()).collect();
        let mean = logs.iter().sum::<f64>() / logs.len() as f64;
        let sd = (logs.iter().map(|l| (l - mean).powi(2)).sum::<f64>() / logs.len() as f64).sqrt();
        // ln m ~ N(0, 1): over 4000 draws the mean is within 0.05 and the
        // spread within 5 % (about three standard errors each).
        assert!(mean.abs() < 0.05, "mean log multiplier {mean}");
        assert!((sd - 1.0).abs() < 0.05, "spread of the log multipliers {sd}");
        // Both together: each straggler's lognormal draw, 10 times.
        let both = multipliers(1000, Some(1.0), Some((0.2, 10.0)), 7);
        let plain = multipliers(1000, Some(1.0), None, 7);
        let slowed = both.iter().zip(&plain).filter(|(b, p)| (*b / *p - 10.0).abs() < 1e-9).count();
        assert_eq!(slowed, 200);
        assert_eq!(multipliers(5, None, None, 1), vec![1.0; 5]);
    }

    #[test]
    fn training_time_scales_with_the_work_and_the_speed() {
        let clock = Clock::new(&schedule(&["--stragglers", "0.5:4"]), &[500, 500], 2, 3);
        let mut seconds = [clock.training(0), clock.training(1)];
        seconds.sort_by(f64::total_cmp);
        assert_eq!(seconds, [1.0, 4.0]);
    }

    #[test]
    fn bad_schedules_are_refused_with_a_reason() {
        let error = |flags: &[&str]| schedule(flags).async_spec(100).unwrap_err().to_string();
        assert!(error(&["--mode", "async", "--concurrency", "10", "--buffer-size", "20"]).contains("buffer"));
        assert!(
            error(&["--mode", "async", "--concurrency", "10", "--buffer-size", "10", "--max-staleness", "0"])
                .contains("staleness")
        );
        assert!(error(&["--mode", "async", "--concurrency", "20", "--buffer-size", "5"]).contains("policy"));
        assert!(
            error(&["--mode", "async", "--concurrency", "200", "--buffer-size", "10"]).contains("clients")
        );
        assert!(error(&["--mode", "async", "--concurrency", "10"]).contains("--buffer-size"));
        assert!(error(&["--concurrency", "10"]).contains("--mode async"));
        assert!(
            error(&[
                "--mode",
                "async",
                "--concurrency",
                "10",
                "--buffer-size",
                "10",
                "--over-selection",
                "0.3"
            ])
            .contains("--mode sync")
        );
        let parse = |flags: &[&str]| {
            #[derive(clap::Parser)]
            struct Cli {
                #[command(flatten)]
                _schedule: ScheduleArgs,
            }
            <Cli as clap::Parser>::try_parse_from(std::iter::once("cohort").chain(flags.iter().copied()))
                .is_ok()
        };
        assert!(!parse(&["--speed", "normal:1"]));
        assert!(!parse(&["--stragglers", "1.5:10"]));
        assert!(!parse(&["--stragglers", "0.2:0.5"]));
        let ok = schedule(&["--mode", "async", "--concurrency", "10", "--buffer-size", "10"]);
        assert_eq!(ok.async_spec(100).unwrap().map(|s| s.buffer_size), Some(10));
    }
}
