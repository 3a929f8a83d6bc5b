//! Private, validated rounds: each client proves its rounded vector within
//! the sensitivity Δ₂ before its noise, and its noise comes from edges its
//! verifiers committed to. An honest round's sum is the inputs plus that
//! noise; a client that adds anything else, or a verifier that attests
//! other noise, fails the sum check; a verifier that leaves an attestation
//! out is refused.

use crate::common::driver::Driver;
use crate::common::*;
use cohort_crypto::dp::{DpParams, Mechanism};
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::quantize::lift;
use cohort_crypto::simulation::{DropoutPlan, plain_sum};
use cohort_crypto::validation::noise::{NOISE_EDGES, NoiseVerifiers};
use cohort_crypto::validation::{Commitment, RoundValidation};
use cohort_crypto::{ClientId, ClientMessage, ProtocolError, QuantizedInput, RoundConfig, Transform};

fn dp(noise_shares: u32) -> DpParams {
    DpParams {
        mechanism: Mechanism::Skellam,
        clip_norm: 1.0,
        noise_multiplier: 1.0,
        scale: 60.0,
        noise_shares,
    }
}

/// A private round of `clients` with validation, 200 coordinates padded to
/// 256, in a 24-bit ring (wide enough that its sums never wrap).
fn private_config(clients: u32, threshold: u32, graph: GraphSpec) -> RoundConfig {
    let mut config = config(clients, threshold, graph, 200, 24);
    config.quantization.transform = Transform::Rotate { block: 64, seed: [5; 32] };
    config.quantization.privacy = Some(dp(threshold.min(4)));
    validated(&mut config, 1.0);
    config
}

fn share_keys(bytes: &[u8]) -> ClientMessage {
    ClientMessage::decode(bytes).unwrap()
}

/// The noise in `sum`: the aggregate minus the contributors' inputs, read
/// as signed integers.
fn noise_in(config: &RoundConfig, seed: u64, contributors: &[ClientId], sum: &[u32]) -> Vec<i64> {
    let cfg = config.clone();
    let inputs = move |id: ClientId| input_for(&cfg, seed, id);
    let plain = plain_sum(config, contributors, &inputs);
    sum.iter()
        .zip(&plain)
        .map(|(&s, &p)| lift(s.wrapping_sub(p) & config.modulus_mask(), config.modulus_bits))
        .collect()
}

#[test]
fn a_private_validated_round_sums_the_inputs_and_their_edges_noise() {
    for graph in [GraphSpec::Complete, GraphSpec::Harary { degree: 6 }] {
        let config = private_config(12, 4, graph.clone());
        let validation = RoundValidation::new(&config).unwrap().unwrap();
        // Client 3 advertises and vanishes (a verifier of some clients
        // never attests), client 7 after its shares, client 11 after its
        // masked input.
        let plan = DropoutPlan {
            after_keys: ids(&[3]),
            after_shares: ids(&[7]),
            after_masked_input: ids(&[11]),
            ..DropoutPlan::default()
        };
        let seed = 21;
        let outcome = run(&config, Vec::new(), plan, seed).unwrap();
        let aggregate = &outcome.aggregate;
        assert!(aggregate.refused.is_empty());
        // Clients 3 and 7 never masked; 11 did (its self mask is rebuilt).
        // Every client kept two verifiers here, so ten contribute.
        assert_eq!(aggregate.contributors.len(), 10, "{graph:?}");
        assert_eq!(aggregate.sum.len(), validation.dimension());
        // The noise is that of the contributors: NOISE_EDGES edges of
        // variance σ²/NOISE_EDGES each, σ² = (z·Δ₂)²/m per client.
        let noise = noise_in(&config, seed, &aggregate.contributors, &aggregate.sum);
        let expected = 10.0 * validation.edge_variance().unwrap() * NOISE_EDGES as f64;
        let per_client = dp(4).local_variance(validation.dimension());
        assert!((expected - 10.0 * per_client).abs() < 1e-6 * expected);
        let m = noise.len() as f64;
        let mean = noise.iter().map(|&e| e as f64).sum::<f64>() / m;
        let variance = noise.iter().map(|&e| (e as f64 - mean).powi(2)).sum::<f64>() / (m - 1.0);
        // 256 draws: the sample variance is within 4 standard errors
        // (√(2/255) ≈ 8.9 %) of the truth.
        assert!(
            (variance / expected - 1.0).abs() < 0.36,
            "{graph:?}: variance {variance} against {expected}"
        );
        assert!(mean.abs() < 4.0 * (expected / m).sqrt(), "{graph:?}: mean {mean}");
        assert!(noise.iter().any(|&e| e != 0), "the sum carries noise");
    }
}

