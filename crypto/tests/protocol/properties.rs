//! Property tests with fixed seeds:
//! * unmask(Σ masked) = Σ of the survivors' inputs for random n, dimension,
//!   ring, graph, threshold and dropouts at every stage, and the round
//!   succeeds exactly when an independent count of shareholders says it can;
//! * any t Shamir shares reconstruct the secret, fewer do not.

use crate::common::*;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::shamir::{Reconstructor, Share, split};
use cohort_crypto::simulation::DropoutPlan;
use cohort_crypto::{ClientId, ProtocolError, RoundConfig, Secret32};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

fn proptest_config(cases: u32, seed: u64) -> Config {
    Config { cases, rng_seed: RngSeed::Fixed(seed), failure_persistence: None, ..Config::default() }
}

/// When each client vanishes: 0 never, 1 before advertising keys, 2 after
/// advertising, 3 after sharing, 4 after sending its masked input.
fn plan_from(fates: &[u8]) -> DropoutPlan {
    let mut plan = DropoutPlan::default();
    for (index, &fate) in fates.iter().enumerate() {
        let id = id(index as u32 + 1);
        match fate {
            1 => plan.before_keys.push(id),
            2 => plan.after_keys.push(id),
            3 => plan.after_shares.push(id),
            4 => plan.after_masked_input.push(id),
            _ => {}
        }
    }
    plan
}

/// Whether the round must succeed, counted from the rules of the protocol
/// independently of the state machines.
fn must_succeed(config: &RoundConfig, fates: &[u8]) -> bool {
    let graph = config.communication_graph();
    let t = config.threshold as usize;
    let n = fates.len();
    let ids: Vec<ClientId> = (1..=n as u32).map(id).collect();
    let count_in =
        |u: ClientId, set: &[bool]| graph.neighbours(u).iter().filter(|v| set[v.get() as usize - 1]).count();
    let u1: Vec<bool> = fates.iter().map(|&f| f != 1).collect();
    // Clients with fewer than t advertising neighbours abort.
    let u2: Vec<bool> = ids
        .iter()
        .map(|&u| u1[u.get() as usize - 1] && fates[u.get() as usize - 1] != 2 && count_in(u, &u1) >= t)
        .collect();
    let u3: Vec<bool> = ids
        .iter()
        .map(|&u| u2[u.get() as usize - 1] && fates[u.get() as usize - 1] != 3 && count_in(u, &u2) >= t)
        .collect();
    let u5: Vec<bool> =
        ids.iter().map(|&u| u3[u.get() as usize - 1] && fates[u.get() as usize - 1] != 4).collect();
    let size = |set: &[bool]| set.iter().filter(|&&m| m).count();
    if [&u1, &u2, &u3, &u5].iter().any(|set| size(set) < t) {
        return false;
    }
    // Every survivor's seed and every dropped sharer's key needs t holders
    // in U5; a survivor's seed is also shared with itself, so a survivor in
    // U5 holds one of its own seed's shares.
    ids.iter().all(|&u| {
        let i = u.get() as usize - 1;
        let own = usize::from(u3[i] && u5[i]);
        !u2[i] || count_in(u, &u5) + own >= t
    })
}

fn graph_strategy(n: u32) -> BoxedStrategy<GraphSpec> {
    let complete = Just(GraphSpec::Complete).boxed();
    if n < 5 {
        return complete;
    }
    let max_half = (n - 2) / 2;
    prop_oneof![complete, (1..=max_half).prop_map(|half| GraphSpec::Harary { degree: 2 * half }),].boxed()
}

fn round_strategy() -> impl Strategy<Value = (RoundConfig, Vec<u8>, u64)> {
    (3u32..=18, 1u32..=40, prop_oneof![Just(16u8), Just(24), Just(32)])
        .prop_flat_map(|(n, dim, bits)| (Just(n), Just(dim), Just(bits), graph_strategy(n)))
        .prop_flat_map(|(n, dim, bits, graph)| {
            let degree = match &graph {
                GraphSpec::Complete => n - 1,
                GraphSpec::Harary { degree, .. } => *degree,
            };
            let fate = prop_oneof![6 => Just(0u8), 1 => 1u8..=4];
            (
                Just(config(n, 1, graph, dim, bits)),
                1..=degree,
                proptest::collection::vec(fate, n as usize),
                any::<u64>(),
            )
        })
        .prop_map(|(mut config, threshold, fates, seed)| {
            config.threshold = threshold;
            (config, fates, seed)
        })
}

proptest! {
    #![proptest_config(proptest_config(96, 0x5eca99))]

    #[test]
    fn aggregate_equals_the_plain_sum_of_survivors((config, fates, seed) in round_strategy()) {
        let expected = must_succeed(&config, &fates);
        match run_and_check(&config, Vec::new(), plan_from(&fates), seed) {
            Ok(outcome) => {
                prop_assert!(expected, "succeeded although shareholders were missing: {fates:?}");
                // Exactly the clients that sent a masked input are in the sum.
                let contributed: Vec<ClientId> = outcome.aggregate.contributors.clone();
                prop_assert!(contributed.iter().all(|c| !matches!(fates[c.get() as usize - 1], 1..=3)));
            }
            Err(ProtocolError::BelowThreshold { .. }) => {
                prop_assert!(!expected, "failed although recovery was possible: {fates:?}");
            }
            Err(other) => prop_assert!(false, "unexpected error {other:?}"),
        }
    }
}

proptest! {
    #![proptest_config(proptest_config(64, 0x54a312))]

    #[test]
    fn any_t_shares_reconstruct_and_fewer_do_not(
        n in 2usize..40,
        t_fraction in 0.0f64..1.0,
        picks in proptest::collection::vec(any::<proptest::sample::Index>(), 40),
        seed in any::<u64>(),
    ) {
        let t = 1 + ((n - 1) as f64 * t_fraction) as usize;
        let mut rng = ChaCha20Rng::seed_from_u64(seed);
        let secret = Secret32::random(&mut rng);
        let points: Vec<u32> = (1..=n as u32).map(|x| x * 3 + 1).collect();
        let shares = split(&secret, t, &points, &mut rng);
        // A random subset of exactly t shares.
        let mut order: Vec<usize> = (0..n).collect();
        for (i, pick) in picks.iter().enumerate().take(n) {
            order.swap(i, i + pick.index(n - i));
        }
        let chosen: Vec<&Share> = order[..t].iter().map(|&i| &shares[i]).collect();
        let mut reconstructor = Reconstructor::new();
        prop_assert!(reconstructor.reconstruct(&chosen, t).unwrap() == secret);
        // t − 1 shares: refused, and interpolating them anyway gives another value.
        if t > 1 {
            let fewer = &chosen[..t - 1];
            prop_assert!(reconstructor.reconstruct(fewer, t).is_err());
            let guess = reconstructor.reconstruct(fewer, t - 1);
            prop_assert!(guess.map(|g| g != secret).unwrap_or(true));
        }
    }
}
