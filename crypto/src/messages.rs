//! Typed protocol messages and their versioned binary encoding.
//!
//! Server → client: [`ServerMessage`]; client → server: [`ClientMessage`].
//! The sender of a client message is not part of the encoding: the transport
//! authenticates it. Lists keyed by client id are strictly ascending, which
//! makes the encoding canonical and rules out duplicates at decode time.

use crate::config::{MAX_CLIENTS, MAX_VECTOR_LEN, RoundConfig, RoundContext};

/// Longest norm proof a message may carry (a proof for 2^24 coordinates is
/// about 150 KB).
const MAX_PROOF_LEN: usize = 1 << 20;
use crate::envelope::TAG_LEN;
use crate::error::Stage;
use crate::ids::ClientId;
use crate::shamir::{SHARE_LEN, Share};
use crate::signature::SIGNATURE_LEN;
use crate::wire::{DecodeError, Reader, Writer, pack, packed_len, padding_is_zero, unpack};

/// Plaintext of a share envelope: the self-mask share and the key share.
pub(crate) const ENVELOPE_PLAINTEXT_LEN: usize = 2 * SHARE_LEN;
/// Size of one sealed share envelope.
pub const ENVELOPE_LEN: usize = ENVELOPE_PLAINTEXT_LEN + TAG_LEN;

const KIND_SETUP: u8 = 0x01;
const KIND_PEER_KEYS: u8 = 0x02;
const KIND_SHARES: u8 = 0x03;
const KIND_SURVIVORS: u8 = 0x04;
const KIND_SIGNATURES: u8 = 0x05;
const KIND_ADVERTISE_KEYS: u8 = 0x11;
const KIND_SHARE_KEYS: u8 = 0x12;
const KIND_MASKED_INPUT: u8 = 0x13;
const KIND_CONSISTENCY: u8 = 0x14;
const KIND_UNMASKING: u8 = 0x15;

/// One peer's advertised keys, as relayed by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdvertisedKeys {
    /// The peer.
    pub id: ClientId,
    /// X25519 key for share envelopes (c_pk).
    pub cipher_key: [u8; 32],
    /// X25519 key for pairwise masks (s_pk).
    pub mask_key: [u8; 32],
    /// Commitment to the self-mask seed b_u: the server checks the seed it
    /// reconstructs against it (see [`crate::shamir::Reconstructor::reconstruct_checked`]).
    pub seed_commitment: [u8; 32],
    /// Ed25519 signature over both keys and the commitment (active variant).
    pub signature: Option<[u8; SIGNATURE_LEN]>,
}

/// A sealed share envelope and the other end of it (the sender when the
/// server delivers it, the receiver when a client sends it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Envelope {
    /// The peer at the other end.
    pub peer: ClientId,
    /// AES-GCM ciphertext of [`ENVELOPE_LEN`] bytes.
    pub ciphertext: Vec<u8>,
}

/// A commitment to the noise of one edge of a private, validated round
/// ([`crate::validation::noise`]): sent by both ends, the client that adds
/// the noise (its owner) and the neighbour that verifies it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoiseAttestation {
    /// The client that adds the edge's noise.
    pub owner: ClientId,
    /// The neighbour that verifies it.
    pub verifier: ClientId,
    /// From the verifier, the row commitments
    /// ([`crate::validation::Commitment::to_bytes`]); from the owner, their
    /// digest ([`crate::validation::noise::commitment_digest`]).
    pub commitment: Vec<u8>,
}

/// Messages from the server to one client.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ServerMessage {
    /// The round's public parameters; opens the round.
    Setup(RoundConfig),
    /// The keys of the client's neighbours that advertised (U1).
    PeerKeys {
        /// Round binding.
        context: RoundContext,
        /// Neighbours' keys, ascending by id.
        peers: Vec<AdvertisedKeys>,
    },
    /// The envelopes the client's neighbours sealed for it (U2).
    Shares {
        /// Round binding.
        context: RoundContext,
        /// Envelopes, ascending by sender.
        envelopes: Vec<Envelope>,
    },
    /// The clients whose masked input the server received (U3).
    Survivors {
        /// Round binding.
        context: RoundContext,
        /// Survivors, ascending.
        survivors: Vec<ClientId>,
    },
    /// Signatures over the survivor list (U4, active variant).
    Signatures {
        /// Round binding.
        context: RoundContext,
        /// Signers and signatures, ascending by signer.
        signatures: Vec<(ClientId, [u8; SIGNATURE_LEN])>,
    },
}

