//! Whole rounds: correctness with and without dropouts, for both graphs and
//! both variants.

use crate::common::*;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::simulation::DropoutPlan;
use cohort_crypto::{ProtocolError, Stage};

#[test]
fn complete_graph_without_dropouts() {
    let config = config(8, 5, GraphSpec::Complete, 100, 32);
    let outcome = run_and_check(&config, Vec::new(), DropoutPlan::default(), 1).unwrap();
    assert_eq!(outcome.aggregate.contributors.len(), 8);
    assert!(outcome.clients.iter().all(|c| c.finished));
}

#[test]
fn sparse_graph_without_dropouts() {
    let config = config(40, 5, GraphSpec::Harary { degree: 10 }, 64, 24);
    let outcome = run_and_check(&config, Vec::new(), DropoutPlan::default(), 2).unwrap();
    assert_eq!(outcome.aggregate.contributors.len(), 40);
}

#[test]
fn dropouts_at_every_stage_are_recovered() {
    for graph in [GraphSpec::Complete, GraphSpec::Harary { degree: 16 }] {
        let config = config(30, 8, graph.clone(), 33, 32);
        let plan = DropoutPlan {
            before_keys: ids(&[1]),
            after_keys: ids(&[2, 3]),
            after_shares: ids(&[4, 5, 6]),
            after_masked_input: ids(&[7, 8]),
            after_consistency: Vec::new(),
        };
        let outcome = run_and_check(&config, Vec::new(), plan, 3).unwrap();
        // Clients that sent a masked input are in the sum, including those
        // that vanished before unmasking.
        let expected: Vec<u32> = (4..=30).filter(|i| !(4..=6).contains(i)).collect();
        assert_eq!(outcome.aggregate.contributors, ids(&expected), "{graph:?}");
    }
}

#[test]
fn active_variant_round_with_dropouts() {
    let mut config = config(12, 7, GraphSpec::Complete, 20, 32);
    let identities = make_active(&mut config, 5);
    let plan = DropoutPlan {
        after_shares: ids(&[3]),
        after_masked_input: ids(&[4]),
        after_consistency: ids(&[5]),
        ..DropoutPlan::default()
    };
    let outcome = run_and_check(&config, identities, plan, 4).unwrap();
    assert_eq!(outcome.aggregate.contributors.len(), 11);
}

/// A survivor reveals its own share of its self-mask seed with its
/// neighbours' (b_u is shared with u itself too), so a round of three with
/// t = 2 survives a client that drops after sharing keys: each survivor's
/// seed is rebuilt from its one surviving neighbour and itself, the
/// dropped client's mask key from both survivors. Both variants.
#[test]
fn three_clients_with_threshold_two_survive_a_dropout_after_sharing_keys() {
    for active in [false, true] {
        let mut config = config(3, 2, GraphSpec::Complete, 16, 32);
        let identities = if active { make_active(&mut config, 13) } else { Vec::new() };
        let plan = DropoutPlan { after_shares: ids(&[3]), ..DropoutPlan::default() };
        let outcome = run_and_check(&config, identities, plan, 12).unwrap();
        assert_eq!(outcome.aggregate.contributors, ids(&[1, 2]), "active: {active}");
        assert!(outcome.aggregate.faulty_shares.is_empty());
    }
}

/// Vectors longer than one piece of the server's input summation (2^16
/// values) and than one tile of its unmasking, with a tail that is no whole
/// AES block, in a packed ring and in Z_2^32: the sum is added piece by
/// piece and the masks of survivors and dropped clients removed tile by
/// tile, and the result is the plain sum.
#[test]
fn long_vectors_are_summed_in_pieces_and_unmasked_in_tiles() {
    for bits in [20u8, 32] {
        let config = config(10, 6, GraphSpec::Harary { degree: 8 }, 140_001, bits);
        let plan = DropoutPlan { after_shares: ids(&[2, 7]), ..DropoutPlan::default() };
        let outcome = run_and_check(&config, Vec::new(), plan, 21).unwrap();
        assert_eq!(outcome.aggregate.contributors.len(), 8);
        // 8 self masks and each dropped client's pairwise masks with its
        // surviving neighbours (every client has 8 of its 9 peers).
        assert!(outcome.aggregate.masks_removed > 8 + 2 * 6, "{}", outcome.aggregate.masks_removed);
    }
}

