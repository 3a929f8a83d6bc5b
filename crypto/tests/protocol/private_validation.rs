//! Private, validated rounds: each client proves its rounded vector within
//! the sensitivity Δ₂ before its noise, and its noise comes from edges its
//! verifiers committed to. An honest round's sum is the inputs plus that
//! noise; a client that adds anything else fails the sum check; an edge
//! whose two ends commit to different noise leaves both out; a client that
//! leaves a commitment out is refused.

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
fn a_client_that_leaves_out_or_mangles_a_noise_commitment_is_refused() {
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
    // Its own three edges and the three it verifies.
    let ClientMessage::ShareKeys { noise, .. } = share_keys(&original) else { unreachable!() };
    assert_eq!(noise.iter().filter(|a| a.owner == id(3)).count(), 3);
    assert_eq!(noise.iter().filter(|a| a.verifier == id(3)).count(), 3);
    let dropped = rebuild(&|noise| {
        noise.pop();
    });
    // The commitments it attests (row commitments) and the digests of its
    // own edges' commitments.
    let attested = noise.iter().position(|a| a.verifier == id(3)).unwrap();
    let own = noise.iter().position(|a| a.owner == id(3)).unwrap();
    assert_eq!(noise[own].commitment.len(), 32);
    assert_eq!(noise[attested].commitment.len(), Commitment::encoded_len(validation.bound()));
    let short = rebuild(&|noise| {
        noise[attested].commitment.pop();
    });
    let short_digest = rebuild(&|noise| {
        noise[own].commitment.pop();
    });
    let not_a_point = rebuild(&|noise| {
        noise[attested].commitment[..32].copy_from_slice(&[0xff; 32]);
    });
    // An edge the client is no end of, in place of one it is.
    let elsewhere = rebuild(&|noise| {
        let last = noise.len() - 1;
        noise[last].owner = id(8);
        noise[last].verifier = id(7);
        noise.sort_by_key(|a| (a.owner, a.verifier));
    });
    for bytes in [&dropped, &short, &short_digest, &not_a_point, &elsewhere] {
        match driver.send(3, bytes) {
            Err(ProtocolError::InvalidMessage { .. }) | Err(ProtocolError::Decode(_)) => {}
            other => panic!("a bad list of noise commitments is refused, got {other:?}"),
        }
    }
    // Out of order: it does not decode.
    let reversed = rebuild(&|noise| noise.reverse());
    assert!(ClientMessage::decode(&reversed).is_err());
    // The honest message is still taken, and its commitments decode.
    for attestation in noise.iter().filter(|a| a.verifier == id(3)) {
        Commitment::decode(validation.bound(), &attestation.commitment).unwrap();
    }
    driver.send(3, &original).unwrap();
}

/// Replaces the commitment to edge (owner, verifier) in the ShareKeys that
/// `sender` (one of its ends) sends by `with`.
fn swap_commitment(driver: &mut Driver, sender: ClientId, edge: (ClientId, ClientId), with: Vec<u8>) {
    let ClientMessage::ShareKeys { context, envelopes, proof, mut noise } =
        share_keys(driver.outbox[sender.index()].as_ref().unwrap())
    else {
        panic!("not a ShareKeys message");
    };
    let at = noise.iter().position(|a| (a.owner, a.verifier) == edge).unwrap();
    assert_ne!(noise[at].commitment, with);
    noise[at].commitment = with;
    driver.outbox[sender.index()] =
        Some(ClientMessage::ShareKeys { context, envelopes, proof, noise }.encode());
}

/// Another well-formed commitment (or digest) of the same kind from
/// `sender`'s message than edge's.
fn another_commitment(driver: &Driver, sender: ClientId, edge: (ClientId, ClientId)) -> Vec<u8> {
    let ClientMessage::ShareKeys { noise, .. } = share_keys(driver.outbox[sender.index()].as_ref().unwrap())
    else {
        unreachable!()
    };
    let kind = |a: &cohort_crypto::NoiseAttestation| a.owner == sender;
    let of_edge = noise.iter().find(|a| (a.owner, a.verifier) == edge).map(kind).unwrap();
    noise.into_iter().find(|a| (a.owner, a.verifier) != edge && kind(a) == of_edge).unwrap().commitment
}

