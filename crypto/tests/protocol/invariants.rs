//! The protocol's invariants under misbehaving peers: duplicates, replays,
//! out-of-phase and foreign messages, a lying server, and the rule that an
//! honest client never reveals both shares of a neighbour.

use crate::common::driver::Driver;
use crate::common::*;
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::simulation::plain_sum;
use cohort_crypto::{Client, ClientId, ClientMessage, ProtocolError, ServerMessage, Stage};

fn check_sum(driver: &Driver, aggregate: &cohort_crypto::Aggregate) {
    let cfg = driver.config.clone();
    let seed = driver.seed;
    let inputs = move |id: ClientId| input_for(&cfg, seed, id);
    assert_eq!(aggregate.sum, plain_sum(&driver.config, &aggregate.contributors, &inputs));
}

#[test]
fn duplicates_are_refused_and_the_round_goes_on() {
    let config = config(6, 4, GraphSpec::Complete, 16, 32);
    let mut driver = Driver::start(&config, &[], 1);
    let keys = driver.outbox[0].clone().unwrap();
    driver.flush();
    assert_eq!(driver.send(1, &keys), Err(ProtocolError::Duplicate(id(1))));
    driver.advance().unwrap();
    driver.deliver_all();
    let shares = driver.outbox[2].clone().unwrap();
    driver.flush();
    assert_eq!(driver.send(3, &shares), Err(ProtocolError::Duplicate(id(3))));
    driver.advance().unwrap();
    driver.deliver_all();
    let masked = driver.outbox[5].clone().unwrap();
    driver.flush();
    assert_eq!(driver.send(6, &masked), Err(ProtocolError::Duplicate(id(6))));
    driver.advance().unwrap();
    driver.deliver_all();
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
    assert_eq!(aggregate.contributors.len(), 6, "a duplicate must not be counted twice");
}

#[test]
fn messages_replayed_from_another_round_are_refused() {
    let config = config(5, 3, GraphSpec::Complete, 8, 32);
    let mut first = Driver::start(&config, &[], 2);
    let old_keys = first.outbox[0].clone().unwrap();
    first.stage();
    let old_shares = first.outbox[0].clone().unwrap();

    let mut next_config = config.clone();
    next_config.round = 2;
    let mut second = Driver::start(&next_config, &[], 3);
    assert_eq!(second.send(1, &old_keys), Err(ProtocolError::WrongRound));
    second.flush();
    second.advance().unwrap();
    // A server message from the old round is refused by a client, which keeps its state.
    let old_peer_keys = first.server().message_for(id(2)).unwrap();
    assert_eq!(second.deliver(2, old_peer_keys), Err(ProtocolError::WrongRound));
    assert_eq!(second.clients[1].as_ref().unwrap().stage(), Stage::ShareKeys);
    second.deliver_all();
    assert_eq!(second.send(1, &old_shares), Err(ProtocolError::WrongRound));
    let aggregate = second.finish();
    check_sum(&second, &aggregate);
}

#[test]
fn out_of_phase_unknown_and_ineligible_senders_are_refused() {
    let config = config(6, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 4);
    let keys_of_2 = driver.outbox[1].clone().unwrap();
    driver.vanish(6);
    driver.flush();
    assert_eq!(driver.send(7, &keys_of_2), Err(ProtocolError::UnknownClient(id(7))));
    driver.advance().unwrap();
    driver.deliver_all();
    assert_eq!(
        driver.send(2, &keys_of_2),
        Err(ProtocolError::OutOfPhase { expected: Stage::ShareKeys, got: Stage::AdvertiseKeys })
    );
    // Client 6 never advertised keys, so it may not send shares.
    let shares_of_1 = driver.outbox[0].clone().unwrap();
    assert_eq!(
        driver.send(6, &shares_of_1),
        Err(ProtocolError::NotEligible { client: id(6), stage: Stage::ShareKeys })
    );
    // A client handed a message for a later stage keeps its state.
    let survivors = ServerMessage::Survivors { context: config.context(), survivors: ids(&[1, 2, 3]) };
    assert_eq!(
        driver.deliver(1, survivors),
        Err(ProtocolError::OutOfPhase {
            expected: Stage::MaskedInputCollection,
            got: Stage::ConsistencyCheck
        })
    );
    driver.outbox[0] = Some(shares_of_1);
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
    assert_eq!(aggregate.contributors, ids(&[1, 2, 3, 4, 5]));
}

#[test]
fn a_masked_input_of_the_wrong_length_is_refused() {
    let config = config(4, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 5);
    driver.stage();
    driver.stage();
    let forged = ClientMessage::MaskedInput {
        context: config.context(),
        vector: cohort_crypto::messages::MaskedVector { bits: 32, values: vec![0; 7] },
    };
    assert!(matches!(
        driver.send(1, &forged.encode()),
        Err(ProtocolError::InvalidMessage { reason: "masked input has the wrong length", .. })
    ));
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
}