#[test]
fn noise_beyond_the_edges_fails_the_sum_check() {
    let config = private_config(8, 4, GraphSpec::Complete);
    let mut driver = Driver::start(&config, &[], 3);
    driver.stage(); // AdvertiseKeys → ShareKeys in the outbox
    driver.stage(); // ShareKeys → masked inputs in the outbox
    // Client 5 adds a vector of its own to its masked input (a scaled
    // update, or noise it chose): 40 steps on every coordinate, well within
    // the noise's spread coordinate by coordinate.
    let ClientMessage::MaskedInput { context, mut vector } = share_keys(driver.outbox[4].as_ref().unwrap())
    else {
        panic!("not a masked input");
    };
    let dimension = config.quantization.validation.unwrap().dimension as usize;
    for v in &mut vector.values[..dimension] {
        *v = v.wrapping_add(40) & config.modulus_mask();
    }
    driver.outbox[4] = Some(ClientMessage::MaskedInput { context, vector }.encode());
    driver.flush();
    driver.advance().unwrap();
    driver.deliver_all();
    driver.flush();
    match driver.advance() {
        Err(ProtocolError::CommitmentMismatch { suspects }) => {
            assert_eq!(suspects, ids(&[1, 2, 3, 4, 5, 6, 7, 8]))
        }
        other => panic!("the round should fail its sum check, got {other:?}"),
    }
}

#[test]
fn a_verifier_that_attests_other_noise_fails_the_sum_check() {
    let config = private_config(8, 4, GraphSpec::Complete);
    let mut driver = Driver::start(&config, &[], 4);
    driver.stage();
    // The first verifier of client 2's noise attests another client's
    // commitment in its place (a well-formed commitment to the wrong
    // noise), on an edge that client 2 adds.
    let verifiers = NoiseVerifiers::new(&config).unwrap();
    let owner = id(2);
    let liar = verifiers.of(owner)[0];
    let ClientMessage::ShareKeys { context, envelopes, proof, mut noise } =
        share_keys(driver.outbox[liar.index()].as_ref().unwrap())
    else {
        panic!("not a ShareKeys message");
    };
    let at = noise.iter().position(|a| a.owner == owner).expect("the verifier attests client 2's edge");
    let other = noise.iter().position(|a| a.owner != owner).map_or_else(
        || {
            let ClientMessage::ShareKeys { noise, .. } =
                share_keys(driver.outbox[owner.index()].as_ref().unwrap())
            else {
                unreachable!()
            };
            noise[0].commitment.clone()
        },
        |i| noise[i].commitment.clone(),
    );
    assert_ne!(noise[at].commitment, other);
    noise[at].commitment = other;
    driver.outbox[liar.index()] =
        Some(ClientMessage::ShareKeys { context, envelopes, proof, noise }.encode());
    driver.flush();
    driver.advance().unwrap();
    driver.deliver_all();
    match (|| {
        loop {
            driver.flush();
            if let Some(aggregate) = driver.advance()? {
                return Ok(aggregate);
            }
            driver.deliver_all();
        }
    })() {
        Err(ProtocolError::CommitmentMismatch { .. }) => {}
        other => panic!("the round should fail its sum check, got {other:?}"),
    }
}

#[test]
fn a_verifier_that_leaves_out_or_mangles_an_attestation_is_refused() {
    let config = private_config(8, 4, GraphSpec::Complete);
    let validation = RoundValidation::new(&config).unwrap().unwrap();
    let mut driver = Driver::start(&config, &[], 5);
    driver.stage();
    let original = driver.outbox[2].take().unwrap();
    let rebuild = |change: &dyn Fn(&mut Vec<cohort_crypto::NoiseAttestation>)| {
        let ClientMessage::ShareKeys { context, envelopes, proof, mut noise } = share_keys(&original) else {
            unreachable!()
        };
        change(&mut noise);
        ClientMessage::ShareKeys { context, envelopes, proof, noise }.encode()
    };
    let dropped = rebuild(&|noise| {
        noise.pop();
    });
    let short = rebuild(&|noise| {
        noise[0].commitment.pop();
    });
    let not_a_point = rebuild(&|noise| {
        noise[0].commitment[..32].copy_from_slice(&[0xff; 32]);
    });
    let renamed = rebuild(&|noise| {
        let owner = noise[0].owner;
        noise[0].owner = if owner.get() == 1 { ClientId::new(2).unwrap() } else { ClientId::new(1).unwrap() };
        noise.sort_by_key(|a| a.owner);
        noise.dedup_by_key(|a| a.owner);
    });
    for bytes in [&dropped, &short, &not_a_point, &renamed] {
        match driver.send(3, bytes) {
            Err(ProtocolError::InvalidMessage { .. }) | Err(ProtocolError::Decode(_)) => {}
            other => panic!("a bad attestation list is refused, got {other:?}"),
        }
    }
    // The honest message is still taken, and its attestations decode.
    let ClientMessage::ShareKeys { noise, .. } = share_keys(&original) else { unreachable!() };
    for attestation in &noise {
        Commitment::decode(validation.bound(), &attestation.commitment).unwrap();
    }
    driver.send(3, &original).unwrap();
}

