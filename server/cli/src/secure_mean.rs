//! One secure-aggregation round in process, through the protocol core:
//! the aggregation step of `cohort simulate` (without `--plain`).

use anyhow::{Result, anyhow};
use cohort_client::runtime::LocalUpdate;
use cohort_crypto::SumSpread;
use cohort_crypto::quantize::lift;
use cohort_crypto::simulation::{Attack, DropoutPlan, NoStopwatch, Simulation};
use cohort_crypto::{ClientId, ClientMessage, Metric, ProtocolError, QuantizedInput, Variant};
use cohort_server::optimizer::ServerOptimizer;
use cohort_server::privacy::PrivacySpec;
use cohort_server::round::{BuiltRound, RoundBuilder, RoundSeeds};
use cohort_server::spec::{
    GraphChoice, NormChoice, QuantizationConfig, SecAggSpec, TaskPlan, TaskSpec, ValidationSpec,
};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::training::threshold;

/// What one in-process round produced.
pub(crate) struct SecureMean {
    /// The weighted mean (under DP: the mean of the clipped, noised updates).
    pub(crate) mean: Vec<f32>,
    /// The mean upload per surviving client, in bytes (every stage).
    pub(crate) bytes_up: f64,
    /// The masked input's bit-packed size, in bytes.
    pub(crate) masked_input_bytes: usize,
    /// The clients' mean training loss (none under DP).
    pub(crate) client_loss: Option<f64>,
    /// Σ of the survivors' example counts.
    pub(crate) weight: u64,
    /// In a fitted ring: its scale, the sum's spread for the next round's,
    /// and how many of its coordinates wrapped.
    pub(crate) fitted: Option<FittedSum>,
}

/// A fitted ring's round in the simulator.
#[derive(Debug, Clone)]
pub(crate) struct FittedSum {
    /// The round's scale (the lowest of its groups').
    pub(crate) scale: f64,
    /// The sum's spread, for the next round's scale; `None` when a sum
    /// wrapped throughout (the next round then runs at the safe scale).
    pub(crate) spread: Option<SumSpread>,
    /// Coordinates of the sum that wrapped, against the integer sum of the
    /// same inputs (which only a simulation, holding every input, can count).
    pub(crate) wrapped: u64,
    /// Whether the sum wrapped throughout, as the coordinator tells
    /// ([`cohort_crypto::quantize::WeightedMean::overflowed`]).
    pub(crate) overflowed: bool,
}

impl FittedSum {
    /// The fitted sums of several groups as one round's.
    pub(crate) fn combine(self, other: Self) -> Self {
        let spread = match (self.spread, other.spread) {
            (Some(a), Some(b)) => Some(a.widest(&b).unwrap_or(a)),
            _ => None,
        };
        Self {
            scale: self.scale.min(other.scale),
            spread,
            wrapped: self.wrapped + other.wrapped,
            overflowed: self.overflowed || other.overflowed,
        }
    }
}

/// How one in-process group ended.
pub(crate) enum GroupOutcome {
    /// Unmasked (and, in a validated round, its sum check passed).
    Done(SecureMean),
    /// Its unmasked sum did not open the contributors' commitments: the
    /// indices (into the group's updates) of the contributors.
    Mismatch(Vec<usize>),
}

/// The task an in-process round of `n` clients runs: `vanishing` of them
/// drop, `rounds` rounds in all (for the privacy plan).
pub(crate) fn simulation_spec(
    n: u32,
    vanishing: u32,
    q: QuantizationConfig,
    dimension: usize,
    privacy: Option<PrivacySpec>,
    rounds: u32,
    validated: bool,
) -> TaskSpec {
    TaskSpec {
        name: "simulation".into(),
        model: cohort_server::spec::ModelSpec {
            architecture: "any".into(),
            layout: cohort_client::checkpoint::ModelLayout {
                tensors: vec![cohort_client::checkpoint::TensorSpec {
                    name: "w".into(),
                    shape: vec![dimension],
                }],
            },
            init: Default::default(),
        },
        rounds,
        clients_per_round: n,
        over_selection: 0.0,
        secure_aggregation: SecAggSpec {
            graph: if n <= 100 { GraphChoice::Complete } else { GraphChoice::Sparse },
            threshold: (n <= 100).then_some(threshold(n, vanishing)),
            ..SecAggSpec::default()
        },
        quantization: q,
        deadlines: Default::default(),
        optimizer: ServerOptimizer::default(),
        checkpoint_retention: 1,
        client_metrics: Default::default(),
        privacy,
        mode: Default::default(),
        asynchronous: None,
        validation: validated.then_some(ValidationSpec {
            norm: NormChoice::L2,
            l2_clip: None,
            group_rule: None,
        }),
    }
}