#[test]
fn small_rings_aggregate_without_wrapping() {
    use cohort_crypto::simulation::{NoStopwatch, Simulation};
    use cohort_crypto::{ClientId, QuantizedInput};

    // 10 clients in Z_{2^8}: each value at most ⌊255 / 10⌋ = 25. Every
    // third coordinate is 25 for every client, so its sum is 250 of the
    // ring's 255: the aggregate must be the integer sum itself, compared
    // unreduced (a reference taken mod 2^8 would hide a wrap).
    const DIM: u32 = 500;
    let config = config(10, 6, GraphSpec::Complete, DIM, 8);
    let value = |j: u32, id: ClientId| if j % 3 == 0 { 25 } else { (j + id.get()) % 26 };
    let inputs = |id: ClientId| QuantizedInput::from_values((0..DIM).map(|j| value(j, id)).collect());
    let run = Simulation {
        config,
        identities: Vec::new(),
        plan: DropoutPlan::default(),
        inputs: &inputs,
        seed: 6,
        tamper: None,
    };
    let outcome = run.run(&NoStopwatch).unwrap();
    assert_eq!(outcome.aggregate.contributors.len(), 10);
    let exact: Vec<u64> = (0..DIM)
        .map(|j| outcome.aggregate.contributors.iter().map(|&c| u64::from(value(j, c))).sum())
        .collect();
    assert_eq!(exact.iter().max(), Some(&250), "the inputs reach the headroom");
    let sum: Vec<u64> = outcome.aggregate.sum.iter().map(|&v| u64::from(v)).collect();
    assert_eq!(sum, exact, "the aggregate is not the integer sum of the inputs");
}

/// Claim 11: the client's headroom check is what keeps the sum from
/// wrapping. A value at ⌊(2^b − 1)/n⌋ is taken; one above it is refused
/// before the client sends anything (ten such values would pass 2^8).
#[test]
fn clients_refuse_inputs_above_the_headroom() {
    use cohort_crypto::{Client, QuantizedInput, ServerRound};
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    // 10 clients in Z_{2^8}: each value at most ⌊255 / 10⌋ = 25.
    let config = config(10, 6, GraphSpec::Complete, 4, 8);
    let setup = ServerRound::new(config.clone()).unwrap().setup_message();
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    let at_limit = QuantizedInput::from_values(vec![25, 0, 25, 3]);
    assert!(Client::start(setup.clone(), id(1), None, at_limit, &mut rng).is_ok());
    for above in [vec![0, 26, 0, 0], vec![0, 0, 0, u32::from(u8::MAX)], vec![0, 0, 0, u32::MAX]] {
        match Client::start(setup.clone(), id(1), None, QuantizedInput::from_values(above.clone()), &mut rng)
        {
            Err(ProtocolError::InvalidMessage { reason, .. }) => {
                assert!(reason.contains("headroom"), "{reason}")
            }
            Err(other) => panic!("{above:?}: {other:?}"),
            Ok(_) => panic!("{above:?} was accepted: ten such inputs wrap the sum"),
        }
    }
    // 4 clients in Z_{2^8}: at most ⌊255 / 4⌋ = 63. The bound is on 2^b − 1,
    // not 2^b: four inputs of 64 sum to 256 ≡ 0.
    let four = crate::common::config(4, 3, GraphSpec::Complete, 2, 8);
    let setup = ServerRound::new(four).unwrap().setup_message();
    let at_limit = QuantizedInput::from_values(vec![63, 63]);
    assert!(Client::start(setup.clone(), id(1), None, at_limit, &mut rng).is_ok());
    let wraps = QuantizedInput::from_values(vec![0, 64]);
    assert!(
        matches!(
            Client::start(setup, id(1), None, wraps, &mut rng),
            Err(ProtocolError::InvalidMessage { reason, .. }) if reason.contains("headroom")
        ),
        "64 was accepted: four such inputs wrap the sum to 0"
    );
    // A fitted ring (10 clients in Z_{2^9}, the update's 4 coordinates then
    // the example count's digits): the update part may hold any value of the
    // ring (its sum wraps by design), the example count's digits still at
    // most ⌊511 / 10⌋ = 51, and nothing beyond the ring.
    let mut fitted = crate::common::config(10, 6, GraphSpec::Complete, 4, 9);
    fitted.quantization.transform = cohort_crypto::Transform::Rotate { block: 4, seed: [1; 32] };
    fitted.quantization.scale = Some(10.0);
    let quantizer =
        cohort_crypto::Quantizer::new(fitted.quantization, fitted.modulus_bits, fitted.clients).unwrap();
    fitted.vector_len = quantizer.encoded_len(4) as u32;
    assert_eq!(fitted.vector_len, 5, "four coordinates and one digit of the example count");
    let setup = ServerRound::new(fitted).unwrap().setup_message();
    let wide = QuantizedInput::from_values(vec![511, 300, 0, 52, 51]);
    assert!(Client::start(setup.clone(), id(1), None, wide, &mut rng).is_ok());
    for above in [vec![0, 0, 0, 0, 52], vec![512, 0, 0, 0, 1]] {
        assert!(
            matches!(
                Client::start(setup.clone(), id(1), None, QuantizedInput::from_values(above.clone()), &mut rng),
                Err(ProtocolError::InvalidMessage { reason, .. }) if reason.contains("headroom")
            ),
            "{above:?} was accepted"
        );
    }
}