/// The server adds a masked input into its sum straight from the message's
/// bytes (`receive_encoded`); every message it refuses that way is refused
/// with the error its decoded form gets from `receive`, and refusing it
/// changes nothing.
#[test]
fn a_masked_input_added_from_its_bytes_is_refused_exactly_as_its_decoded_form() {
    for (bits, len) in [(32u8, 8u32), (20, 9)] {
        let config = config(4, 3, GraphSpec::Complete, len, bits);
        let mut driver = Driver::start(&config, &[], 9);
        driver.stage();
        driver.stage();
        let honest = driver.outbox[0].clone().unwrap();
        let forge = |bits: u8, values: Vec<u32>, context| {
            ClientMessage::MaskedInput {
                context,
                vector: cohort_crypto::messages::MaskedVector { bits, values },
            }
            .encode()
        };
        let mut other_round = config.clone();
        other_round.round += 1;
        let mut trailing = honest.clone();
        trailing.push(0);
        let mut cases: Vec<(&str, u32, Vec<u8>)> = vec![
            ("short", 1, forge(bits, vec![0; len as usize - 1], config.context())),
            ("long", 1, forge(bits, vec![0; len as usize + 1], config.context())),
            ("other modulus", 1, forge(bits - 1, vec![0; len as usize], config.context())),
            ("other round", 1, forge(bits, vec![0; len as usize], other_round.context())),
            ("unknown client", 9, honest.clone()),
            ("truncated", 1, honest[..honest.len() - 1].to_vec()),
            ("trailing byte", 1, trailing),
            ("bad magic", 1, [&[0u8, 0][..], &honest[2..]].concat()),
        ];
        if (len * u32::from(bits)) % 8 != 0 {
            let mut padded = honest.clone();
            *padded.last_mut().unwrap() |= 0x80;
            cases.push(("padding bits", 1, padded));
        }
        let check = |driver: &mut Driver, name: &str, from: u32, bytes: &[u8]| {
            let decoded = ClientMessage::decode(bytes)
                .map_err(ProtocolError::from)
                .and_then(|message| driver.server().receive(id(from), message));
            let direct = driver.server().receive_encoded(id(from), bytes);
            assert!(direct.is_err(), "{name} (bits {bits}) was accepted");
            assert_eq!(direct, decoded, "{name} (bits {bits})");
        };
        for (name, from, bytes) in &cases {
            check(&mut driver, name, *from, bytes);
        }
        // Accepted once, then refused as a replay either way.
        driver.server().receive_encoded(id(1), &honest).unwrap();
        check(&mut driver, "replay", 1, &honest);
        driver.outbox[0] = None;
        let aggregate = driver.finish();
        check_sum(&driver, &aggregate);
        assert_eq!(aggregate.contributors, ids(&[1, 2, 3, 4]));
    }
}

fn unmasking_shares(bytes: &[u8]) -> (Vec<ClientId>, Vec<ClientId>) {
    match ClientMessage::decode(bytes).unwrap() {
        ClientMessage::Unmasking { shares, .. } => (
            shares.self_mask.iter().map(|(id, _)| *id).collect(),
            shares.mask_key.iter().map(|(id, _)| *id).collect(),
        ),
        other => panic!("expected unmasking shares, got {other:?}"),
    }
}

#[test]
fn an_honest_client_never_reveals_both_shares_of_a_neighbour() {
    let config = config(8, 4, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 6);
    driver.stage(); // keys
    driver.stage(); // shares
    driver.vanish(3);
    driver.vanish(5);
    driver.stage(); // masked inputs
    let (self_mask, mask_key) = unmasking_shares(driver.outbox[0].as_ref().unwrap());
    // Its own seed share with its surviving neighbours': it survives.
    assert_eq!(self_mask, ids(&[1, 2, 4, 6, 7, 8]));
    assert_eq!(mask_key, ids(&[3, 5]));
    // Asking again, with a different survivor list, gets nothing: the state is spent.
    let other_list = ServerMessage::Survivors { context: config.context(), survivors: ids(&[1, 2, 4, 6]) };
    assert_eq!(driver.deliver(1, other_list), Err(ProtocolError::Finished));
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
}

#[test]
fn clients_refuse_survivor_lists_below_the_threshold_or_without_them() {
    let config = config(8, 5, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 7);
    driver.stage();
    driver.stage();
    driver.flush();
    let context = config.context();
    let short = ServerMessage::Survivors { context, survivors: ids(&[1, 2, 3, 4]) };
    assert_eq!(
        driver.deliver(1, short),
        Err(ProtocolError::BelowThreshold { stage: Stage::Unmasking, have: 4, need: 5 })
    );
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
    let without_me = ServerMessage::Survivors { context, survivors: ids(&[1, 3, 4, 5, 6]) };
    assert!(matches!(driver.deliver(2, without_me), Err(ProtocolError::Inconsistent(_))));
    let foreign = ServerMessage::Survivors { context, survivors: ids(&[1, 2, 3, 4, 5, 9]) };
    assert!(matches!(driver.deliver(3, foreign), Err(ProtocolError::InvalidMessage { .. })));
}

#[test]
fn the_server_refuses_shares_for_the_wrong_neighbours() {
    let config = config(6, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 8);
    driver.stage();
    driver.stage();
    driver.vanish(6);
    driver.stage();
    // Client 2's honest shares, presented as client 1's.
    let shares_of_2 = driver.outbox[1].clone().unwrap();
    assert!(matches!(driver.send(1, &shares_of_2), Err(ProtocolError::InvalidMessage { .. })));
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
}

