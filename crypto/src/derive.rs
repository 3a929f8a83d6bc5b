//! The protocol's key derivations and signed statements, shared by the
//! client and server state machines so that both sides compute them with
//! the same code.

use crate::config::RoundContext;
use crate::envelope::EnvelopeKey;
use crate::ids::ClientId;
use crate::kdf::{LABEL_NOISE_EDGE, LABEL_PAIRWISE_MASK, LABEL_SELF_MASK, LABEL_SHARE_ENVELOPE, hkdf_sha256};
use crate::prg::{MaskPrg, MaskSign};
use crate::secret::Secret32;
use crate::signature::signed_message;
use zeroize::Zeroizing;

const LABEL_ADVERTISE: &[u8] = b"cohort/secagg/v1/advertise-keys";
const LABEL_CONSISTENCY: &[u8] = b"cohort/secagg/v1/consistency";
const LABEL_SEED_COMMITMENT: &[u8] = b"cohort/secagg/v2/seed-commitment";

/// The two single-use envelope keys between `me` and `peer`, from their
/// one key agreement `shared` (X25519 of the cipher keys): the one sealing
/// shares from `me` to `peer`, and the one opening those from `peer` to
/// `me`. Directional: each direction gets its own key.
pub(crate) fn envelope_keys(
    shared: &Secret32,
    context: &RoundContext,
    me: ClientId,
    peer: ClientId,
) -> (EnvelopeKey, EnvelopeKey) {
    let derive = |sender: ClientId, receiver: ClientId| {
        let mut key = [0u8; 32];
        hkdf_sha256(
            &context.0,
            shared.expose(),
            &[LABEL_SHARE_ENVELOPE, &sender.get().to_be_bytes(), &receiver.get().to_be_bytes()],
            &mut key,
        );
        EnvelopeKey::new(Secret32::from_bytes(&mut key))
    };
    (derive(me, peer), derive(peer, me))
}

/// The seed of the noise `owner` adds and `verifier` attests, from their
/// one key agreement `shared` on the cipher keys (which, unlike the mask
/// keys, is never rebuilt for the coordinator). Directional: the edges
/// u → v and v → u have different seeds.
pub(crate) fn noise_edge_seed(
    shared: &Secret32,
    context: &RoundContext,
    owner: ClientId,
    verifier: ClientId,
) -> Secret32 {
    let mut seed = [0u8; 32];
    hkdf_sha256(
        &context.0,
        shared.expose(),
        &[LABEL_NOISE_EDGE, &owner.get().to_be_bytes(), &verifier.get().to_be_bytes()],
        &mut seed,
    );
    Secret32::from_bytes(&mut seed)
}

/// Associated data of an envelope: the round context and both identities.
pub(crate) fn envelope_aad(context: &RoundContext, sender: ClientId, receiver: ClientId) -> [u8; 40] {
    let mut aad = [0u8; 40];
    aad[..32].copy_from_slice(&context.0);
    aad[32..36].copy_from_slice(&sender.get().to_be_bytes());
    aad[36..].copy_from_slice(&receiver.get().to_be_bytes());
    aad
}

/// The generator of `owner`'s self mask PRG(b_owner).
pub(crate) fn self_mask(seed: &Secret32, context: &RoundContext, owner: ClientId) -> MaskPrg {
    MaskPrg::from_key(&self_mask_key(seed, context, owner))
}

/// The AES key of [`self_mask`].
pub(crate) fn self_mask_key(seed: &Secret32, context: &RoundContext, owner: ClientId) -> Zeroizing<[u8; 16]> {
    MaskPrg::derive_key(seed, &context.0, &[LABEL_SELF_MASK, &owner.get().to_be_bytes()])
}

/// The generator of the pairwise mask PRG(s_uv) between `own_id` and
/// `peer`, from their key agreement `shared` (X25519 of the mask keys).
pub(crate) fn pairwise_mask(
    shared: &Secret32,
    context: &RoundContext,
    own_id: ClientId,
    peer: ClientId,
) -> MaskPrg {
    MaskPrg::from_key(&pairwise_mask_key(shared, context, own_id, peer))
}

/// The AES key of [`pairwise_mask`].
pub(crate) fn pairwise_mask_key(
    shared: &Secret32,
    context: &RoundContext,
    own_id: ClientId,
    peer: ClientId,
) -> Zeroizing<[u8; 16]> {
    let (low, high) = if own_id < peer { (own_id, peer) } else { (peer, own_id) };
    MaskPrg::derive_key(
        shared,
        &context.0,
        &[LABEL_PAIRWISE_MASK, &low.get().to_be_bytes(), &high.get().to_be_bytes()],
    )
}

/// How `owner` applies the pairwise mask shared with `peer`: the lower id
/// adds it and the higher id subtracts it, so the pair cancels in the sum.
pub(crate) fn pairwise_sign(owner: ClientId, peer: ClientId) -> MaskSign {
    if owner < peer { MaskSign::Add } else { MaskSign::Subtract }
}

/// The statement a client signs when it advertises its keys and its
/// self-mask seed commitment.
pub(crate) fn advertise_statement(
    context: &RoundContext,
    client: ClientId,
    cipher_key: &[u8; 32],
    mask_key: &[u8; 32],
    seed_commitment: &[u8; 32],
) -> Vec<u8> {
    signed_message(
        LABEL_ADVERTISE,
        &[&context.0, &client.get().to_be_bytes(), cipher_key, mask_key, seed_commitment],
    )
}

/// `owner`'s commitment to its self-mask seed:
/// SHA-256(label ‖ context ‖ owner ‖ b_owner). The seed is 32 uniformly
/// random bytes, so the digest reveals nothing about it; SHA-256's
/// collision resistance means no other seed matches it.
pub(crate) fn seed_commitment(context: &RoundContext, owner: ClientId, seed: &Secret32) -> [u8; 32] {
    let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
    hash.update(LABEL_SEED_COMMITMENT);
    hash.update(&context.0);
    hash.update(&owner.get().to_be_bytes());
    hash.update(seed.expose());
    let mut out = [0u8; 32];
    out.copy_from_slice(hash.finish().as_ref());
    out
}

/// The statement client `signer` signs in the consistency check: its id
/// and the survivor list (with the id, a signature counts for its signer
/// only, whatever the roster says).
pub(crate) fn consistency_statement(
    context: &RoundContext,
    signer: ClientId,
    survivors: &[ClientId],
) -> Vec<u8> {
    let mut ids = Vec::with_capacity(8 + 4 * survivors.len());
    ids.extend_from_slice(&signer.get().to_be_bytes());
    ids.extend_from_slice(&(survivors.len() as u32).to_be_bytes());
    for id in survivors {
        ids.extend_from_slice(&id.get().to_be_bytes());
    }
    signed_message(LABEL_CONSISTENCY, &[&context.0, &ids])
}
