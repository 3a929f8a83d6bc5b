//! A [`Strategy`] played against the real clients: every client of the
//! round is a [`cohort_crypto::Client`], and a scripted coordinator relays
//! keys, envelopes, survivor lists and signatures as the strategy says.
//! What each honest client answers is read back as a [`Response`], so that
//! a test can compare it with [`crate::model::evaluate`]'s.

use std::sync::Arc;

use cohort_crypto::messages::AdvertisedKeys;
use cohort_crypto::signature::IdentityKey;
use cohort_crypto::testing::sign_survivor_list;
use cohort_crypto::{
    Client, ClientId, ClientMessage, QuantizationSpec, QuantizedInput, RoundConfig, ServerMessage, Transform,
    Variant,
};
use cohort_crypto::{GraphSpec, MetricSet};
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::model::{Response, Round, SignerScope, Strategy, id};

/// An active round of `clients` clients on `graph` with threshold
/// `threshold`, its identity keys drawn from `seed`, as the replay runs it.
///
/// # Panics
/// If the parameters are not a valid active round.
pub fn active_round(
    clients: u32,
    graph: GraphSpec,
    threshold: u32,
    seed: u64,
) -> (RoundConfig, Vec<Arc<IdentityKey>>) {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let keys: Vec<Arc<IdentityKey>> =
        (0..clients).map(|_| Arc::new(IdentityKey::generate(&mut rng))).collect();
    let config = RoundConfig {
        session: [9; 16],
        round: 1,
        variant: Variant::Active,
        clients,
        identities: keys.iter().map(|key| key.public_key()).collect(),
        graph,
        threshold,
        vector_len: 4,
        modulus_bits: 24,
        quantization: QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: Transform::None,
            metrics: MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        },
        model: None,
    };
    config.validate().expect("a valid active round");
    (config, keys)
}