/// A server that tells client 1 that client 4 dropped (to get the share of
/// 4's mask key) while telling the others that 4 survived (to get the
/// shares of 4's self-mask seed). In the active variant the consistency
/// check exposes the lie and client 1 reveals nothing.
#[test]
fn the_consistency_check_stops_a_server_that_lies_about_dropouts() {
    let mut config = config(6, 4, GraphSpec::Complete, 8, 32);
    let identities = make_active(&mut config, 9);
    let mut driver = Driver::start(&config, &identities, 9);
    driver.stage(); // keys
    driver.stage(); // shares
    driver.flush(); // everybody's masked input
    driver.advance().unwrap();
    let context = config.context();
    let honest = ids(&[1, 2, 3, 4, 5, 6]);
    let lie = ids(&[1, 2, 3, 5, 6]);
    driver.deliver(1, ServerMessage::Survivors { context, survivors: lie }).unwrap();
    for i in 2..=6 {
        driver.deliver(i, ServerMessage::Survivors { context, survivors: honest.clone() }).unwrap();
    }
    let signature = |bytes: &Vec<u8>| match ClientMessage::decode(bytes).unwrap() {
        ClientMessage::Consistency { signature, .. } => signature,
        other => panic!("expected a signature, got {other:?}"),
    };
    let signatures: Vec<_> =
        (0..6).map(|i| (id(i + 1), signature(driver.outbox[i as usize].as_ref().unwrap()))).collect();
    // Client 1 receives the others' signatures over the honest list: with
    // client 4's among them it sees a signer outside its list, and without
    // it, valid signatures over another list.
    let result =
        driver.deliver(1, ServerMessage::Signatures { context, signatures: signatures[1..5].to_vec() });
    assert_eq!(result, Err(ProtocolError::Inconsistent("a signer is not in the survivor list")));
    // The same round again, client 1 handed only signers on its list.
    let mut fresh = Driver::start(&config, &identities, 9);
    fresh.stage();
    fresh.stage();
    fresh.flush();
    fresh.advance().unwrap();
    fresh.deliver(1, ServerMessage::Survivors { context, survivors: ids(&[1, 2, 3, 5, 6]) }).unwrap();
    let others: Vec<_> = [1usize, 2, 4, 5].iter().map(|&i| signatures[i]).collect();
    let result = fresh.deliver(1, ServerMessage::Signatures { context, signatures: others });
    assert_eq!(result, Err(ProtocolError::Inconsistent("a survivor signed a different survivor list")));
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
    // The honest server cannot even accept client 1's signature over the lie.
    let mut honest_driver = Driver::start(&config, &identities, 9);
    honest_driver.stage();
    honest_driver.stage();
    honest_driver.stage();
    let lying_signature = ClientMessage::Consistency { context, signature: signatures[0].1 };
    assert!(matches!(honest_driver.send(1, &lying_signature.encode()), Err(ProtocolError::Crypto(_))));
}

/// An active round of `config` run until every client signed the survivor
/// list and the server holds every signature; returns the driver and the
/// signatures by signer.
fn signed_by_everyone(
    config: &mut cohort_crypto::RoundConfig,
    seed: u64,
) -> (Driver, Vec<(ClientId, [u8; 64])>) {
    let identities = make_active(config, seed);
    let mut driver = Driver::start(config, &identities, seed);
    driver.stage(); // keys
    driver.stage(); // shares
    driver.stage(); // masked inputs; every client has signed the survivor list
    let signed = (1..=config.clients)
        .map(|i| match ClientMessage::decode(driver.outbox[i as usize - 1].as_ref().unwrap()) {
            Ok(ClientMessage::Consistency { signature, .. }) => (id(i), signature),
            other => panic!("client {i} did not sign: {other:?}"),
        })
        .collect();
    driver.flush();
    driver.advance().unwrap();
    (driver, signed)
}

/// A client goes on once t survivors signed the list it saw: the server
/// relays exactly t signatures (the lowest ids: on the complete graph the
/// whole round is every client's neighbourhood), and a client checks the
/// first t it is handed, so one more that is wrong changes nothing while a
/// wrong one among the first t makes it reveal nothing.
#[test]
fn t_consistency_signatures_are_relayed_and_checked() {
    let mut config = config(7, 4, GraphSpec::Complete, 8, 32);
    let (mut driver, signed) = signed_by_everyone(&mut config, 14);
    let context = config.context();
    let Some(ServerMessage::Signatures { signatures, .. }) = driver.server().message_for(id(7)) else {
        panic!("expected the signatures");
    };
    assert_eq!(signatures, signed[..4].to_vec(), "the t signatures of the lowest ids");

    // Two extra signatures, the last of them garbage: not checked.
    let mut extra = signed[..6].to_vec();
    extra[5].1[10] ^= 1;
    driver.deliver(7, ServerMessage::Signatures { context, signatures: extra }).unwrap();
    assert!(matches!(
        ClientMessage::decode(driver.outbox[6].as_ref().unwrap()),
        Ok(ClientMessage::Unmasking { .. })
    ));
    // A garbage signature among the first t: the client reveals nothing.
    let mut wrong = signed[..6].to_vec();
    wrong[2].1[10] ^= 1;
    let result = driver.deliver(6, ServerMessage::Signatures { context, signatures: wrong });
    assert_eq!(result, Err(ProtocolError::Inconsistent("a survivor signed a different survivor list")));
    assert!(matches!(driver.clients[5], Some(Client::Aborted)));
    // Fewer than t: refused before any check.
    let result = driver.deliver(5, ServerMessage::Signatures { context, signatures: signed[..3].to_vec() });
    assert!(matches!(result, Err(ProtocolError::BelowThreshold { .. })), "{result:?}");
}