/// Runs the remaining stages; a client that cannot go on (left with too
/// few noise verifiers) drops out.
fn rest(driver: &mut Driver) -> Result<cohort_crypto::Aggregate, ProtocolError> {
    loop {
        driver.flush();
        if let Some(aggregate) = driver.advance()? {
            return Ok(aggregate);
        }
        for i in 1..=driver.config.clients {
            if driver.clients[i as usize - 1].is_none() {
                continue;
            }
            let delivered = match driver.server().message_for(id(i)) {
                Some(message) => driver.deliver(i, message).is_ok(),
                None => false,
            };
            if !delivered {
                driver.vanish(i);
            }
        }
    }
}

/// The attack a lone verifier could mount if only it committed to an
/// edge: attest the edge's noise shifted by δ and add δ to its own input,
/// so that the sum check balances. Both ends commit to every edge; where
/// they differ, the edge is disputed, both ends are left out of the round
/// and named, and the others' sum is exact. The same when the owner lies.
#[test]
fn an_edge_whose_ends_commit_to_different_noise_leaves_both_out() {
    let config = private_config(8, 3, GraphSpec::Complete);
    let verifiers = NoiseVerifiers::new(&config).unwrap();
    for liar_is_owner in [false, true] {
        let mut driver = Driver::start(&config, &[], 4);
        driver.stage();
        let owner = id(2);
        let verifier = verifiers.of(owner)[0];
        let edge = (owner, verifier);
        let liar = if liar_is_owner { owner } else { verifier };
        let other = another_commitment(&driver, liar, edge);
        swap_commitment(&mut driver, liar, edge, other);
        let aggregate = rest(&mut driver).unwrap();
        let mut out = vec![owner, verifier];
        out.sort();
        assert_eq!(aggregate.refused, out, "both ends are named");
        assert_eq!(aggregate.disputed, vec![edge]);
        assert!(aggregate.contributors.iter().all(|c| !out.contains(c)));
        // A client whose verifiers were two of those left out cannot mask.
        assert!(aggregate.contributors.len() >= 4, "{:?}", aggregate.contributors);
        // The others' sum opened their commitments (the sum check passed),
        // their noise included.
        let noise = noise_in(&config, 4, &aggregate.contributors, &aggregate.sum);
        assert!(noise.iter().any(|&e| e != 0));
    }
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
    let reply = driver.share_keys_with(2, QuantizedInput::from_values(values));
    assert!(matches!(reply, Err(ProtocolError::Validation(_))), "{reply:?}");
}

#[test]
fn verifiers_are_three_neighbours_fixed_by_the_round() {
    for graph in [GraphSpec::Complete, GraphSpec::Harary { degree: 6 }] {
        let config = private_config(30, 10, graph.clone());
        let verifiers = NoiseVerifiers::new(&config).unwrap();
        let graph_of = config.communication_graph();
        for i in 1..=30 {
            let u = id(i);
            let of = verifiers.of(u);
            assert_eq!(of.len(), 3);
            assert!(
                of.iter().all(|&j| graph_of.are_neighbours(u, j)),
                "{graph:?}: a verifier is a neighbour"
            );
            let mut distinct = of.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 3);
            // Every client verifies exactly three others, and the two views
            // agree.
            let owners = verifiers.verified_by(u);
            assert_eq!(owners.len(), 3);
            assert!(owners.iter().all(|&w| verifiers.of(w).contains(&u)));
            assert!(of.iter().all(|&j| verifiers.verified_by(j).contains(&u)));
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
    }
    // Degree 4: the next two and the previous one, all neighbours.
    let config = private_config(30, 10, GraphSpec::Harary { degree: 4 });
    let verifiers = NoiseVerifiers::new(&config).unwrap();
    let graph_of = config.communication_graph();
    for i in 1..=30 {
        assert!(verifiers.of(id(i)).iter().all(|&j| graph_of.are_neighbours(id(i), j)));
        assert_eq!(verifiers.verified_by(id(i)).len(), 3);
    }
    // Fewer than three neighbours: refused.
    let mut small = private_config(8, 3, GraphSpec::Complete);
    small.graph = GraphSpec::Harary { degree: 2 };
    assert!(NoiseVerifiers::new(&small).is_err());
}