/// One secure-aggregation round in process over the clients' updates
/// (the `dropped` ones vanish after ShareKeys) of the task `spec`.
pub(crate) fn secure_mean(
    updates: &[LocalUpdate],
    dropped: &[usize],
    spec: &TaskSpec,
    seed: u64,
    dimension: usize,
    spread: Option<&SumSpread>,
) -> Result<SecureMean> {
    match secure_group(updates, dropped, spec, seed, dimension, &[], Attack::Scaled, spread)? {
        GroupOutcome::Done(mean) => Ok(mean),
        GroupOutcome::Mismatch(_) => Err(anyhow!("the sum did not open the commitments")),
    }
}

/// [`secure_mean`] with `cheaters` (indices into `updates`) that change
/// their masked input by `attack` after proving their honest update. In a
/// fitted ring the scale is fitted to `spread`, the last sum's, as the
/// coordinator fits it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn secure_group(
    updates: &[LocalUpdate],
    dropped: &[usize],
    spec: &TaskSpec,
    seed: u64,
    dimension: usize,
    cheaters: &[usize],
    attack: Attack,
    spread: Option<&SumSpread>,
) -> Result<GroupOutcome> {
    let n = updates.len() as u32;
    // A semi-honest round: the simulated clients have no identity keys.
    let security = cohort_crypto::policy::TaskSecurity {
        variant: Variant::SemiHonest,
        ..TaskPlan::new(spec.clone()).map_err(|e| anyhow!("secure-aggregation parameters: {e}"))?.security()
    };
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut seeds = RoundSeeds::draw(&mut rng);
    seeds.scale = spec.quantization.scale_for(n, spread);
    let BuiltRound { config, quantizer } =
        RoundBuilder::for_task(spec, &security).build_with(1, n, Vec::new(), None, seeds)?;
    // Stochastic rounding draws from a per-client generator, so that the
    // simulation may ask for an input any number of times.
    let encode = |i: usize| {
        let mut rng = ChaCha20Rng::seed_from_u64(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        quantizer.encode_with_metrics(&updates[i].delta, updates[i].examples, &updates[i].metrics, &mut rng)
    };
    for i in 0..updates.len() {
        encode(i)?;
    }
    let plan = DropoutPlan {
        after_shares: dropped.iter().filter_map(|&i| ClientId::new(i as u32 + 1)).collect(),
        ..DropoutPlan::default()
    };
    let input = |id: ClientId| -> QuantizedInput {
        encode(id.get() as usize - 1).unwrap_or_else(|_| unreachable!("every input was encoded once above"))
    };
    let masked_input_bytes = cohort_crypto::wire::packed_len(config.vector_len as usize, config.modulus_bits);
    let (quantizer_scale, bits) = (config.quantization.scale, config.modulus_bits);
    let tamper = |id: ClientId, message: &mut ClientMessage| {
        if cheaters.contains(&id.index()) {
            let salt = seed ^ (id.get() as u64).wrapping_mul(0x2545_f491_4f6c_dd1d);
            attack.apply(message, &mut ChaCha20Rng::seed_from_u64(salt));
        }
    };
    let tamper: cohort_crypto::simulation::Tamper<'_> = &tamper;
    let simulation = Simulation {
        config,
        identities: Vec::new(),
        plan,
        inputs: &input,
        seed,
        tamper: (!cheaters.is_empty()).then_some(tamper),
    };
    let outcome = match simulation.run(&NoStopwatch) {
        Ok(outcome) => outcome,
        Err(ProtocolError::CommitmentMismatch { suspects }) => {
            return Ok(GroupOutcome::Mismatch(suspects.iter().map(|id| id.index()).collect()));
        }
        Err(error) => return Err(error.into()),
    };
    let survivors = outcome.aggregate.contributors.len() as u32;
    let mean = quantizer.decode(&outcome.aggregate.sum, survivors, dimension)?;
    let fitted = match quantizer_scale {
        Some(scale) => {
            // The sum over the integers, against the ring's, lifted.
            let mut exact = vec![0i64; dimension];
            for id in &outcome.aggregate.contributors {
                let input = encode(id.index())?;
                for (e, &v) in exact.iter_mut().zip(input.values()) {
                    *e += lift(v, bits);
                }
            }
            let wrapped =
                exact.iter().zip(&outcome.aggregate.sum).filter(|&(&e, &s)| lift(s, bits) != e).count()
                    as u64;
            // A sum that wrapped throughout leaves the next round at the
            // safe scale, as the coordinator does (its spread says nothing).
            let spread = quantizer.spread(&mean, survivors).filter(|_| !mean.overflowed());
            Some(FittedSum { scale, spread, wrapped, overflowed: mean.overflowed() })
        }
        None => None,
    };
    let finished: Vec<_> = outcome.clients.iter().filter(|c| c.finished).collect();
    let bytes_up = finished.iter().map(|c| c.bytes_up as f64).sum::<f64>() / finished.len().max(1) as f64;
    let client_loss = mean.metrics.mean(Metric::TrainLoss);
    Ok(GroupOutcome::Done(SecureMean {
        mean: mean.mean,
        bytes_up,
        masked_input_bytes,
        client_loss,
        weight: mean.total_weight,
        fitted,
    }))
}
