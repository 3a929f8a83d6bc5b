//! Decodes arbitrary bytes as a norm proof for a fixed statement. Decoding
//! and verifying must never panic, whatever decodes must re-encode to the
//! same bytes, and nothing but a real proof verifies.
#![no_main]

use std::sync::OnceLock;

use cohort_crypto::validation::{NormBound, NormProof, verify};
use libfuzzer_sys::fuzz_target;
use rand_chacha::ChaCha20Rng;
use rand_core::SeedableRng;

fn bound() -> &'static NormBound {
    static BOUND: OnceLock<NormBound> = OnceLock::new();
    // 40 coordinates: 32 columns, a proof of a few kilobytes.
    BOUND.get_or_init(|| NormBound::new(40, 1 << 20).expect("valid parameters"))
}

fuzz_target!(|data: &[u8]| {
    let bound = bound();
    // Short inputs are stretched to the proof's length, so that decoding
    // gets past the length check and exercises every field.
    let mut bytes = data.to_vec();
    if bytes.len() < bound.proof_len() {
        bytes.resize(bound.proof_len(), 0);
    }
    if let Ok(proof) = NormProof::decode(bound, &bytes) {
        assert_eq!(proof.to_bytes(), bytes);
        let mut rng = ChaCha20Rng::from_seed([7; 32]);
        assert!(verify(bound, b"fuzz", &proof, &mut rng).is_err(), "a proof out of nowhere verified");
    }
});