/// A client's masked input vector in Z_{2^bits}.
#[derive(Clone, PartialEq, Eq)]
pub struct MaskedVector {
    /// Bits per coordinate.
    pub bits: u8,
    /// Coordinates, each below 2^bits.
    pub values: Vec<u32>,
}

impl core::fmt::Debug for MaskedVector {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MaskedVector")
            .field("bits", &self.bits)
            .field("len", &self.values.len())
            .finish_non_exhaustive()
    }
}

/// Shares revealed in the unmasking stage, keyed by the client they belong to.
pub struct UnmaskingShares {
    /// Shares of surviving neighbours' self-mask seeds b_v.
    pub self_mask: Vec<(ClientId, Share)>,
    /// Shares of dropped neighbours' mask keys s_sk_v.
    pub mask_key: Vec<(ClientId, Share)>,
}

/// Messages from a client to the server.
#[non_exhaustive]
pub enum ClientMessage {
    /// The client's two public keys.
    AdvertiseKeys {
        /// Round binding.
        context: RoundContext,
        /// c_pk.
        cipher_key: [u8; 32],
        /// s_pk.
        mask_key: [u8; 32],
        /// Commitment to the self-mask seed b_u.
        seed_commitment: [u8; 32],
        /// Signature over the keys and the commitment (active variant).
        signature: Option<[u8; SIGNATURE_LEN]>,
    },
    /// One sealed envelope per neighbour in U1.
    ShareKeys {
        /// Round binding.
        context: RoundContext,
        /// Envelopes, ascending by receiver.
        envelopes: Vec<Envelope>,
        /// In a validated round, the commitment to the client's input and
        /// its norm proof ([`crate::validation::NormProof::to_bytes`]).
        proof: Option<Vec<u8>>,
        /// In a private, validated round, the commitments to the noise of
        /// every edge this client is an end of (its own edges to the
        /// verifiers that advertised keys, and those of the neighbours it
        /// verifies), ascending by (owner, verifier).
        noise: Vec<NoiseAttestation>,
    },
    /// The masked input y_u.
    MaskedInput {
        /// Round binding.
        context: RoundContext,
        /// The vector.
        vector: MaskedVector,
    },
    /// Signature over the survivor list (active variant).
    Consistency {
        /// Round binding.
        context: RoundContext,
        /// The signature.
        signature: [u8; SIGNATURE_LEN],
    },
    /// Shares that let the server remove the masks.
    Unmasking {
        /// Round binding.
        context: RoundContext,
        /// The shares.
        shares: UnmaskingShares,
    },
}

impl core::fmt::Debug for ClientMessage {
    /// Prints the kind only: an unmasking message holds secret shares.
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ClientMessage").field("stage", &self.stage()).finish_non_exhaustive()
    }
}

impl ClientMessage {
    /// The largest well-formed message a client may send in `stage` of a
    /// round with `config`: what a transport may read before it decodes.
    /// Stages in which clients send nothing get 0.
    ///
    /// The bound follows the encoding below: a 4-byte header, the 32-byte
    /// round context, then per stage the keys, the seed commitment and the
    /// optional signature, one envelope per neighbour, the packed vector at
    /// the round's ring width, a signature, or one share per neighbour (and
    /// one for the client itself).
    pub fn max_encoded_len(config: &RoundConfig, stage: Stage) -> usize {
        const HEADER: usize = 4 + 32;
        let neighbours = match config.graph {
            crate::graph::GraphSpec::Complete => config.clients.saturating_sub(1),
            crate::graph::GraphSpec::Harary { degree, .. } => degree.min(config.clients.saturating_sub(1)),
        } as usize;
        match stage {
            Stage::AdvertiseKeys => HEADER + 32 + 32 + 32 + 1 + SIGNATURE_LEN,
            Stage::ShareKeys => {
                let validation = crate::validation::RoundValidation::new(config).ok().flatten();
                let proof = validation.as_ref().map_or(0, |v| 4 + v.bound().proof_len());
                let attestation =
                    validation.as_ref().filter(|v| v.edge_variance().is_some()).map_or(0, |v| {
                        // Three attested commitments and three digests.
                        crate::validation::noise::NOISE_VERIFIERS
                            * (12 + crate::validation::Commitment::encoded_len(v.bound()) + 12 + 32)
                    });
                HEADER + 4 + neighbours * (4 + ENVELOPE_LEN) + 1 + proof + 4 + attestation
            }
            Stage::MaskedInputCollection => {
                HEADER + 1 + 4 + packed_len(config.vector_len as usize, config.modulus_bits)
            }
            Stage::ConsistencyCheck => HEADER + SIGNATURE_LEN,
            Stage::Unmasking => HEADER + 4 + 4 + (neighbours + 1) * (4 + SHARE_LEN),
            Stage::Setup | Stage::Finished => 0,
        }
    }
}