/// On a sparse graph a client counts only signatures of its own
/// neighbourhood (itself and its neighbours): the server relays each client
/// the first t of those, and a client handed t valid signatures over its
/// very list that include one from outside its neighbourhood reveals
/// nothing. (Counting signers anywhere in the round let a coordinator show
/// two sides of the round two lists, each signed by t of its own members:
/// the split-list attack the adversary search finds, `cohort-adversary`.)
#[test]
fn a_client_counts_only_signatures_of_its_own_neighbourhood() {
    let mut config = config(12, 4, GraphSpec::Harary { degree: 6 }, 8, 32);
    let (mut driver, signed) = signed_by_everyone(&mut config, 21);
    let graph = config.communication_graph();
    let context = config.context();
    let own = |u: ClientId, w: ClientId| w == u || graph.are_neighbours(u, w);
    for u in (1..=12).map(id) {
        let Some(ServerMessage::Signatures { signatures, .. }) = driver.server().message_for(u) else {
            panic!("expected the signatures");
        };
        let expected: Vec<_> = signed.iter().copied().filter(|(w, _)| own(u, *w)).take(4).collect();
        assert_eq!(signatures, expected, "client {u}: the first t of its own neighbourhood");
    }
    // Client 1 handed t valid signatures over its list, one of them from a
    // client that is not its neighbour: it reveals nothing.
    let outsider = signed.iter().copied().find(|(w, _)| !own(id(1), *w)).unwrap();
    let mut mixed: Vec<_> = signed.iter().copied().filter(|(w, _)| own(id(1), *w)).take(3).collect();
    mixed.push(outsider);
    mixed.sort_by_key(|(w, _)| *w);
    let result = driver.deliver(1, ServerMessage::Signatures { context, signatures: mixed });
    assert_eq!(result, Err(ProtocolError::Inconsistent("a signer is not in this client's neighbourhood")));
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
    // Every other client goes on with what the server relays, and the round
    // completes without client 1's shares.
    driver.vanish(1);
    driver.deliver_all();
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
}

/// Claim 12: the server refuses an advertised key of small order, whichever
/// of the two it is, before it relays it to anybody (a client's agreement
/// with it would give a predictable secret); the round goes on without
/// the sender.
#[test]
fn the_server_refuses_advertised_keys_of_small_order() {
    let config = config(5, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 31);
    let honest = driver.outbox[0].take().unwrap();
    let Ok(ClientMessage::AdvertiseKeys { context, cipher_key, mask_key, seed_commitment, .. }) =
        ClientMessage::decode(&honest)
    else {
        panic!("expected the keys");
    };
    let mut zero = [0u8; 32];
    let mut one = [0u8; 32];
    one[0] = 1;
    zero[31] = 0x80; // bit 255 set: still the point u = 0
    for (cipher, mask) in [(zero, mask_key), (cipher_key, one), (one, zero)] {
        let forged = ClientMessage::AdvertiseKeys {
            context,
            cipher_key: cipher,
            mask_key: mask,
            seed_commitment,
            signature: None,
        };
        assert_eq!(
            driver.send(1, &forged.encode()),
            Err(ProtocolError::InvalidMessage { client: id(1), reason: "an advertised key is of low order" })
        );
    }
    driver.vanish(1);
    let aggregate = driver.finish();
    check_sum(&driver, &aggregate);
    assert_eq!(aggregate.contributors, ids(&[2, 3, 4, 5]));
}

/// A client that was not handed a neighbour's envelope did not mask with
/// it and holds none of its shares: a survivor list that says that
/// neighbour survived is one the client cannot act on (its input would
/// keep a mask nobody can remove, or the coordinator shows it a list it
/// made for somebody else), and it refuses before signing or revealing.
#[test]
fn a_client_refuses_a_survivor_list_with_a_neighbour_that_never_shared_with_it() {
    let config = config(5, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 32);
    driver.stage(); // keys
    driver.flush(); // every client's envelopes
    driver.advance().unwrap();
    let Some(ServerMessage::Shares { context, mut envelopes }) = driver.server().message_for(id(1)) else {
        panic!("expected the envelopes");
    };
    envelopes.retain(|envelope| envelope.peer != id(2));
    driver.deliver(1, ServerMessage::Shares { context, envelopes }).unwrap();
    assert!(matches!(
        ClientMessage::decode(driver.outbox[0].as_ref().unwrap()),
        Ok(ClientMessage::MaskedInput { .. })
    ));
    let result = driver.deliver(1, ServerMessage::Survivors { context, survivors: ids(&[1, 2, 3, 4, 5]) });
    assert_eq!(
        result,
        Err(ProtocolError::Inconsistent("a surviving neighbour never shared keys with this client"))
    );
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
}

#[test]
fn active_clients_refuse_unsigned_or_forged_keys() {
    let mut config = config(4, 3, GraphSpec::Complete, 8, 32);
    let identities = make_active(&mut config, 10);
    let mut driver = Driver::start(&config, &identities, 10);
    driver.flush();
    driver.advance().unwrap();
    let Some(ServerMessage::PeerKeys { context, mut peers }) = driver.server().message_for(id(1)) else {
        panic!("expected peer keys");
    };
    peers[0].mask_key[0] ^= 1;
    let result = driver.deliver(1, ServerMessage::PeerKeys { context, peers });
    assert!(matches!(result, Err(ProtocolError::Crypto(_))), "{result:?}");
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
}

