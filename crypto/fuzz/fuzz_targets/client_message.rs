//! Decodes arbitrary bytes as a client message. Decoding must never panic,
//! and whatever decodes must re-encode to the same bytes (the encoding is
//! canonical, so a message has exactly one valid form).
#![no_main]

use cohort_crypto::ClientMessage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = ClientMessage::decode(data) {
        assert_eq!(message.encode(), data);
    }
});