impl ServerMessage {
    /// The stage this message drives the client into.
    pub fn stage(&self) -> Stage {
        match self {
            ServerMessage::Setup(_) => Stage::Setup,
            ServerMessage::PeerKeys { .. } => Stage::ShareKeys,
            ServerMessage::Shares { .. } => Stage::MaskedInputCollection,
            ServerMessage::Survivors { .. } => Stage::ConsistencyCheck,
            ServerMessage::Signatures { .. } => Stage::Unmasking,
        }
    }

    /// The round context the message is bound to (none for the setup,
    /// which defines it).
    pub fn context(&self) -> Option<&RoundContext> {
        match self {
            ServerMessage::Setup(_) => None,
            ServerMessage::PeerKeys { context, .. }
            | ServerMessage::Shares { context, .. }
            | ServerMessage::Survivors { context, .. }
            | ServerMessage::Signatures { context, .. } => Some(context),
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ServerMessage::Setup(config) => {
                let mut w = Writer::with_header(KIND_SETUP, 128 + 32 * config.identities.len());
                config.encode_into(&mut w);
                w.finish()
            }
            ServerMessage::PeerKeys { context, peers } => {
                let mut w = Writer::with_header(KIND_PEER_KEYS, 36 + peers.len() * 165);
                w.bytes(&context.0).count(peers.len());
                for peer in peers {
                    w.u32(peer.id.get()).bytes(&peer.cipher_key).bytes(&peer.mask_key);
                    w.bytes(&peer.seed_commitment);
                    write_signature(&mut w, peer.signature.as_ref());
                }
                w.finish()
            }
            ServerMessage::Shares { context, envelopes } => encode_envelopes(KIND_SHARES, context, envelopes),
            ServerMessage::Survivors { context, survivors } => {
                let mut w = Writer::with_header(KIND_SURVIVORS, 36 + 4 * survivors.len());
                w.bytes(&context.0).count(survivors.len());
                for id in survivors {
                    w.u32(id.get());
                }
                w.finish()
            }
            ServerMessage::Signatures { context, signatures } => {
                let mut w = Writer::with_header(KIND_SIGNATURES, 36 + 68 * signatures.len());
                w.bytes(&context.0).count(signatures.len());
                for (id, sig) in signatures {
                    w.u32(id.get()).bytes(sig);
                }
                w.finish()
            }
        }
    }