/// The split attack on the consistency check: the coordinator shows client
/// 1 and some of its neighbours a survivor list with client 1 in it (so
/// they reveal shares of its self-mask seed, client 1 its own among them)
/// and the others a list without it (so they reveal shares of its mask
/// key), and hands each side the signatures on its own list. With
/// 2t ≤ k + 1 (t = 3 of k = 5: client 1 and two neighbours on one side,
/// three on the other) each side has t signers and client 1 would be
/// unmasked: every client refuses such a round. At the weakest parameters
/// still accepted (t = 4, 2t = k + 3), no split gives both sides t
/// signers: here the seed side (client 1 and one neighbour) cannot act.
#[test]
fn a_split_of_the_survivor_lists_recovers_no_secret_at_the_weakest_accepted_threshold() {
    use cohort_crypto::{ConfigError, ServerRound};

    // Refused before anything is revealed, by the server and by a client.
    let mut weak = config(6, 3, GraphSpec::Complete, 8, 32);
    let identities = make_active(&mut weak, 12);
    assert_eq!(weak.validate(), Err(ConfigError::ThresholdBelowMajority { threshold: 3, degree: 5 }));
    assert!(ServerRound::new(weak.clone()).is_err());
    let setup = ServerMessage::Setup(weak.clone());
    let mut rng = <rand_chacha::ChaCha20Rng as rand_core::SeedableRng>::seed_from_u64(12);
    let refused =
        Client::start(setup, id(2), identities.get(1).cloned(), input_for(&weak, 12, id(2)), &mut rng);
    assert!(matches!(refused, Err(ProtocolError::Config(ConfigError::ThresholdBelowMajority { .. }))));

    // t = 4 of k = 5: the split is tried and fails.
    let mut config = config(6, 4, GraphSpec::Complete, 8, 32);
    let identities = make_active(&mut config, 13);
    let mut driver = Driver::start(&config, &identities, 13);
    driver.stage(); // keys
    driver.stage(); // shares
    driver.flush(); // every masked input
    driver.advance().unwrap();
    let context = config.context();
    let with_target: Vec<ClientId> = (1..=6).map(id).collect();
    let without_target: Vec<ClientId> = (2..=6).map(id).collect();
    let (seed_side, key_side) = ([1u32, 2], [3u32, 4, 5, 6]);
    for &i in &seed_side {
        driver.deliver(i, ServerMessage::Survivors { context, survivors: with_target.clone() }).unwrap();
    }
    for &i in &key_side {
        driver.deliver(i, ServerMessage::Survivors { context, survivors: without_target.clone() }).unwrap();
    }
    // Each side's signatures, handed to that side only.
    let signature = |driver: &Driver, i: u32| match ClientMessage::decode(
        driver.outbox[i as usize - 1].as_ref().unwrap(),
    ) {
        Ok(ClientMessage::Consistency { signature, .. }) => (id(i), signature),
        _ => panic!("client {i} did not sign"),
    };
    let seed_signatures: Vec<_> = seed_side.iter().map(|&i| signature(&driver, i)).collect();
    let key_signatures: Vec<_> = key_side.iter().map(|&i| signature(&driver, i)).collect();
    let mut revealed = (0usize, 0usize); // shares of client 1's (seed, key)
    for (side, signatures) in [(&seed_side[..], &seed_signatures), (&key_side[..], &key_signatures)] {
        for &i in side {
            let message = ServerMessage::Signatures { context, signatures: signatures.clone() };
            if driver.deliver(i, message).is_err() {
                continue; // too few signatures on its list: it reveals nothing
            }
            let Ok(ClientMessage::Unmasking { shares, .. }) =
                ClientMessage::decode(driver.outbox[i as usize - 1].as_ref().unwrap())
            else {
                panic!("client {i} answered with something else");
            };
            revealed.0 += shares.self_mask.iter().filter(|(owner, _)| *owner == id(1)).count();
            revealed.1 += shares.mask_key.iter().filter(|(owner, _)| *owner == id(1)).count();
        }
    }
    let t = config.threshold as usize;
    assert!(revealed.0 < t || revealed.1 < t, "both of client 1's secrets recoverable: {revealed:?}");
    assert_eq!(revealed, (0, 4), "the seed side is refused, the key side reveals the dropped client's key");
}

