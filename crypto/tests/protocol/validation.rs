//! Validated rounds: every client proves its masked input within the
//! round's norm bound; a refused proof leaves its client out, and an input
//! masked other than it was committed fails the round's sum check.

use crate::common::driver::Driver;
use crate::common::*;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::simulation::{DropoutPlan, plain_sum};
use cohort_crypto::{
    Aggregate, Client, ClientId, ClientMessage, ProtocolError, QuantizedInput, ServerMessage,
};

fn validated_config(
    clients: u32,
    threshold: u32,
    graph: GraphSpec,
    dimension: u32,
) -> cohort_crypto::RoundConfig {
    validated_in(clients, threshold, graph, dimension, 18)
}

fn validated_in(
    clients: u32,
    threshold: u32,
    graph: GraphSpec,
    dimension: u32,
    bits: u8,
) -> cohort_crypto::RoundConfig {
    let mut config = config(clients, threshold, graph, dimension, bits);
    validated(&mut config, 0.5);
    config
}

fn expect_plain_sum(driver: &Driver, aggregate: &Aggregate) {
    let cfg = driver.config.clone();
    let seed = driver.seed;
    let inputs = move |id: ClientId| input_for(&cfg, seed, id);
    assert_eq!(aggregate.sum, plain_sum(&driver.config, &aggregate.contributors, &inputs));
}

/// Runs stages until the masked inputs wait in the outbox; `tamper` may
/// change each client's ShareKeys bytes first.
fn to_share_keys(driver: &mut Driver) {
    driver.stage(); // AdvertiseKeys → every client's ShareKeys in the outbox
}

fn reencode_share_keys(bytes: &[u8], change: impl FnOnce(&mut Option<Vec<u8>>)) -> Vec<u8> {
    let ClientMessage::ShareKeys { context, envelopes, mut proof, noise } =
        ClientMessage::decode(bytes).unwrap()
    else {
        panic!("not a ShareKeys message");
    };
    change(&mut proof);
    ClientMessage::ShareKeys { context, envelopes, proof, noise }.encode()
}

#[test]
fn a_validated_round_sums_what_its_clients_proved() {
    // An 18-bit ring (8-bit values) and the default 32-bit one, whose
    // values and bound are far larger.
    for (graph, bits) in
        [(GraphSpec::Complete, 18), (GraphSpec::Harary { degree: 6 }, 18), (GraphSpec::Complete, 32)]
    {
        let config = validated_in(10, 4, graph, 300, bits);
        let plan =
            DropoutPlan { after_shares: ids(&[2]), after_masked_input: ids(&[9]), ..DropoutPlan::default() };
        let outcome = run_and_check(&config, Vec::new(), plan, 3).unwrap();
        assert!(outcome.aggregate.refused.is_empty());
        assert_eq!(outcome.aggregate.contributors.len(), 9);
        assert!(
            outcome.aggregate.sum.len() < config.vector_len as usize,
            "the blindings' tail is not part of the sum"
        );
    }
}

#[test]
fn a_forged_or_borrowed_proof_is_refused_and_its_client_left_out() {
    let config = validated_config(8, 3, GraphSpec::Complete, 120);
    let mut driver = Driver::start(&config, &[], 5);
    to_share_keys(&mut driver);
    // Client 3 changes one byte of its proof; client 5 sends client 6's
    // (a proof bound to another client); client 7 sends none.
    let borrowed = match ClientMessage::decode(driver.outbox[5].as_ref().unwrap()).unwrap() {
        ClientMessage::ShareKeys { proof, .. } => proof,
        _ => unreachable!(),
    };
    // A byte of the inner-product argument: the proof decodes, and fails
    // when the stage's proofs are verified.
    let forged = reencode_share_keys(driver.outbox[2].as_ref().unwrap(), |proof| {
        let bytes = proof.as_mut().unwrap();
        let at = bytes.len() - 69;
        bytes[at] ^= 1;
    });
    // A proof cut short does not even decode: refused on arrival.
    let truncated = reencode_share_keys(driver.outbox[2].as_ref().unwrap(), |proof| {
        proof.as_mut().unwrap().pop();
    });
    driver.outbox[2] = Some(forged);
    driver.outbox[4] =
        Some(reencode_share_keys(driver.outbox[4].as_ref().unwrap(), |proof| *proof = borrowed));
    let missing = reencode_share_keys(driver.outbox[6].as_ref().unwrap(), |proof| *proof = None);
    driver.outbox[6] = None;
    assert!(matches!(driver.send(3, &truncated), Err(ProtocolError::InvalidMessage { .. })));
    driver.flush();
    assert!(matches!(driver.send(7, &missing), Err(ProtocolError::InvalidMessage { .. })));
    driver.advance().unwrap();
    driver.deliver_all();
    let aggregate = driver.finish();
    assert_eq!(aggregate.refused, ids(&[3, 5]));
    assert_eq!(aggregate.contributors, ids(&[1, 2, 4, 6, 8]));
    expect_plain_sum(&driver, &aggregate);
}

#[test]
fn an_input_masked_other_than_it_was_committed_fails_the_sum_check() {
    let config = validated_config(6, 3, GraphSpec::Complete, 64);
    let mut driver = Driver::start(&config, &[], 7);
    to_share_keys(&mut driver);
    driver.stage(); // ShareKeys → masked inputs in the outbox
    // Client 4 adds 1 to a coordinate of its masked vector: its input is no
    // longer the vector it committed to and proved.
    let ClientMessage::MaskedInput { context, mut vector } =
        ClientMessage::decode(driver.outbox[3].as_ref().unwrap()).unwrap()
    else {
        panic!("not a masked input");
    };
    vector.values[10] = vector.values[10].wrapping_add(1) & config.modulus_mask();
    driver.outbox[3] = Some(ClientMessage::MaskedInput { context, vector }.encode());
    driver.flush();
    driver.advance().unwrap();
    driver.deliver_all();
    driver.flush();
    match driver.advance() {
        Err(ProtocolError::CommitmentMismatch { suspects }) => assert_eq!(suspects, ids(&[1, 2, 3, 4, 5, 6])),
        other => panic!("the round should fail its sum check, got {other:?}"),
    }
}

#[test]
fn a_client_whose_input_exceeds_the_bound_cannot_prove_it() {
    let config = validated_config(4, 2, GraphSpec::Complete, 50);
    let mut driver = Driver::start(&config, &[], 9);
    // Every value at the top of the range: far above the L2 clip of 0.5.
    let dimension = config.quantization.validation.unwrap().dimension as usize;
    let limit = ((1u32 << config.modulus_bits) - 1) / config.clients;
    let reply = driver.share_keys_with(2, QuantizedInput::from_values(vec![limit; dimension]));
    assert!(matches!(reply, Err(ProtocolError::Validation(_))), "{reply:?}");
    // An input of the whole vector's length (tail included) is refused.
    let setup: ServerMessage = driver.server().setup_message();
    let wrong = QuantizedInput::from_values(vec![0; config.vector_len as usize]);
    assert!(matches!(
        Client::start(setup, id(3), None, wrong, &mut driver.rngs[2]),
        Err(ProtocolError::InputLength { .. })
    ));
}