    /// Decodes a message, validating every field.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let (mut r, kind) = Reader::with_header(bytes)?;
        let message = match kind {
            KIND_SETUP => ServerMessage::Setup(RoundConfig::decode_from(&mut r)?),
            KIND_PEER_KEYS => {
                let context = RoundContext(r.array()?);
                let count = r.count(MAX_CLIENTS as usize, 101, "peer list")?;
                let mut ids = AscendingIds::default();
                let mut peers = Vec::with_capacity(count);
                for _ in 0..count {
                    let id = ids.next(&mut r)?;
                    let cipher_key = r.array()?;
                    let mask_key = r.array()?;
                    let seed_commitment = r.array()?;
                    let signature = read_signature(&mut r)?;
                    peers.push(AdvertisedKeys { id, cipher_key, mask_key, seed_commitment, signature });
                }
                ServerMessage::PeerKeys { context, peers }
            }
            KIND_SHARES => {
                let (context, envelopes) = decode_envelopes(&mut r)?;
                ServerMessage::Shares { context, envelopes }
            }
            KIND_SURVIVORS => {
                let context = RoundContext(r.array()?);
                let count = r.count(MAX_CLIENTS as usize, 4, "survivor list")?;
                let mut ids = AscendingIds::default();
                let survivors = (0..count).map(|_| ids.next(&mut r)).collect::<Result<_, _>>()?;
                ServerMessage::Survivors { context, survivors }
            }
            KIND_SIGNATURES => {
                let context = RoundContext(r.array()?);
                let count = r.count(MAX_CLIENTS as usize, 4 + SIGNATURE_LEN, "signature list")?;
                let mut ids = AscendingIds::default();
                let signatures =
                    (0..count)
                        .map(|_| Ok((ids.next(&mut r)?, r.array()?)))
                        .collect::<Result<_, DecodeError>>()?;
                ServerMessage::Signatures { context, signatures }
            }
            other => return Err(DecodeError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(message)
    }
}

impl ClientMessage {
    /// The stage this message belongs to.
    pub fn stage(&self) -> Stage {
        match self {
            ClientMessage::AdvertiseKeys { .. } => Stage::AdvertiseKeys,
            ClientMessage::ShareKeys { .. } => Stage::ShareKeys,
            ClientMessage::MaskedInput { .. } => Stage::MaskedInputCollection,
            ClientMessage::Consistency { .. } => Stage::ConsistencyCheck,
            ClientMessage::Unmasking { .. } => Stage::Unmasking,
        }
    }

    /// The round context the message is bound to.
    pub fn context(&self) -> &RoundContext {
        match self {
            ClientMessage::AdvertiseKeys { context, .. }
            | ClientMessage::ShareKeys { context, .. }
            | ClientMessage::MaskedInput { context, .. }
            | ClientMessage::Consistency { context, .. }
            | ClientMessage::Unmasking { context, .. } => context,
        }
    }