/// A coordinator that answers for a client's peers could otherwise unmask
/// it alone: the active variant refuses peer keys without a signature,
/// keys that another roster member signed for itself, and keys of one
/// peer under another's signature, before the client shares anything.
#[test]
fn active_clients_refuse_unsigned_and_substituted_peer_keys() {
    type Attack = fn(&mut Vec<cohort_crypto::messages::AdvertisedKeys>);
    let attacks: [(&str, Attack); 4] = [
        ("unsigned", |peers| peers[0].signature = None),
        ("keys and signature of another peer", |peers| {
            let other = peers[1].clone();
            peers[0] = cohort_crypto::messages::AdvertisedKeys { id: peers[0].id, ..other };
        }),
        ("substituted keys under the peer's own signature", |peers| {
            let other = peers[1].clone();
            peers[0].cipher_key = other.cipher_key;
            peers[0].mask_key = other.mask_key;
        }),
        ("substituted seed commitment under the peer's own signature", |peers| {
            peers[0].seed_commitment = peers[1].seed_commitment;
        }),
    ];
    for (name, attack) in attacks {
        let mut config = config(4, 3, GraphSpec::Complete, 8, 32);
        let identities = make_active(&mut config, 11);
        let mut driver = Driver::start(&config, &identities, 11);
        driver.flush();
        driver.advance().unwrap();
        let Some(ServerMessage::PeerKeys { context, mut peers }) = driver.server().message_for(id(1)) else {
            panic!("expected peer keys");
        };
        attack(&mut peers);
        let result = driver.deliver(1, ServerMessage::PeerKeys { context, peers });
        assert!(result.is_err(), "{name}: accepted");
        assert!(matches!(driver.clients[0], Some(Client::Aborted)), "{name}");
        assert!(driver.outbox[0].is_none(), "{name}: the client sent its shares");
    }
}

/// What a transport may read before decoding is enough for every honest
/// message, and no more than that for the largest one (the masked input).
#[test]
fn honest_messages_fit_the_stage_size_bound() {
    let harary = GraphSpec::Harary { degree: 4 };
    for (graph, bits) in [(GraphSpec::Complete, 32), (harary, 13)] {
        for active in [false, true] {
            let mut config = config(7, 4, graph.clone(), 1000, bits);
            let identities = if active { make_active(&mut config, 3) } else { Vec::new() };
            let mut driver = Driver::start(&config, &identities, 5);
            loop {
                for bytes in driver.outbox.iter().flatten() {
                    let message = ClientMessage::decode(bytes).unwrap();
                    let bound = ClientMessage::max_encoded_len(&config, message.stage());
                    assert!(bytes.len() <= bound, "{:?}: {} > {bound}", message.stage(), bytes.len());
                    if message.stage() == Stage::MaskedInputCollection {
                        assert_eq!(bytes.len(), bound, "the masked input's size is exact");
                    }
                }
                if driver.stage().is_some() {
                    break;
                }
            }
        }
    }
    let config = config(7, 4, GraphSpec::Complete, 1000, 32);
    assert_eq!(ClientMessage::max_encoded_len(&config, Stage::Setup), 0);
    assert_eq!(ClientMessage::max_encoded_len(&config, Stage::Finished), 0);
}

/// Re-encodes `holder`'s unmasking message with its share of `owner`'s
/// secret altered by `delta` (the seed share if `owner` survived, else the
/// key share).
/// A survivor's unmasking message must hold its own seed share with its
/// surviving neighbours' (so that a survivor needs only t − 1 of them):
/// one without it, or with a seed share of a client that dropped, is
/// refused, and the round completes from the others.
#[test]
fn a_survivor_reveals_exactly_its_own_and_its_surviving_neighbours_seed_shares() {
    let config = config(6, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 21);
    driver.stage(); // keys
    driver.stage(); // shares
    driver.vanish(6);
    driver.stage(); // masked inputs: clients 1 to 5 survive
    let take = |driver: &mut Driver, holder: usize| match ClientMessage::decode(
        driver.outbox[holder - 1].take().unwrap().as_slice(),
    ) {
        Ok(ClientMessage::Unmasking { context, shares }) => (context, shares),
        other => panic!("no unmasking message: {other:?}"),
    };
    // Client 1 leaves its own share out.
    let (context, mut shares) = take(&mut driver, 1);
    assert_eq!(shares.self_mask.first().map(|(owner, _)| *owner), Some(id(1)));
    shares.self_mask.remove(0);
    let refused = driver.send(1, &ClientMessage::Unmasking { context, shares }.encode());
    assert!(
        matches!(refused, Err(ProtocolError::InvalidMessage { reason, .. }) if reason.contains("shares must cover")),
        "{refused:?}"
    );
    // Client 2 moves its seed share to the list of the dropped client.
    let (context, mut shares) = take(&mut driver, 2);
    let own = shares.self_mask.iter().position(|(owner, _)| *owner == id(2)).unwrap();
    let (_, share) = shares.self_mask.remove(own);
    shares.mask_key.insert(0, (id(2), share));
    let refused = driver.send(2, &ClientMessage::Unmasking { context, shares }.encode());
    assert!(matches!(refused, Err(ProtocolError::InvalidMessage { .. })), "{refused:?}");
    // Clients 3 to 5 answer as they should: t = 3 is enough.
    driver.flush();
    let aggregate = driver.advance().unwrap().unwrap();
    assert_eq!(aggregate.contributors, ids(&[1, 2, 3, 4, 5]));
    check_sum(&driver, &aggregate);
}

fn alter_revealed_share(driver: &mut Driver, holder: u32, owner: u32, delta: u64) {
    let slot = &mut driver.outbox[holder as usize - 1];
    let Ok(ClientMessage::Unmasking { context, mut shares }) = ClientMessage::decode(slot.as_ref().unwrap())
    else {
        panic!("client {holder} has no unmasking message waiting");
    };
    let Some(entry) = shares
        .self_mask
        .iter_mut()
        .chain(shares.mask_key.iter_mut())
        .find(|(id, _)| *id == crate::common::id(owner))
    else {
        panic!("client {holder} reveals no share of client {owner}'s secret");
    };
    let mut bytes = Vec::new();
    entry.1.encode_into(&mut bytes);
    // Add delta to the second limb: still a field element, no longer on the
    // polynomial. (Not the first: a change there may only touch the bits
    // X25519 clamps away, which leaves a mask key equivalent.)
    let limb = u64::from_le_bytes(bytes[12..20].try_into().unwrap());
    bytes[12..20].copy_from_slice(&((limb + delta) % cohort_crypto::shamir::MODULUS).to_le_bytes());
    entry.1 = cohort_crypto::shamir::Share::decode(&bytes.try_into().unwrap()).unwrap();
    *slot = Some(ClientMessage::Unmasking { context, shares }.encode());
}

