//! A masked input handed to the server in pieces must be accepted or
//! refused exactly as the same bytes handed over whole, whatever the bytes
//! and wherever they are cut; a refused one is retracted, after which the
//! client's honest input is still accepted. The first byte of the data
//! picks the cuts, the rest is the message. Nothing may panic.
#![no_main]

use std::sync::OnceLock;

use cohort_crypto::graph::GraphSpec;
use cohort_crypto::messages::MASKED_INPUT_HEADER_LEN;
use cohort_crypto::{
    Advanced, Client, ClientId, ClientMessage, MetricSet, QuantizationSpec, QuantizedInput, RoundConfig,
    ServerRound, Transform, Variant,
};
use libfuzzer_sys::fuzz_target;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

/// Three clients' key and share messages, and client 1's masked input.
struct Fixture {
    config: RoundConfig,
    keys: Vec<Vec<u8>>,
    shares: Vec<Vec<u8>>,
    honest: Vec<u8>,
}

fn id(i: usize) -> ClientId {
    ClientId::new(i as u32 + 1).unwrap()
}

fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let config = RoundConfig {
            session: [3; 16],
            round: 1,
            variant: Variant::SemiHonest,
            clients: 3,
            identities: Vec::new(),
            graph: GraphSpec::Complete,
            threshold: 2,
            vector_len: 37,
            modulus_bits: 13,
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
        let mut server = ServerRound::new(config.clone()).unwrap();
        let setup = server.setup_message();
        let mut rngs: Vec<ChaCha20Rng> = (0..3).map(|i| ChaCha20Rng::seed_from_u64(i)).collect();
        let mut clients = Vec::new();
        let mut keys = Vec::new();
        for (i, rng) in rngs.iter_mut().enumerate() {
            let input = QuantizedInput::from_values((0..37).map(|j| (i * 37 + j) as u32 % 900).collect());
            let (client, message) = Client::start(setup.clone(), id(i), None, input, rng).unwrap();
            let encoded = message.encode();
            server.receive(id(i), message).unwrap();
            clients.push(client);
            keys.push(encoded);
        }
        let advance = |server: ServerRound| match server.advance().unwrap() {
            Advanced::Next(next) => next,
            Advanced::Done(_) => unreachable!(),
        };
        let mut server = advance(server);
        let mut shares = Vec::new();
        let mut next_clients = Vec::new();
        for (i, client) in clients.into_iter().enumerate() {
            let (client, reply) = client.handle(server.message_for(id(i)).unwrap(), &mut rngs[i]);
            let reply = reply.unwrap();
            let encoded = reply.encode();
            server.receive(id(i), reply).unwrap();
            shares.push(encoded);
            next_clients.push(client);
        }
        let server = advance(server);
        let client = next_clients.remove(0);
        let (_, reply) = client.handle(server.message_for(id(0)).unwrap(), &mut rngs[0]);
        Fixture { config, keys, shares, honest: reply.unwrap().encode() }
    })
}

/// A server in the masked-input stage.
fn server() -> ServerRound {
    let fixture = fixture();
    let mut server = ServerRound::new(fixture.config.clone()).unwrap();
    for stage in [&fixture.keys, &fixture.shares] {
        for (i, bytes) in stage.iter().enumerate() {
            server.receive(id(i), ClientMessage::decode(bytes).unwrap()).unwrap();
        }
        server = match server.advance().unwrap() {
            Advanced::Next(next) => next,
            Advanced::Done(_) => unreachable!(),
        };
    }
    server
}

/// Hands `bytes` over in pieces cut by `cuts`; retracts on refusal.
fn in_pieces(server: &mut ServerRound, bytes: &[u8], mut cuts: u8) -> bool {
    if bytes.len() < MASKED_INPUT_HEADER_LEN {
        return server.begin_input(id(0), bytes).is_ok();
    }
    let (header, body) = bytes.split_at(MASKED_INPUT_HEADER_LEN);
    let Ok(mut input) = server.begin_input(id(0), header) else { return false };
    let mut at = 0;
    let mut accepted = true;
    while at < body.len() {
        let step = 1 + usize::from(cuts % 23);
        cuts = cuts.rotate_left(3) ^ 0x5b;
        let end = (at + step).min(body.len());
        if server.continue_input(&mut input, &body[at..end]).is_err() {
            accepted = false;
            break;
        }
        at = end;
    }
    accepted = accepted && server.finish_input(&mut input).is_ok();
    if !accepted {
        let read = |offset: usize, buffer: &mut [u8]| {
            buffer.copy_from_slice(&body[offset..offset + buffer.len()]);
            Ok::<(), ()>(())
        };
        server.retract_input(input, read).unwrap();
    }
    accepted
}

fuzz_target!(|data: &[u8]| {
    let Some((&cuts, message)) = data.split_first() else { return };
    // Half the inputs start from the honest message, edited.
    let mut bytes = message.to_vec();
    if cuts & 1 == 1 {
        let honest = &fixture().honest;
        bytes = honest.clone();
        for (i, byte) in message.iter().enumerate().take(8) {
            let at = usize::from(*byte) * 7 + i;
            if at < bytes.len() {
                bytes[at] ^= message.get(i + 8).copied().unwrap_or(1);
            }
        }
        if message.len() > 16 {
            bytes.truncate(bytes.len().saturating_sub(usize::from(message[16] % 4)));
            bytes.extend_from_slice(&message[17..message.len().min(19)]);
        }
    }
    let whole = server().receive_encoded(id(0), &bytes).is_ok();
    let mut streamed = server();
    assert_eq!(in_pieces(&mut streamed, &bytes, cuts), whole);
    if !whole {
        // Taken back out: the honest input is accepted after it.
        assert!(in_pieces(&mut streamed, &fixture().honest, cuts));
    }
});
