//! The host's half of a deferred client step, in JavaScript's terms.
//!
//! A client step that needs X25519 agreements or mask key streams can leave
//! them to the page ([`cohort_client::participant::Participant::set_host_crypto`]),
//! which computes them with WebCrypto (`web/static/webcrypto.js`): in
//! Chromium its AES-CTR runs on AES-NI and its X25519 is BoringSSL's 64-bit
//! code, where this wasm build has neither. This module turns the core's
//! [`Work`] into what JavaScript reads (a JSON description without secrets,
//! the key bytes as `Uint8Array`s) and the page's results back into what
//! the core takes. The keys cross to JavaScript as byte arrays the page
//! wipes once WebCrypto has imported them; see THREAT_MODEL claim 80.

use cohort_client::protocol::Secret32;
use cohort_client::protocol::client::Work;
use serde_json::{Value, json};
use zeroize::{Zeroize, Zeroizing};

/// The JSON of a `host_work` action for step number `step` (see
/// `Participant::host_step`): what is asked for, never a key.
pub fn describe(work: &Work<'_>, step: u64) -> Value {
    match work {
        Work::Agreements { peers, .. } => {
            json!({ "kind": "host_work", "step": step, "work": "agreements", "peers": peers.len() })
        }
        Work::KeyStreams { masks, words } => json!({
            "kind": "host_work", "step": step, "work": "key_streams", "masks": masks.len(), "words": words,
        }),
    }
}

/// The secret key of [`Work::Agreements`] (32 bytes), or nothing.
pub fn secret(work: Option<Work<'_>>) -> Option<Zeroizing<Vec<u8>>> {
    match work? {
        Work::Agreements { secret, .. } => Some(Zeroizing::new(secret.bytes().to_vec())),
        Work::KeyStreams { .. } => None,
    }
}

/// The peers' public keys of [`Work::Agreements`], 32 bytes each in order.
pub fn peers(work: Option<Work<'_>>) -> Option<Vec<u8>> {
    match work? {
        Work::Agreements { peers, .. } => Some(peers.concat()),
        Work::KeyStreams { .. } => None,
    }
}

/// The AES-128 key of mask `index` of [`Work::KeyStreams`], unless its
/// stream was added.
pub fn key(work: Option<Work<'_>>, index: usize) -> Option<Zeroizing<Vec<u8>>> {
    match work? {
        Work::KeyStreams { masks, .. } => {
            masks.get(index).filter(|mask| !mask.added()).map(|mask| Zeroizing::new(mask.key().to_vec()))
        }
        Work::Agreements { .. } => None,
    }
}

/// A JavaScript copy of `bytes` (a new `Uint8Array`): the Rust copy is
/// wiped when the caller drops it, where a returned `Vec` would be freed
/// unwiped once wasm-bindgen had copied it. (Only on wasm32: natively
/// there is no JavaScript to copy to.)
pub fn to_js(bytes: Option<Zeroizing<Vec<u8>>>) -> Option<js_sys::Uint8Array> {
    bytes.map(|bytes| js_sys::Uint8Array::from(&bytes[..]))
}

/// The page's agreements: `shared` holds 32 bytes per peer, in order, and
/// `supplied` one byte per peer, non-zero where the page computed that
/// agreement (the core computes the others). `None` when the lengths do
/// not fit each other.
/// `shared` is wiped.
pub fn agreements(shared: &mut [u8], supplied: &[u8]) -> Option<Vec<Option<Secret32>>> {
    if shared.len() != supplied.len() * 32 {
        shared.zeroize();
        return None;
    }
    let taken = Some(
        shared
            .chunks_exact(32)
            .zip(supplied)
            .map(|(bytes, &given)| {
                (given != 0).then(|| {
                    let mut copy: [u8; 32] = bytes.try_into().unwrap_or([0; 32]);
                    Secret32::from_bytes(&mut copy)
                })
            })
            .collect(),
    );
    shared.zeroize();
    taken
}