/// A survivor that reveals a wrong share of another survivor's self-mask
/// seed, or of a dropped client's mask key, no longer corrupts the sum or
/// gets the owner blamed: the server checks every reconstructed secret
/// against the owner's commitment (or advertised public key), corrects the
/// wrong share, names its sender and completes the round without it.
#[test]
fn a_wrong_revealed_share_is_corrected_and_its_sender_named() {
    let config = config(7, 4, GraphSpec::Complete, 16, 32);
    for (owner, drops) in [(2u32, false), (6, true)] {
        let mut driver = Driver::start(&config, &[], 12);
        driver.stage(); // keys
        driver.stage(); // shares
        if drops {
            driver.vanish(owner);
        }
        driver.stage(); // masked inputs
        // Client 1 holds the lowest point, so its share is among the first t.
        alter_revealed_share(&mut driver, 1, owner, 1);
        let aggregate = driver.finish();
        check_sum(&driver, &aggregate);
        assert_eq!(
            aggregate.faulty_shares,
            vec![cohort_crypto::FaultyShare { owner: id(owner), holder: id(1) }],
            "owner {owner}"
        );
    }
}

/// More wrong shares than the code corrects ((6 − 4) / 2 = 1 here): the
/// round ends without an aggregate instead of with a wrong one. The two
/// changes are crafted so that the secret the first t shares (points 1, 3,
/// 4, 5) give is still a valid 32-byte value, off by 4·λ₁ + λ₃ = 10 − 5 = 5
/// in one limb: only the commitment tells it apart.
#[test]
fn too_many_wrong_shares_end_the_round_without_a_sum() {
    let config = config(7, 4, GraphSpec::Complete, 16, 32);
    let mut driver = Driver::start(&config, &[], 13);
    driver.stage();
    driver.stage();
    driver.stage();
    alter_revealed_share(&mut driver, 1, 2, 4);
    alter_revealed_share(&mut driver, 3, 2, 1);
    driver.flush();
    assert!(matches!(
        driver.advance(),
        Err(ProtocolError::UnverifiableSecret { owner, shares: 7 }) if owner == id(2)
    ));
}

/// The decoder refuses lists out of order; a client handed an already
/// decoded message (as a binding might) checks the order itself.
#[test]
fn clients_refuse_lists_out_of_order_without_the_decoder() {
    let config = config(5, 3, GraphSpec::Complete, 8, 32);
    let mut driver = Driver::start(&config, &[], 14);
    driver.flush();
    driver.advance().unwrap();
    let Some(ServerMessage::PeerKeys { context, mut peers }) = driver.server().message_for(id(1)) else {
        panic!("no peer keys for client 1");
    };
    peers.swap(0, 1);
    let result = driver.deliver(1, ServerMessage::PeerKeys { context, peers });
    assert!(
        matches!(
            result,
            Err(ProtocolError::InvalidMessage { reason: "peer keys are not in ascending order", .. })
        ),
        "{result:?}"
    );
    assert!(matches!(driver.clients[0], Some(Client::Aborted)));
}

/// Hands `bytes[from..to]` of a masked input to the server in pieces of
/// 1 to 47 bytes, the header in one.
fn send_pieces(
    server: &mut cohort_crypto::ServerRound,
    input: &mut cohort_crypto::IncomingInput,
    bytes: &[u8],
    seed: &mut u64,
) -> Result<(), ProtocolError> {
    let mut at = 0;
    while at < bytes.len() {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let step = 1 + (*seed >> 33) as usize % 47;
        let end = (at + step).min(bytes.len());
        server.continue_input(input, &bytes[at..end])?;
        at = end;
    }
    Ok(())
}

/// What a retraction reads: the bytes handed over, from `packed`.
fn read_back(packed: &[u8]) -> impl FnMut(usize, &mut [u8]) -> Result<(), ()> + '_ {
    |offset, buffer| {
        buffer.copy_from_slice(&packed[offset..offset + buffer.len()]);
        Ok(())
    }
}

