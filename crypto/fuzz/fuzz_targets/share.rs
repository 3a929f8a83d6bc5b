//! Decodes arbitrary bytes as a Shamir share. Decoding must never panic,
//! and whatever decodes must re-encode to the same bytes.
#![no_main]

use cohort_crypto::shamir::{SHARE_LEN, Share};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(bytes) = <[u8; SHARE_LEN]>::try_from(data) else {
        return;
    };
    if let Some(share) = Share::decode(&bytes) {
        let mut encoded = Vec::new();
        share.encode_into(&mut encoded);
        assert_eq!(encoded, data);
    }
});
