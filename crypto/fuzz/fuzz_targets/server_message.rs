//! Decodes arbitrary bytes as a server message (including the round
//! configuration). Decoding must never panic, and whatever decodes must
//! re-encode to the same bytes.
#![no_main]

use cohort_crypto::ServerMessage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = ServerMessage::decode(data) {
        assert_eq!(message.encode(), data);
    }
});