    /// Encodes the message.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            ClientMessage::AdvertiseKeys { context, cipher_key, mask_key, seed_commitment, signature } => {
                let mut w = Writer::with_header(KIND_ADVERTISE_KEYS, 196);
                w.bytes(&context.0).bytes(cipher_key).bytes(mask_key).bytes(seed_commitment);
                write_signature(&mut w, signature.as_ref());
                w.finish()
            }
            ClientMessage::ShareKeys { context, envelopes, proof, noise } => {
                let proof_len = proof.as_ref().map_or(0, |p| 4 + p.len());
                let noise_len: usize = noise.iter().map(|a| 12 + a.commitment.len()).sum();
                let mut w = Writer::with_header(
                    KIND_SHARE_KEYS,
                    41 + envelopes.len() * (4 + ENVELOPE_LEN) + proof_len + noise_len,
                );
                write_envelopes(&mut w, context, envelopes);
                match proof {
                    None => {
                        w.u8(0);
                    }
                    Some(proof) => {
                        w.u8(1).count(proof.len()).bytes(proof);
                    }
                }
                w.count(noise.len());
                for attestation in noise {
                    w.u32(attestation.owner.get()).u32(attestation.verifier.get());
                    w.count(attestation.commitment.len()).bytes(&attestation.commitment);
                }
                w.finish()
            }
            ClientMessage::MaskedInput { context, vector } => {
                let len = packed_len(vector.values.len(), vector.bits);
                let mut w = Writer::with_header(KIND_MASKED_INPUT, 37 + 4 + len);
                w.bytes(&context.0).u8(vector.bits).count(vector.values.len());
                pack(&vector.values, vector.bits, w.buffer());
                w.finish()
            }
            ClientMessage::Consistency { context, signature } => {
                let mut w = Writer::with_header(KIND_CONSISTENCY, 96);
                w.bytes(&context.0).bytes(signature);
                w.finish()
            }
            ClientMessage::Unmasking { context, shares } => {
                let entries = shares.self_mask.len() + shares.mask_key.len();
                let mut w = Writer::with_header(KIND_UNMASKING, 40 + entries * (4 + SHARE_LEN));
                w.bytes(&context.0);
                for list in [&shares.self_mask, &shares.mask_key] {
                    w.count(list.len());
                    for (owner, share) in list {
                        w.u32(owner.get());
                        share.encode_into(w.buffer());
                    }
                }
                w.finish()
            }
        }
    }

    /// Decodes a message, validating every field.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let (mut r, kind) = Reader::with_header(bytes)?;
        if !(KIND_ADVERTISE_KEYS..=KIND_UNMASKING).contains(&kind) {
            return Err(DecodeError::UnknownKind(kind));
        }
        let context = RoundContext(r.array()?);
        let message = match kind {
            KIND_ADVERTISE_KEYS => {
                let cipher_key = r.array()?;
                let mask_key = r.array()?;
                let seed_commitment = r.array()?;
                let signature = read_signature(&mut r)?;
                ClientMessage::AdvertiseKeys { context, cipher_key, mask_key, seed_commitment, signature }
            }
            KIND_SHARE_KEYS => {
                let envelopes = decode_envelope_list(&mut r)?;
                let proof = match r.u8()? {
                    0 => None,
                    1 => {
                        let len = r.count(MAX_PROOF_LEN, 1, "proof")?;
                        Some(r.take(len)?.to_vec())
                    }
                    _ => return Err(DecodeError::Invalid("proof flag")),
                };
                let count =
                    r.count(2 * crate::validation::noise::NOISE_VERIFIERS, 13, "noise attestations")?;
                let mut noise: Vec<NoiseAttestation> = Vec::with_capacity(count);
                for _ in 0..count {
                    let owner = ClientId::new(r.u32()?).ok_or(DecodeError::Invalid("client id"))?;
                    let verifier = ClientId::new(r.u32()?).ok_or(DecodeError::Invalid("client id"))?;
                    if noise.last().is_some_and(|last| (last.owner, last.verifier) >= (owner, verifier)) {
                        return Err(DecodeError::Invalid("noise attestations are not in ascending order"));
                    }
                    let len = r.count(MAX_PROOF_LEN, 1, "noise commitment")?;
                    noise.push(NoiseAttestation { owner, verifier, commitment: r.take(len)?.to_vec() });
                }
                ClientMessage::ShareKeys { context, envelopes, proof, noise }
            }
            KIND_MASKED_INPUT => {
                let (bits, len, packed) = read_packed_vector(&mut r)?;
                let values = unpack(packed, len, bits)?;
                ClientMessage::MaskedInput { context, vector: MaskedVector { bits, values } }
            }
            KIND_CONSISTENCY => ClientMessage::Consistency { context, signature: r.array()? },
            KIND_UNMASKING => {
                let self_mask = decode_share_list(&mut r)?;
                let mask_key = decode_share_list(&mut r)?;
                ClientMessage::Unmasking { context, shares: UnmaskingShares { self_mask, mask_key } }
            }
            other => return Err(DecodeError::UnknownKind(other)),
        };
        r.finish()?;
        Ok(message)
    }
}

/// A masked-input message whose vector stays packed in the message's bytes:
/// what [`ClientMessage::decode`] would accept, checked the same way, but
/// never unpacked into a vector of its own (the server adds it straight into
/// its running sum).
pub(crate) struct PackedMaskedInput<'a> {
    pub context: RoundContext,
    pub bits: u8,
    pub len: usize,
    pub packed: &'a [u8],
}

impl<'a> PackedMaskedInput<'a> {
    /// The message in `bytes` when it is a masked input (`None` for any
    /// other kind), with every check of [`ClientMessage::decode`].
    pub(crate) fn peek(bytes: &'a [u8]) -> Result<Option<Self>, DecodeError> {
        let (mut r, kind) = Reader::with_header(bytes)?;
        if kind != KIND_MASKED_INPUT {
            return Ok(None);
        }
        let context = RoundContext(r.array()?);
        let (bits, len, packed) = read_packed_vector(&mut r)?;
        if !padding_is_zero(packed, len, bits) {
            return Err(DecodeError::Invalid("padding bits"));
        }
        r.finish()?;
        Ok(Some(Self { context, bits, len, packed }))
    }
}

/// Bytes before a masked input's packed values: the message header, the
/// round context, the width and the length. A server that receives a
/// masked input in pieces reads these first
/// ([`crate::ServerRound::begin_input`]).
pub const MASKED_INPUT_HEADER_LEN: usize = 4 + 32 + 1 + 4;

