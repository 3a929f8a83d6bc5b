//! A client step whose agreements and key streams a host computes
//! (`Client::handle_deferred`, the browser's WebCrypto route) sends exactly
//! what the step computed in place sends. The host here computes them
//! apart from the core: X25519 with `x25519-dalek`'s Montgomery ladder
//! (the core maps keys to the Edwards form), the key streams with the `ctr`
//! crate's AES-128-CTR over a 128-bit big-endian counter from zero, read as
//! little-endian words (the core's own AES backends are not used).

use cohort_crypto::client::{Deferred, PendingStep, Work};
use cohort_crypto::graph::GraphSpec;
use cohort_crypto::prg::MaskSign;
use cohort_crypto::{Client, ClientId, ProtocolError, RoundConfig, Secret32};
use ctr::cipher::{KeyIvInit, StreamCipher};
use rand_chacha::ChaCha20Rng;

use crate::common::driver::Driver;
use crate::common::*;

/// How much of the work the host does.
#[derive(Clone, Copy, Debug)]
enum Host {
    /// Every agreement and every key stream.
    All,
    /// Every other agreement and two key streams in three; the core
    /// completes the rest.
    Some,
    /// Nothing: the step completes in place.
    Nothing,
}

fn host_stream(key: &[u8; 16], words: usize) -> Vec<u32> {
    let mut bytes = vec![0u8; words * 4];
    ctr::Ctr128BE::<aes::Aes128>::new(key.into(), &[0u8; 16].into()).apply_keystream(&mut bytes);
    bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

fn host_agreement(secret: &[u8; 32], public: &[u8; 32]) -> Secret32 {
    let mut shared = x25519_dalek::x25519(*secret, *public);
    Secret32::from_bytes(&mut shared)
}

/// Does `host`'s part of the step's work and completes it.
fn work(mut pending: PendingStep, host: Host, rng: &mut ChaCha20Rng) -> Deferred {
    let streams = match pending.work() {
        Work::Agreements { secret, peers } => {
            let secret = secret.bytes();
            let shared = peers
                .iter()
                .enumerate()
                .map(|(i, public)| match host {
                    Host::All => Some(host_agreement(&secret, public)),
                    Host::Some if i % 2 == 0 => Some(host_agreement(&secret, public)),
                    Host::Some | Host::Nothing => None,
                })
                .collect();
            return pending.agreed(shared, rng);
        }
        Work::KeyStreams { masks, words } => masks
            .iter()
            .enumerate()
            .filter(|(i, _)| match host {
                Host::All => true,
                Host::Some => i % 3 != 1,
                Host::Nothing => false,
            })
            .map(|(i, mask)| (i, host_stream(mask.key(), words)))
            .collect::<Vec<_>>(),
    };
    for (i, stream) in streams {
        pending.add_key_stream(i, &stream).unwrap();
    }
    pending.complete(rng)
}

/// Every remaining client takes its server message through the deferred
/// route, `host` doing its part.
fn deliver_deferred(driver: &mut Driver, host: Host) -> usize {
    let mut pending_steps = 0;
    for index in 0..driver.clients.len() {
        let Some(state) = driver.clients[index].take() else { continue };
        let me = ClientId::from_index(index);
        let Some(message) = driver.server.as_ref().unwrap().message_for(me) else {
            driver.vanish(me.get());
            continue;
        };
        let rng = &mut driver.rngs[index];
        let mut step = state.handle_deferred(message, rng);
        let (next, reply) = loop {
            match step {
                Deferred::Done(done) => break done,
                Deferred::Pending(pending) => {
                    pending_steps += 1;
                    step = work(pending, host, rng);
                }
            }
        };
        driver.clients[index] = Some(next);
        driver.outbox[index] = Some(reply.unwrap().encode());
    }
    pending_steps
}

/// Runs `config` twice with the same seeds, once in place and once through
/// the host, and compares every message every client sends, stage by
/// stage, and the sums.
fn compare(config: &RoundConfig, identities_seed: Option<u64>, host: Host) {
    let mut config = config.clone();
    let identities = identities_seed.map(|seed| make_active(&mut config, seed)).unwrap_or_default();
    let mut in_place = Driver::start(&config, &identities, 41);
    let mut hosted = Driver::start(&config, &identities, 41);
    assert_eq!(in_place.outbox, hosted.outbox);
    let mut pending_steps = 0;
    let mut stage = 0;
    let aggregates = loop {
        in_place.flush();
        hosted.flush();
        match (in_place.advance().unwrap(), hosted.advance().unwrap()) {
            (Some(a), Some(b)) => break (a, b),
            (None, None) => {}
            other => panic!("the rounds parted at stage {stage}: {:?}", other.0.is_some()),
        }
        in_place.deliver_all();
        pending_steps += deliver_deferred(&mut hosted, host);
        stage += 1;
        assert_eq!(in_place.outbox, hosted.outbox, "{host:?}: the messages after stage {stage} differ");
    };
    // Two agreement steps and one of key streams per client.
    assert_eq!(pending_steps, 3 * config.clients as usize, "{host:?}");
    assert_eq!(aggregates.0.sum, aggregates.1.sum);
    assert_eq!(aggregates.0.contributors.len(), config.clients as usize);
}

#[test]
fn a_deferred_step_sends_what_the_step_in_place_sends() {
    let sparse = config(12, 5, GraphSpec::Harary { degree: 6 }, 1003, 20);
    let complete = config(6, 4, GraphSpec::Complete, 4099, 32);
    let mut validated_round = config(8, 5, GraphSpec::Complete, 300, 24);
    validated(&mut validated_round, 1.0);
    for host in [Host::All, Host::Some, Host::Nothing] {
        compare(&sparse, None, host);
        compare(&complete, Some(3), host);
        compare(&validated_round, None, host);
    }
}

/// Drives client 1 of a fresh round to its pending MaskedInput step, with
/// its agreements done in place.
fn pending_masking() -> (PendingStep, ChaCha20Rng) {
    let config = config(5, 3, GraphSpec::Complete, 100, 16);
    let mut driver = Driver::start(&config, &[], 9);
    driver.stage(); // The keys: every client sends its shares.
    driver.flush();
    driver.advance().unwrap();
    let message = driver.server().message_for(id(1)).unwrap();
    let state = driver.clients[0].take().unwrap();
    let mut rng = driver.rngs[0].clone();
    let Deferred::Pending(pending) = state.handle_deferred(message, &mut rng) else {
        panic!("the masking step waits for its agreements")
    };
    let Deferred::Pending(masking) = pending.complete(&mut rng) else {
        panic!("and then for its key streams")
    };
    (masking, rng)
}

#[test]
fn a_host_s_wrong_work_is_refused_and_an_all_zero_agreement_is_not_taken() {
    let (mut masking, mut rng) = pending_masking();
    let Work::KeyStreams { masks, words } = masking.work() else { panic!("key streams") };
    assert_eq!((masks.len(), words), (5, 100));
    // Client 1 adds its self mask and the masks of every higher id.
    assert!(masks.iter().all(|m| m.sign() == MaskSign::Add && !m.added()));
    let stream = host_stream(masks[0].key(), words);
    let other = host_stream(masks[1].key(), words);
    let inconsistent =
        |result: Result<(), ProtocolError>| matches!(result, Err(ProtocolError::Inconsistent(_)));
    assert!(inconsistent(masking.add_key_stream(0, &stream[..99])), "a stream of the wrong length");
    assert!(inconsistent(masking.add_key_stream(5, &stream)), "a mask the step does not have");
    // A stream whose first or last block is not the mask's: another key,
    // or a counter that starts elsewhere.
    let mut wrong = stream.clone();
    wrong[1] ^= 1;
    assert!(inconsistent(masking.add_key_stream(0, &wrong)), "a wrong first block");
    let mut wrong = stream.clone();
    wrong[99] ^= 1 << 31;
    assert!(inconsistent(masking.add_key_stream(0, &wrong)), "a wrong last block");
    assert!(inconsistent(masking.add_key_stream(0, &other)), "another mask's");
    masking.add_key_stream(0, &stream).unwrap();
    assert!(inconsistent(masking.add_key_stream(0, &stream)), "the same mask twice");
    // Once added, the mask's key is wiped.
    let Work::KeyStreams { masks, .. } = masking.work() else { panic!("key streams") };
    assert!(masks[0].added() && masks[0].key() == &[0; 16] && masks[1].key() != &[0; 16]);
    // Agreements for a step that waits for key streams abort it.
    let Deferred::Done((Client::Aborted, Err(ProtocolError::Inconsistent(_)))) =
        masking.agreed(Vec::new(), &mut rng)
    else {
        panic!("agreements out of turn abort")
    };

    let config = config(5, 3, GraphSpec::Complete, 100, 16);
    let mut driver = Driver::start(&config, &[], 9);
    driver.flush();
    driver.advance().unwrap();
    let message = driver.server().message_for(id(1)).unwrap();
    let state = driver.clients[0].take().unwrap();
    let mut rng = driver.rngs[0].clone();
    let fresh = |rng: &mut ChaCha20Rng| {
        let Deferred::Pending(pending) =
            Driver::start(&config, &[], 9).clients[0].take().unwrap().handle_deferred(message.clone(), rng)
        else {
            panic!("the share step waits for its agreements")
        };
        pending
    };
    let Deferred::Pending(pending) = state.handle_deferred(message.clone(), &mut rng) else { panic!() };
    // One agreement too few.
    let Deferred::Done((Client::Aborted, Err(ProtocolError::Inconsistent(_)))) =
        pending.agreed((0..3).map(|_| None).collect(), &mut rng)
    else {
        panic!("a list of the wrong length aborts")
    };
    // An all-zero agreement (what a low-order peer key gives, or a broken
    // host) is not taken: the core computes that one, and the step goes
    // on as in place.
    let in_place = fresh(&mut rng.clone()).complete(&mut rng.clone());
    let pending = fresh(&mut rng.clone());
    let mut zero = [0u8; 32];
    let shared = vec![Some(Secret32::from_bytes(&mut zero)), None, None, None];
    let (Deferred::Done((_, Ok(a))), Deferred::Done((_, Ok(b)))) =
        (pending.agreed(shared, &mut rng.clone()), in_place)
    else {
        panic!("the share step completes")
    };
    assert_eq!(a.encode(), b.encode());
    // Key streams for a step that waits for agreements are refused, the
    // step kept.
    let mut pending = fresh(&mut rng);
    assert!(inconsistent(pending.add_key_stream(0, &[0; 100])));
    assert!(matches!(pending.work(), Work::Agreements { peers, .. } if peers.len() == 4));
}
