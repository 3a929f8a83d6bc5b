//! Statistical tests of what the server sees: a single masked input, and a
//! masked input after the server removed the self mask it is allowed to
//! reconstruct, are both indistinguishable from uniform.

use std::sync::Arc;

use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

use crate::graph::GraphSpec;
use crate::messages::{ClientMessage, ServerMessage};
use crate::prg::MaskSign;
use crate::quantize::{QuantizationSpec, QuantizedInput};
use crate::server::{Advanced, ServerRound};
use crate::shamir::{Reconstructor, Share};
use crate::{Client, ClientId, RoundConfig, Variant, derive};

const DIM: usize = 1 << 16;

/// Pearson's χ² statistic of the byte at `shift` over 256 equiprobable bins.
fn chi_square(values: &[u32], shift: u32) -> f64 {
    let mut bins = [0u64; 256];
    for v in values {
        bins[((v >> shift) & 0xff) as usize] += 1;
    }
    let expected = values.len() as f64 / 256.0;
    bins.iter().map(|&o| (o as f64 - expected).powi(2) / expected).sum()
}

/// χ² with 255 degrees of freedom exceeds 370 with probability below 10^-6.
const CRITICAL: f64 = 370.0;

fn looks_uniform(values: &[u32]) -> bool {
    [0, 8, 16, 24].iter().all(|&shift| chi_square(values, shift) < CRITICAL)
}

struct Transcript {
    masked_input_of_1: Vec<u32>,
    input_of_1: Vec<u32>,
    self_mask_shares_of_1: Vec<Share>,
    context: crate::RoundContext,
}

/// Runs a 3-client round by hand and keeps what the server saw of client 1.
fn run_round(seed: u64) -> Transcript {
    run_round_in_ring(seed, 32)
}

/// The same in Z_{2^bits}, as compressed (few-bit) rounds use.
fn run_round_in_ring(seed: u64, bits: u8) -> Transcript {
    let limit = (((1u64 << bits) - 1) / 3).min(1000) as u32;
    let config = RoundConfig {
        session: [1; 16],
        round: 9,
        variant: Variant::SemiHonest,
        clients: 3,
        identities: Vec::new(),
        graph: GraphSpec::Complete,
        threshold: 2,
        vector_len: DIM as u32,
        modulus_bits: bits,
        quantization: QuantizationSpec {
            clip: 1.0,
            max_weight: 1,
            transform: crate::Transform::None,
            metrics: crate::MetricSet::NONE,
            privacy: None,
            validation: None,
            scale: None,
        },
        model: None,
    };
    // A highly structured input: a ramp, far from uniform.
    let input: Vec<u32> = (0..DIM as u32).map(|i| i % limit).collect();
    let mut server = ServerRound::new(config.clone()).unwrap();
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let ids: Vec<ClientId> = (1..=3).filter_map(ClientId::new).collect();
    let mut clients = Vec::new();
    let mut replies = Vec::new();
    for &id in &ids {
        let setup = server.setup_message();
        let x = QuantizedInput::from_values(input.clone());
        let (client, reply) = Client::start(setup, id, None::<Arc<_>>, x, &mut rng).unwrap();
        clients.push(Some(client));
        replies.push(reply);
    }
    let mut transcript = Transcript {
        masked_input_of_1: Vec::new(),
        input_of_1: input,
        self_mask_shares_of_1: Vec::new(),
        context: config.context(),
    };
    loop {
        for (&id, reply) in ids.iter().zip(replies.drain(..)) {
            match reply {
                ClientMessage::MaskedInput { ref vector, .. } if id.get() == 1 => {
                    transcript.masked_input_of_1 = vector.values.clone();
                }
                ClientMessage::Unmasking { ref shares, .. } if id.get() != 1 => {
                    for (owner, share) in &shares.self_mask {
                        if owner.get() == 1 {
                            let mut bytes = Vec::new();
                            share.encode_into(&mut bytes);
                            let fixed = bytes.as_slice().try_into().unwrap();
                            transcript.self_mask_shares_of_1.push(Share::decode(fixed).unwrap());
                        }
                    }
                }
                _ => {}
            }
            server.receive(id, reply).unwrap();
        }
        server = match server.advance().unwrap() {
            Advanced::Done(_) => return transcript,
            Advanced::Next(next) => next,
        };
        for (&id, slot) in ids.iter().zip(clients.iter_mut()) {
            let message: ServerMessage = server.message_for(id).unwrap();
            let (next, reply) = slot.take().unwrap().handle(message, &mut rng);
            *slot = Some(next);
            replies.push(reply.unwrap());
        }
    }
}

#[test]
fn a_single_masked_input_is_indistinguishable_from_uniform() {
    for seed in 0..3 {
        let transcript = run_round(seed);
        // The test can fail: the raw input is rejected outright.
        assert!(!looks_uniform(&transcript.input_of_1));
        assert!(looks_uniform(&transcript.masked_input_of_1), "seed {seed}");
    }
}

#[test]
fn removing_the_reconstructed_self_mask_still_leaves_a_uniform_vector() {
    let transcript = run_round(42);
    // The server legitimately reconstructs b_1 (client 1 survived)...
    let shares: Vec<&Share> = transcript.self_mask_shares_of_1.iter().collect();
    let seed = Reconstructor::new().reconstruct(&shares, 2).unwrap();
    let mut view = transcript.masked_input_of_1.clone();
    derive::self_mask(&seed, &transcript.context, ClientId::new(1).unwrap())
        .apply(&mut view, MaskSign::Subtract);
    // ...but the pairwise masks with the other survivors remain.
    assert!(looks_uniform(&view));
    assert_ne!(view, transcript.input_of_1);
}

/// Compressed rounds use small rings (b bits plus headroom): a masked
/// input is uniform there too. Checked on the low and the high byte of
/// each 10-bit value.
#[test]
fn a_masked_input_in_a_small_ring_is_uniform_too() {
    let bits = 10;
    let transcript = run_round_in_ring(7, bits);
    assert!(transcript.masked_input_of_1.iter().all(|&v| v < 1 << bits));
    for shift in [0, u32::from(bits) - 8] {
        assert!(chi_square(&transcript.input_of_1, shift) > CRITICAL, "the raw input is rejected");
        assert!(chi_square(&transcript.masked_input_of_1, shift) < CRITICAL, "shift {shift}");
    }
}