#[test]
fn too_many_dropouts_end_the_round_without_unmasking() {
    let config = config(10, 6, GraphSpec::Complete, 10, 32);
    let plan = DropoutPlan { after_shares: ids(&[1, 2, 3, 4, 5]), ..DropoutPlan::default() };
    let error = run(&config, Vec::new(), plan, 7).unwrap_err();
    assert_eq!(
        error,
        ProtocolError::BelowThreshold { stage: Stage::MaskedInputCollection, have: 5, need: 6 }
    );
}

#[test]
fn too_few_shareholders_at_unmasking_is_refused() {
    let config = config(10, 6, GraphSpec::Complete, 10, 32);
    let plan = DropoutPlan { after_masked_input: ids(&[1, 2, 3, 4, 5]), ..DropoutPlan::default() };
    let error = run(&config, Vec::new(), plan, 8).unwrap_err();
    assert!(matches!(error, ProtocolError::BelowThreshold { stage: Stage::Unmasking, .. }), "{error:?}");
}

#[test]
fn messages_are_bound_to_their_round() {
    let a = config(5, 3, GraphSpec::Complete, 4, 32);
    let mut b = a.clone();
    b.round = 2;
    assert_ne!(a.context(), b.context());
    let mut c = a.clone();
    c.threshold = 4;
    assert_ne!(a.context(), c.context());
}

#[test]
fn stopping_before_unmasking_then_advancing_gives_the_same_sum() {
    use cohort_crypto::simulation::Simulation;
    use cohort_crypto::{Advanced, Stage};
    let config = config(20, 6, GraphSpec::Harary { degree: 10 }, 50, 32);
    let plan = DropoutPlan { after_shares: ids(&[3, 9]), ..DropoutPlan::default() };
    let full = run(&config, Vec::new(), plan.clone(), 11).unwrap();
    let cfg = config.clone();
    let inputs = move |id: cohort_crypto::ClientId| input_for(&cfg, 11, id);
    let simulation = Simulation {
        config: config.clone(),
        identities: Vec::new(),
        plan,
        inputs: &inputs,
        seed: 11,
        tamper: None,
    };
    let server = simulation.run_to_unmasking().unwrap();
    assert_eq!(server.stage(), Stage::Unmasking);
    assert!(server.is_complete());
    let Advanced::Done(aggregate) = server.advance().unwrap() else { panic!("expected the aggregate") };
    assert_eq!(aggregate, full.aggregate);
}

/// Claim 33: nothing in the announced round picks the placement. It is a
/// function of the round context, so every client computes the same graph
/// from the parameters it checks, and a different placement needs a
/// different round.
#[test]
fn the_graph_placement_follows_from_the_round_and_nothing_else() {
    let base = config(40, 6, GraphSpec::Harary { degree: 10 }, 8, 32);
    let neighbourhoods = |config: &cohort_crypto::RoundConfig| {
        let graph = config.communication_graph();
        (1..=config.clients).map(|i| graph.neighbours(id(i))).collect::<Vec<_>>()
    };
    // The same round, announced twice or decoded from the wire, places
    // everybody the same way.
    let setup = cohort_crypto::ServerMessage::Setup(base.clone()).encode();
    let Ok(cohort_crypto::ServerMessage::Setup(decoded)) = cohort_crypto::ServerMessage::decode(&setup)
    else {
        panic!("the setup does not decode");
    };
    assert_eq!(neighbourhoods(&decoded), neighbourhoods(&base));
    assert_eq!(decoded.placement_seed(), base.placement_seed());
    // Changing anything else about the round moves clients.
    let mut next_round = base.clone();
    next_round.round = 2;
    let mut other_session = base.clone();
    other_session.session[0] ^= 1;
    let mut active = base.clone();
    make_active(&mut active, 3);
    for (what, other) in [("round", next_round), ("session", other_session), ("roster", active)] {
        assert_ne!(other.placement_seed(), base.placement_seed(), "{what}");
        assert_ne!(neighbourhoods(&other), neighbourhoods(&base), "{what}");
    }
}