/// Plays `strategy` against real clients of `config` (whose graph and
/// threshold `round` must be) and returns each client's answer. Signatures
/// are relayed as `round`'s [`SignerScope`] counts them: every available
/// signature over the client's list from its own neighbourhood, or from
/// the whole round.
///
/// # Panics
/// If a client fails in a way the model has no answer for.
pub fn replay(
    round: &Round,
    config: &RoundConfig,
    identities: &[Arc<IdentityKey>],
    strategy: &Strategy,
    seed: u64,
) -> Vec<Response> {
    let n = config.clients as usize;
    let t = config.threshold as usize;
    let context = config.context();
    let clients: Vec<ClientId> = (1..=n as u32).map(id).collect();
    let mut rngs: Vec<ChaCha20Rng> =
        (0..n as u64).map(|i| ChaCha20Rng::seed_from_u64(seed ^ (i << 20))).collect();

    let input = || QuantizedInput::from_values(vec![1; config.vector_len as usize]);
    // AdvertiseKeys, from everyone.
    let mut states: Vec<Option<Client>> = Vec::with_capacity(n);
    let mut advertised = Vec::with_capacity(n);
    for &u in &clients {
        let setup = ServerMessage::Setup(config.clone());
        let identity = Some(identities[u.index()].clone());
        let (state, message) =
            Client::start(setup, u, identity, input(), &mut rngs[u.index()]).expect("the round starts");
        let ClientMessage::AdvertiseKeys { cipher_key, mask_key, seed_commitment, signature, .. } = message
        else {
            panic!("expected the keys");
        };
        advertised.push(AdvertisedKeys { id: u, cipher_key, mask_key, seed_commitment, signature });
        states.push(Some(state));
    }
    let mut step = |states: &mut Vec<Option<Client>>, u: ClientId, message: ServerMessage| {
        let state = states[u.index()].take().expect("a live client");
        let (next, reply) = state.handle(message, &mut rngs[u.index()]);
        states[u.index()] = Some(next);
        reply
    };
    // PeerKeys: every neighbour's keys, to everyone.
    let mut sealed: Vec<Vec<cohort_crypto::messages::Envelope>> = vec![Vec::new(); n];
    for &u in &clients {
        let peers = round.neighbours(u).iter().map(|v| advertised[v.index()].clone()).collect();
        match step(&mut states, u, ServerMessage::PeerKeys { context, peers }) {
            Ok(ClientMessage::ShareKeys { envelopes, .. }) => {
                for envelope in envelopes {
                    // Addressed to envelope.peer; the recipient sees the sender.
                    sealed[envelope.peer.index()]
                        .push(cohort_crypto::messages::Envelope { peer: u, ciphertext: envelope.ciphertext });
                }
            }
            other => panic!("client {u} did not share: {other:?}"),
        }
    }
    // Shares: the envelopes the strategy hands each client.
    let mut masked = vec![false; n];
    for &u in &clients {
        let chosen = &strategy.envelopes[u.index()];
        let mut envelopes: Vec<_> =
            sealed[u.index()].iter().filter(|e| chosen.binary_search(&e.peer).is_ok()).cloned().collect();
        envelopes.sort_by_key(|e| e.peer);
        assert_eq!(envelopes.len(), chosen.len(), "every chosen envelope was sealed");
        match step(&mut states, u, ServerMessage::Shares { context, envelopes }) {
            Ok(ClientMessage::MaskedInput { .. }) => masked[u.index()] = true,
            Err(cohort_crypto::ProtocolError::BelowThreshold { .. }) if chosen.len() < t => {}
            other => panic!("client {u} answered the envelopes with {other:?}"),
        }
    }
    // Survivor lists and signatures, for honest clients only: the
    // coordinator signs for its own.
    let honest = |u: ClientId| !strategy.corrupt[u.index()];
    let mut signatures: Vec<Option<[u8; 64]>> = vec![None; n];
    let mut responses: Vec<Option<Response>> = vec![None; n];
    for &u in &clients {
        responses[u.index()] = if !honest(u) {
            Some(Response::Corrupt)
        } else if !masked[u.index()] {
            Some(Response::NoInput)
        } else if let Some(list) = strategy.list_of(u) {
            let survivors = list.to_vec();
            match step(&mut states, u, ServerMessage::Survivors { context, survivors }) {
                Ok(ClientMessage::Consistency { signature, .. }) => {
                    signatures[u.index()] = Some(signature);
                    None
                }
                Err(_) => Some(Response::RefusedList),
                Ok(other) => panic!("client {u} answered its list with {other:?}"),
            }
        } else {
            Some(Response::Dropped)
        };
    }
    for &u in &clients {
        if responses[u.index()].is_some() {
            continue;
        }
        let list = strategy.list_of(u).expect("a signer was shown a list");
        let relayed: Vec<(ClientId, [u8; 64])> = list
            .iter()
            .filter(|&&w| match round.scope() {
                SignerScope::Round => true,
                SignerScope::Neighbourhood => round.counts_signer(u, w),
            })
            .filter_map(|&w| {
                if !honest(w) {
                    Some((w, sign_survivor_list(&identities[w.index()], &context, w, list)))
                } else if strategy.list_of(w) == Some(list) {
                    signatures[w.index()].map(|signature| (w, signature))
                } else {
                    None
                }
            })
            .collect();
        let response = match step(&mut states, u, ServerMessage::Signatures { context, signatures: relayed })
        {
            Ok(ClientMessage::Unmasking { shares, .. }) => Response::Revealed {
                seeds: shares.self_mask.iter().map(|(owner, _)| *owner).collect(),
                keys: shares.mask_key.iter().map(|(owner, _)| *owner).collect(),
            },
            Err(_) => Response::Signed,
            Ok(other) => panic!("client {u} answered the signatures with {other:?}"),
        };
        responses[u.index()] = Some(response);
    }
    responses.into_iter().map(|r| r.expect("every client answered")).collect()
}