#[test]
fn a_client_left_with_one_verifier_cannot_mask_and_is_not_counted() {
    let config = private_config(8, 3, GraphSpec::Complete);
    let verifiers = NoiseVerifiers::new(&config).unwrap();
    let target = ClientId::new(4).unwrap();
    let of_target = verifiers.of(target);
    assert_eq!(of_target.len(), 3);
    assert!(!of_target.contains(&target));
    let mut driver = Driver::start(&config, &[], 6);
    driver.stage();
    // Two of client 4's three verifiers never send their shares.
    for j in &of_target[..2] {
        driver.outbox[j.index()] = None;
        driver.clients[j.index()] = None;
    }
    driver.flush();
    driver.advance().unwrap();
    let message = driver.server().message_for(target).unwrap();
    let state = driver.clients[target.index()].take().unwrap();
    let (_, reply) = state.handle(message, &mut driver.rngs[target.index()]);
    assert!(matches!(reply, Err(ProtocolError::Validation(_))), "{reply:?}");
    // A client that masks anyway (here with another's masked vector) is
    // refused: the coordinator would not know which noise it carries.
    let other = (1..=8).map(id).find(|&c| c != target && driver.clients[c.index()].is_some()).unwrap();
    let message = driver.server().message_for(other).unwrap();
    driver.deliver(other.get(), message).unwrap();
    let bytes = driver.outbox[other.index()].take().unwrap();
    assert!(matches!(driver.send(target.get(), &bytes), Err(ProtocolError::InvalidMessage { .. })));
    driver.send(other.get(), &bytes).unwrap();
}

#[test]
fn a_private_client_over_the_sensitivity_cannot_prove_its_input() {
    let config = private_config(4, 2, GraphSpec::Complete);
    let validation = RoundValidation::new(&config).unwrap().unwrap();
    let mut driver = Driver::start(&config, &[], 7);
    // A vector of squared norm ⌊Δ₂²⌋ + 1 (in the ring's signed values).
    let dimension = validation.dimension();
    let bound_sq = validation.bound().bound_sq();
    let big = bound_sq.isqrt() as u32 + 1;
    let mut values = vec![0u32; dimension];
    values[0] = big;
    let setup = driver.server().setup_message();
    let (state, _) = cohort_crypto::Client::start(
        setup,
        id(2),
        None,
        QuantizedInput::from_values(values),
        &mut driver.rngs[1],
    )
    .unwrap();
    driver.flush();
    driver.advance().unwrap();
    let peers = driver.server().message_for(id(2)).unwrap();
    let (_, reply) = state.handle(peers, &mut driver.rngs[1]);
    assert!(matches!(reply, Err(ProtocolError::Validation(_))), "{reply:?}");
}

#[test]
fn verifiers_are_three_neighbours_fixed_by_the_round() {
    for graph in [GraphSpec::Complete, GraphSpec::Harary { degree: 6 }] {
        let config = private_config(30, 10, graph.clone());
        let verifiers = NoiseVerifiers::new(&config).unwrap();
        let tabulated = NoiseVerifiers::new(&config).unwrap().tabulated();
        let graph_of = config.communication_graph();
        let mut verified_by = vec![0usize; 30];
        for i in 1..=30 {
            let u = id(i);
            let of = verifiers.of(u);
            assert_eq!(of, tabulated.of(u));
            assert_eq!(of.len(), 3);
            assert!(
                of.iter().all(|&j| graph_of.are_neighbours(u, j)),
                "{graph:?}: a verifier is a neighbour"
            );
            let mut distinct = of.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 3);
            of.iter().for_each(|j| verified_by[j.index()] += 1);
            // The first two that completed, in rank order.
            assert_eq!(verifiers.edges(u, |_| true).unwrap(), of[..2].to_vec());
            assert_eq!(verifiers.edges(u, |j| j != of[0]).unwrap(), vec![of[1], of[2]]);
            assert_eq!(verifiers.edges(u, |j| j == of[2]), None);
        }
        // Another round places them elsewhere.
        let mut next = config.clone();
        next.round += 1;
        let moved = NoiseVerifiers::new(&next).unwrap();
        assert!((1..=30).any(|i| moved.of(id(i)) != verifiers.of(id(i))), "{graph:?}");
        if graph == GraphSpec::Complete {
            // On the ring every client verifies exactly three others.
            assert!(verified_by.iter().all(|&k| k == 3));
        }
    }
    // Fewer than three neighbours: refused.
    let mut small = private_config(8, 3, GraphSpec::Complete);
    small.graph = GraphSpec::Harary { degree: 2 };
    assert!(NoiseVerifiers::new(&small).is_err());
}