#[test]
fn a_masked_input_in_pieces_is_added_as_it_arrives_and_one_that_breaks_off_is_taken_back_out() {
    use cohort_crypto::messages::MASKED_INPUT_HEADER_LEN as HEADER;
    for (bits, len) in [(32u8, 1003u32), (20, 1001), (13, 517)] {
        let config = config(5, 3, GraphSpec::Complete, len, bits);
        let mut driver = Driver::start(&config, &[], 21);
        driver.stage();
        driver.stage();
        let message = |driver: &Driver, client: usize| driver.outbox[client - 1].clone().unwrap();
        let mut seed = u64::from(bits);
        // 1: in pieces of 1 to 47 bytes, then finished.
        let bytes = message(&driver, 1);
        let mut one = driver.server().begin_input(id(1), &bytes[..HEADER]).unwrap();
        assert_eq!(one.expected_bytes(), bytes.len() - HEADER);
        // While it arrives, the same client can send nothing else.
        assert_eq!(driver.server().receive_encoded(id(1), &bytes), Err(ProtocolError::Duplicate(id(1))));
        assert_eq!(
            driver.server().begin_input(id(1), &bytes[..HEADER]).unwrap_err(),
            ProtocolError::Duplicate(id(1))
        );
        send_pieces(driver.server(), &mut one, &bytes[HEADER..], &mut seed).unwrap();
        driver.server().finish_input(&mut one).unwrap();
        assert!(one.is_finished() && driver.server().has_received(id(1)));
        // A finished input is never retracted.
        driver.server().retract_input(one, |_, _| Err::<(), ()>(())).unwrap();

        // 2: breaks off half way and is taken back out (read from what was
        // handed over), then sent again whole.
        let bytes = message(&driver, 2);
        let mut two = driver.server().begin_input(id(2), &bytes[..HEADER]).unwrap();
        let half = HEADER + (bytes.len() - HEADER) / 2;
        send_pieces(driver.server(), &mut two, &bytes[HEADER..half], &mut seed).unwrap();
        assert_eq!(driver.server().finish_input(&mut two), Err(cohort_crypto::DecodeError::Truncated.into()));
        assert!(two.added_bytes() > 0 && two.added_bytes() <= half - HEADER);
        let packed = &bytes[HEADER..];
        driver.server().retract_input(two, read_back(packed)).unwrap();
        assert!(!driver.server().has_received(id(2)));
        driver.server().receive_encoded(id(2), &bytes).unwrap();

        // 3: every byte, but with padding bits set in the last (where the
        // width leaves any) or one byte too many: refused before that
        // piece is added, then taken back out; client 3 is a dropout.
        let bytes = message(&driver, 3);
        let mut three = driver.server().begin_input(id(3), &bytes[..HEADER]).unwrap();
        let mut last = bytes[HEADER..].to_vec();
        let padded = (len * u32::from(bits)) % 8 != 0;
        if padded {
            *last.last_mut().unwrap() |= 0x80;
        } else {
            last.push(0);
        }
        let (body, end) = last.split_at(last.len() - if padded { 1 } else { 2 });
        send_pieces(driver.server(), &mut three, body, &mut seed).unwrap();
        let refused = driver.server().continue_input(&mut three, end).unwrap_err();
        if padded {
            assert_eq!(refused, cohort_crypto::DecodeError::Invalid("padding bits").into());
        } else {
            assert_eq!(refused, cohort_crypto::DecodeError::TrailingBytes(1).into());
        }
        driver.server().retract_input(three, read_back(&last)).unwrap();
        driver.outbox[2] = None;

        // 4 and 5: whole messages, the usual way, and one in a single piece.
        let bytes = message(&driver, 4);
        driver.server().receive_encoded(id(4), &bytes).unwrap();
        let bytes = message(&driver, 5);
        let mut five = driver.server().begin_input(id(5), &bytes[..HEADER]).unwrap();
        driver.server().continue_input(&mut five, &bytes[HEADER..]).unwrap();
        driver.server().finish_input(&mut five).unwrap();
        // A header cut short, or one of another kind of message, is refused.
        let short = message(&driver, 1)[..HEADER - 1].to_vec();
        let refused = driver.server().begin_input(id(3), &short).unwrap_err();
        assert_eq!(refused, cohort_crypto::DecodeError::Truncated.into());
        let keys = ClientMessage::Consistency { context: config.context(), signature: [0; 64] }.encode();
        assert!(driver.server().begin_input(id(3), &keys[..HEADER.min(keys.len())]).is_err());

        for client in [1, 2, 4, 5] {
            driver.outbox[client - 1] = None;
        }
        driver.vanish(3);
        let aggregate = driver.finish();
        assert_eq!(aggregate.contributors, ids(&[1, 2, 4, 5]), "bits {bits}");
        check_sum(&driver, &aggregate);
    }
}

#[test]
fn a_stage_never_closes_on_an_arriving_input_and_a_sum_that_cannot_be_mended_is_never_unmasked() {
    use cohort_crypto::messages::MASKED_INPUT_HEADER_LEN as HEADER;
    let config = config(4, 2, GraphSpec::Complete, 64, 20);
    for read_fails in [false, true] {
        let mut driver = Driver::start(&config, &[], 5);
        driver.stage();
        driver.stage();
        let bytes = driver.outbox[0].take().unwrap();
        let mut input = driver.server().begin_input(id(1), &bytes[..HEADER]).unwrap();
        driver.server().continue_input(&mut input, &bytes[HEADER..HEADER + 40]).unwrap();
        for client in 2..=4 {
            let other = driver.outbox[client - 1].take().unwrap();
            driver.server().receive_encoded(id(client as u32), &other).unwrap();
        }
        if !read_fails {
            // Still arriving: the stage refuses to close.
            assert_eq!(driver.advance().unwrap_err(), ProtocolError::InputsArriving(1));
            continue;
        }
        let retracted = driver.server().retract_input(input, |_, _| Err::<(), &str>("disk error"));
        assert_eq!(retracted, Err(ProtocolError::SumDamaged));
        assert_eq!(driver.advance().unwrap_err(), ProtocolError::SumDamaged);
    }
}