/// Whether `prefix`, the first bytes of a client message, begins a masked
/// input (its magic and kind; everything else is checked when it is read).
pub fn starts_masked_input(prefix: &[u8]) -> bool {
    prefix.len() >= 4 && prefix[..2] == crate::wire::MAGIC && prefix[3] == KIND_MASKED_INPUT
}

/// Whether `prefix`, the first bytes of a client message, begins an
/// unmasking message: a client's last message of its round (its magic and
/// kind; everything else is checked when it is read).
pub fn starts_unmasking(prefix: &[u8]) -> bool {
    prefix.len() >= 4 && prefix[..2] == crate::wire::MAGIC && prefix[3] == KIND_UNMASKING
}

/// What a masked input's first [`MASKED_INPUT_HEADER_LEN`] bytes say.
pub(crate) struct MaskedInputHeader {
    pub context: RoundContext,
    pub bits: u8,
    pub len: usize,
}

impl MaskedInputHeader {
    /// Reads a masked input's header from exactly
    /// [`MASKED_INPUT_HEADER_LEN`] bytes, with the checks
    /// [`ClientMessage::decode`] makes of them.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() < MASKED_INPUT_HEADER_LEN {
            return Err(DecodeError::Truncated);
        }
        if bytes.len() > MASKED_INPUT_HEADER_LEN {
            return Err(DecodeError::TrailingBytes(bytes.len() - MASKED_INPUT_HEADER_LEN));
        }
        let (mut r, kind) = Reader::with_header(bytes)?;
        if kind != KIND_MASKED_INPUT {
            return Err(DecodeError::Invalid("a masked input was expected"));
        }
        let context = RoundContext(r.array()?);
        let (bits, len) = read_width_and_length(&mut r)?;
        r.finish()?;
        Ok(Self { context, bits, len })
    }
}

/// A masked input's width and length.
fn read_width_and_length(r: &mut Reader<'_>) -> Result<(u8, usize), DecodeError> {
    let bits = r.u8()?;
    if !(2..=32).contains(&bits) {
        return Err(DecodeError::Invalid("bits per coordinate"));
    }
    let len = r.count(MAX_VECTOR_LEN as usize, 0, "vector length")?;
    Ok((bits, len))
}

/// A masked input's width, length and packed values.
fn read_packed_vector<'a>(r: &mut Reader<'a>) -> Result<(u8, usize, &'a [u8]), DecodeError> {
    let (bits, len) = read_width_and_length(r)?;
    let packed = r.take(packed_len(len, bits))?;
    Ok((bits, len, packed))
}

/// Reads client ids that must be non-zero and strictly ascending.
#[derive(Default)]
struct AscendingIds {
    last: u32,
}

impl AscendingIds {
    fn next(&mut self, r: &mut Reader<'_>) -> Result<ClientId, DecodeError> {
        let raw = r.u32()?;
        if raw <= self.last || raw > MAX_CLIENTS {
            return Err(DecodeError::Invalid("client id order"));
        }
        self.last = raw;
        ClientId::new(raw).ok_or(DecodeError::Invalid("client id"))
    }
}

/// An optional signature: a flag byte, then the signature if the flag is 1.
fn write_signature(w: &mut Writer, signature: Option<&[u8; SIGNATURE_LEN]>) {
    match signature {
        None => w.u8(0),
        Some(sig) => w.u8(1).bytes(sig),
    };
}

fn read_signature(r: &mut Reader<'_>) -> Result<Option<[u8; SIGNATURE_LEN]>, DecodeError> {
    match r.u8()? {
        0 => Ok(None),
        1 => Ok(Some(r.array()?)),
        _ => Err(DecodeError::Invalid("signature flag")),
    }
}

fn encode_envelopes(kind: u8, context: &RoundContext, envelopes: &[Envelope]) -> Vec<u8> {
    let mut w = Writer::with_header(kind, 36 + envelopes.len() * (4 + ENVELOPE_LEN));
    write_envelopes(&mut w, context, envelopes);
    w.finish()
}

fn write_envelopes(w: &mut Writer, context: &RoundContext, envelopes: &[Envelope]) {
    w.bytes(&context.0).count(envelopes.len());
    for envelope in envelopes {
        w.u32(envelope.peer.get()).bytes(&envelope.ciphertext);
    }
}

