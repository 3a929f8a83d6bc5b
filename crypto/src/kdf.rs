//! HKDF-SHA256 (RFC 5869, via `ring`) with the crate's domain-separation labels.
//!
//! Every key the protocol uses is derived with a distinct label, the round
//! context as salt, and the identities it belongs to in `info`, so that no
//! two purposes, rounds or pairs can ever share a key.

use ring::hkdf;

/// Label for the AES-CTR key of a pairwise mask between two clients.
pub(crate) const LABEL_PAIRWISE_MASK: &[u8] = b"cohort/secagg/v1/pairwise-mask";
/// Label for the AES-CTR key of a client's self mask.
pub(crate) const LABEL_SELF_MASK: &[u8] = b"cohort/secagg/v1/self-mask";
/// Label for the seed of the permutation that places clients on the ring.
pub(crate) const LABEL_GRAPH_PLACEMENT: &[u8] = b"cohort/secagg/v2/graph-placement";
/// Label for the seed of the noise one client adds and a neighbour verifies
/// (private, validated rounds).
pub(crate) const LABEL_NOISE_EDGE: &[u8] = b"cohort/validation/v1/noise-edge";
/// Label for the AES-GCM key that seals shares from one client to another.
pub(crate) const LABEL_SHARE_ENVELOPE: &[u8] = b"cohort/secagg/v1/share-envelope";

struct OutputLength(usize);

impl hkdf::KeyType for OutputLength {
    fn len(&self) -> usize {
        self.0
    }
}

/// Fills `out` with HKDF-SHA256(salt, ikm, info), where `info` is the
/// concatenation of its parts.
///
/// # Panics
/// If `out` is longer than 255 × 32 bytes, the limit of RFC 5869. Every
/// caller in this crate asks for at most 32 bytes.
pub fn hkdf_sha256(salt: &[u8], ikm: &[u8], info: &[&[u8]], out: &mut [u8]) {
    let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, salt).extract(ikm);
    let okm = prk
        .expand(info, OutputLength(out.len()))
        .unwrap_or_else(|_| panic!("HKDF output of {} bytes exceeds RFC 5869's limit", out.len()));
    okm.fill(out).unwrap_or_else(|_| panic!("HKDF output of {} bytes exceeds RFC 5869's limit", out.len()));
}