fn decode_envelopes(r: &mut Reader<'_>) -> Result<(RoundContext, Vec<Envelope>), DecodeError> {
    let context = RoundContext(r.array()?);
    Ok((context, decode_envelope_list(r)?))
}

fn decode_envelope_list(r: &mut Reader<'_>) -> Result<Vec<Envelope>, DecodeError> {
    let count = r.count(MAX_CLIENTS as usize, 4 + ENVELOPE_LEN, "envelope list")?;
    let mut ids = AscendingIds::default();
    (0..count)
        .map(|_| {
            let peer = ids.next(r)?;
            let ciphertext = r.take(ENVELOPE_LEN)?.to_vec();
            Ok(Envelope { peer, ciphertext })
        })
        .collect()
}

fn decode_share_list(r: &mut Reader<'_>) -> Result<Vec<(ClientId, Share)>, DecodeError> {
    let count = r.count(MAX_CLIENTS as usize, 4 + SHARE_LEN, "share list")?;
    let mut ids = AscendingIds::default();
    (0..count)
        .map(|_| {
            let owner = ids.next(r)?;
            let share = Share::decode(&r.array()?).ok_or(DecodeError::Invalid("share"))?;
            Ok((owner, share))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::wire::add_packed;

    fn masked_input(bits: u8, values: &[u32]) -> Vec<u8> {
        let mask = if bits == 32 { u32::MAX } else { (1u32 << bits) - 1 };
        ClientMessage::MaskedInput {
            context: RoundContext([9; 32]),
            vector: MaskedVector { bits, values: values.iter().map(|v| v & mask).collect() },
        }
        .encode()
    }

    #[test]
    fn a_message_s_first_bytes_say_whether_it_is_a_masked_input_or_an_unmasking() {
        let unmasking = ClientMessage::Unmasking {
            context: RoundContext([9; 32]),
            shares: UnmaskingShares { self_mask: Vec::new(), mask_key: Vec::new() },
        }
        .encode();
        let masked = masked_input(8, &[1, 2, 3]);
        assert!(starts_unmasking(&unmasking[..4]) && !starts_masked_input(&unmasking));
        assert!(starts_masked_input(&masked[..4]) && !starts_unmasking(&masked));
        assert!(!starts_unmasking(&unmasking[..3]), "too short to say");
        let mut foreign = unmasking.clone();
        foreign[0] ^= 1;
        assert!(!starts_unmasking(&foreign), "another magic");
    }

    proptest! {
        /// Reading a masked input in place accepts exactly what decoding
        /// accepts, with the same error, and its packed values add up to
        /// the decoded vector; whatever bytes were changed, cut or added.
        #[test]
        fn a_masked_input_read_in_place_agrees_with_its_decoding(
            bits in 2u8..=32,
            values in proptest::collection::vec(any::<u32>(), 0..40),
            edit in 0usize..4,
            at in any::<usize>(),
            byte in any::<u8>(),
        ) {
            let mut bytes = masked_input(bits, &values);
            let at = at % bytes.len();
            match edit {
                0 => bytes[at] ^= byte | 1,
                1 => bytes.truncate(at),
                2 => bytes.insert(at, byte),
                _ => {}
            }
            match (ClientMessage::decode(&bytes), PackedMaskedInput::peek(&bytes)) {
                (Ok(ClientMessage::MaskedInput { context, vector }), Ok(Some(packed))) => {
                    prop_assert_eq!(packed.context, context);
                    prop_assert_eq!(packed.bits, vector.bits);
                    prop_assert_eq!(packed.len, vector.values.len());
                    let mut sum = vec![0u32; packed.len];
                    add_packed(packed.packed, packed.bits, &mut sum);
                    prop_assert_eq!(sum, vector.values);
                }
                (Ok(other), Ok(None)) => {
                    let is_masked_input = matches!(other, ClientMessage::MaskedInput { .. });
                    prop_assert!(!is_masked_input, "a masked input was not read in place");
                }
                (Err(decoded), Err(peeked)) => prop_assert_eq!(decoded, peeked),
                // Another kind that fails to decode is not the reader's to judge.
                (Err(_), Ok(None)) => {}
                (decoded, peeked) => prop_assert!(false, "decode {:?}, in place {:?}", decoded.map(|m| m.stage()), peeked.map(|p| p.is_some())),
            }
        }
    }
}
