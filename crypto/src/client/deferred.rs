//! A client step whose heavy primitives its host computes.
//!
//! Two stages carry nearly all of a client's work: ShareKeys agrees a key
//! with each neighbour's cipher key, and MaskedInput agrees one with each
//! partner's mask key and adds a key stream as long as the input for each
//! mask. A host whose own primitives are faster than this core's build of
//! them (the browser, whose WebCrypto has AES-NI and a native X25519, where
//! wasm32 has neither) takes that work through
//! [`Client::handle_deferred`]: the step stops at a [`PendingStep`], whose
//! [`Work`] names the agreements or key streams, the host hands results
//! back ([`PendingStep::agreed`], [`PendingStep::add_key_stream`]) and then
//! completes the step ([`PendingStep::complete`]), which computes whatever
//! the host left undone. [`Client::handle`] is this with nothing left to the
//! host: the native client's path, the same code.
//!
//! What the host computes is defined exactly, so that both routes send the
//! same bytes (`a_deferred_step_sends_what_the_step_in_place_sends` and the
//! browser test that compares WebCrypto's route with this core's):
//!
//! * an agreement is X25519 (RFC 7748) of this client's secret key with a
//!   peer's public key; an all-zero result, one the host could not
//!   compute, and any for a key that is not in canonical form (bit 255
//!   set, or u ≥ 2^255 − 19, which implementations need not reduce alike)
//!   count as not supplied, and the core computes them (and refuses a
//!   low-order key exactly as in place);
//! * a key stream is AES-128-CTR of zeros under the mask's key, the
//!   counter block a 128-bit big-endian integer from zero (WebCrypto's
//!   `AES-CTR` with `length: 128` and a zero counter), read as
//!   little-endian 32-bit words; the core checks its first and last block
//!   against its own AES (two blocks: a wrong key or counter layout is
//!   refused, and the core computes that stream) and adds it to the input
//!   word by word modulo 2^32, or subtracts it, by the mask's sign; then it
//!   wipes the mask's key.
//!
//! The host is the client's own trust domain: it sees the round's secrets
//! the work needs (the agreement secret keys, the mask keys) and nothing
//! else. A host that computes a wrong result anyway (a wrong agreement, a
//! stream wrong only in its middle) breaks the round as a client with a
//! wrong input would: a peer cannot open this client's envelope and
//! aborts, or the sum is wrong (in a validated round the sum check finds
//! this client, THREAT_MODEL claim 68). The keys the host is given are
//! copies the core cannot wipe; THREAT_MODEL claim 80 says what the
//! browser does with them.

use rand_core::CryptoRng;
use subtle::ConstantTimeEq;
use zeroize::{Zeroize, Zeroizing};

use super::{AwaitingPeerKeys, AwaitingShares, AwaitingSurvivors, Client, ClientStep, HeldShares, aborted};
use crate::agreement::{AgreementKey, PeerKey, check_contributory, is_canonical};
use crate::config::RoundContext;
use crate::error::{CryptoError, ProtocolError};
use crate::ids::ClientId;
use crate::masking::{Mask, apply_masks};
use crate::messages::{AdvertisedKeys, ClientMessage, MaskedVector};
use crate::prg::{MaskPrg, MaskSign, WORDS_PER_BLOCK};
use crate::secret::Secret32;

/// What [`Client::handle_deferred`] returns.
pub enum Deferred {
    /// The step is done: the next state and the reply, as
    /// [`Client::handle`] returns them.
    Done(ClientStep),
    /// The step waits for the host's [`Work`].
    Pending(PendingStep),
}

impl core::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Deferred::Done((client, reply)) => {
                f.debug_tuple("Done").field(client).field(&reply.as_ref().map(ClientMessage::stage)).finish()
            }
            Deferred::Pending(pending) => f.debug_tuple("Pending").field(pending).finish(),
        }
    }
}

/// A step waiting for its host's work; see the module documentation.
pub struct PendingStep {
    inner: Pending,
}

impl core::fmt::Debug for PendingStep {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let kind = match &self.inner {
            Pending::CipherAgreements { .. } => "cipher key agreements",
            Pending::MaskAgreements { .. } => "mask key agreements",
            Pending::KeyStreams(_) => "mask key streams",
        };
        f.debug_struct("PendingStep").field("waits_for", &kind).finish_non_exhaustive()
    }
}

pub(super) enum Pending {
    /// ShareKeys: X25519 of the cipher key with each peer's.
    CipherAgreements {
        state: AwaitingPeerKeys,
        context: RoundContext,
        peers: Vec<AdvertisedKeys>,
        publics: Vec<[u8; 32]>,
    },
    /// MaskedInput: X25519 of the mask key with each partner's.
    MaskAgreements {
        state: AwaitingShares,
        context: RoundContext,
        held: Vec<HeldShares>,
        partners: Vec<ClientId>,
        publics: Vec<[u8; 32]>,
    },
    /// MaskedInput: the masks' key streams.
    KeyStreams(Masking),
}

/// The input being masked: its noise and blindings already in, the masks
/// not yet (or some of them).
pub(super) struct Masking {
    pub(super) next: AwaitingSurvivors,
    pub(super) context: RoundContext,
    pub(super) values: Zeroizing<Vec<u32>>,
    pub(super) masks: Vec<MaskStream>,
}

/// One mask of the input: its AES-128 key (zeroized on drop) and its sign.
pub struct MaskStream {
    key: Zeroizing<[u8; 16]>,
    sign: MaskSign,
    added: bool,
}

impl MaskStream {
    pub(super) fn new(key: Zeroizing<[u8; 16]>, sign: MaskSign) -> Self {
        Self { key, sign, added: false }
    }

    /// The AES-128 key of the mask's key stream (all zeros once added).
    pub fn key(&self) -> &[u8; 16] {
        &self.key
    }

    /// Whether `stream` begins and ends as this mask's key stream does:
    /// its first and last AES block (or the part of one) against the
    /// core's own.
    fn ends_match(&self, stream: &[u32]) -> bool {
        let prg = MaskPrg::from_key(&self.key);
        let first = stream.len().min(WORDS_PER_BLOCK);
        let last_block = stream.len().saturating_sub(1) / WORDS_PER_BLOCK;
        let tail = &stream[last_block * WORDS_PER_BLOCK..];
        let mut expected = Zeroizing::new([0u32; 2 * WORDS_PER_BLOCK]);
        let (head, end) = expected.split_at_mut(WORDS_PER_BLOCK);
        prg.apply_from(&mut head[..first], 0, MaskSign::Add);
        prg.apply_from(&mut end[..tail.len()], last_block as u64, MaskSign::Add);
        bool::from(head[..first].ct_eq(&stream[..first]) & end[..tail.len()].ct_eq(tail))
    }

    /// Whether the key stream is added to the input or subtracted.
    pub fn sign(&self) -> MaskSign {
        self.sign
    }

    /// Whether the host has added it ([`PendingStep::add_key_stream`]).
    pub fn added(&self) -> bool {
        self.added
    }
}

/// The secret key of a step's agreements, for a host that computes them.
pub struct HostSecret<'a>(&'a AgreementKey);

impl HostSecret<'_> {
    /// The key's bytes (RFC 7748's scalar, unclamped as drawn; X25519
    /// clamps it), zeroized on drop: the one way they leave the core.
    pub fn bytes(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(*self.0.export_secret().expose())
    }
}

/// The work a [`PendingStep`] waits for.
pub enum Work<'a> {
    /// X25519 of `secret` with each of `peers`, in order, for
    /// [`PendingStep::agreed`].
    Agreements {
        /// This client's secret key for the stage; its bytes are copied
        /// out only when the host asks ([`HostSecret::bytes`]).
        secret: HostSecret<'a>,
        /// The peers' public keys.
        peers: &'a [[u8; 32]],
    },
    /// The key stream of each mask, `words` little-endian 32-bit words
    /// long, for [`PendingStep::add_key_stream`].
    KeyStreams {
        /// The masks, in order.
        masks: &'a [MaskStream],
        /// The length of every key stream in 32-bit words (the input's).
        words: usize,
    },
}

impl PendingStep {
    pub(super) fn deferred(inner: Pending) -> Deferred {
        Deferred::Pending(PendingStep { inner })
    }

    /// The work the step waits for.
    pub fn work(&self) -> Work<'_> {
        match &self.inner {
            Pending::CipherAgreements { state, publics, .. } => {
                Work::Agreements { secret: HostSecret(&state.cipher), peers: publics }
            }
            Pending::MaskAgreements { state, publics, .. } => {
                Work::Agreements { secret: HostSecret(&state.mask), peers: publics }
            }
            Pending::KeyStreams(masking) => {
                Work::KeyStreams { masks: &masking.masks, words: masking.values.len() }
            }
        }
    }

    /// Hands the host's agreements back, one per peer of
    /// [`Work::Agreements`] in order (`None` where the host has none), and
    /// goes on: the core computes the missing ones, those that are all
    /// zeros and those for a key not in canonical form (see the module
    /// documentation). A list of the wrong length, or agreements for a
    /// step that waits for key streams, abort the round (a driver checks
    /// [`work`](Self::work) first; the participant does).
    pub fn agreed<R: CryptoRng + ?Sized>(self, shared: Vec<Option<Secret32>>, rng: &mut R) -> Deferred {
        let (key, publics) = match &self.inner {
            Pending::CipherAgreements { state, publics, .. } => (&state.cipher, publics),
            Pending::MaskAgreements { state, publics, .. } => (&state.mask, publics),
            Pending::KeyStreams(_) => {
                return aborted(ProtocolError::Inconsistent(
                    "agreements for a step that waits for key streams",
                ));
            }
        };
        if shared.len() != publics.len() {
            return aborted(ProtocolError::Inconsistent("agreements for another number of peers"));
        }
        // What the host supplied and the core takes; the core's own
        // agreements, in one batch, for the rest.
        let shared: Vec<Option<Secret32>> = shared
            .into_iter()
            .zip(publics)
            .map(|(supplied, public)| {
                supplied.filter(|_| is_canonical(public)).and_then(|secret| check_contributory(secret).ok())
            })
            .collect();
        let missing: Vec<PeerKey> =
            publics.iter().zip(&shared).filter(|(_, s)| s.is_none()).map(|(p, _)| PeerKey::new(p)).collect();
        let mut computed = key.agree_many(&missing.iter().collect::<Vec<_>>()).into_iter();
        let agreed: Vec<Result<Secret32, CryptoError>> = shared
            .into_iter()
            .map(|supplied| match supplied {
                Some(secret) => Ok(secret),
                None => computed.next().unwrap_or(Err(CryptoError)),
            })
            .collect();
        let outcome = match self.inner {
            Pending::CipherAgreements { state, context, peers, .. } => {
                state.share_keys(context, peers, agreed, rng).map(Deferred::Done)
            }
            Pending::MaskAgreements { state, context, held, partners, .. } => state
                .masking(context, held, partners, agreed)
                .map(|masking| PendingStep::deferred(Pending::KeyStreams(masking))),
            Pending::KeyStreams(_) => unreachable!("refused above"),
        };
        outcome.unwrap_or_else(aborted)
    }

    /// Adds the key stream of mask `index` of [`Work::KeyStreams`] to the
    /// input (or subtracts it, by the mask's sign), and wipes the mask's
    /// key. Refused, with the step kept as it was, for a step that waits
    /// for agreements, an index out of range, a mask already added, a
    /// stream of the wrong length or one whose first or last block is not
    /// the mask's.
    pub fn add_key_stream(&mut self, index: usize, stream: &[u32]) -> Result<(), ProtocolError> {
        let Pending::KeyStreams(masking) = &mut self.inner else {
            return Err(ProtocolError::Inconsistent("a key stream for a step that waits for agreements"));
        };
        let Some(mask) = masking.masks.get_mut(index) else {
            return Err(ProtocolError::Inconsistent("a key stream for a mask this step does not have"));
        };
        if mask.added {
            return Err(ProtocolError::Inconsistent("a key stream added twice"));
        }
        if stream.len() != masking.values.len() {
            return Err(ProtocolError::Inconsistent("a key stream of the wrong length"));
        }
        if !mask.ends_match(stream) {
            return Err(ProtocolError::Inconsistent("a key stream that is not the mask's"));
        }
        match mask.sign {
            MaskSign::Add => masking.values.iter_mut().zip(stream).for_each(|(v, s)| *v = v.wrapping_add(*s)),
            MaskSign::Subtract => {
                masking.values.iter_mut().zip(stream).for_each(|(v, s)| *v = v.wrapping_sub(*s))
            }
        }
        mask.added = true;
        mask.key.zeroize();
        Ok(())
    }

    /// Completes what the host left undone and goes on: the agreements the
    /// step waits for, or the masks not added yet (then the masked input is
    /// reduced modulo 2^b and the step is done).
    pub fn complete<R: CryptoRng + ?Sized>(self, rng: &mut R) -> Deferred {
        match self.inner {
            Pending::KeyStreams(masking) => Deferred::Done(masking.finish()),
            Pending::CipherAgreements { ref publics, .. } | Pending::MaskAgreements { ref publics, .. } => {
                let none = (0..publics.len()).map(|_| None).collect();
                self.agreed(none, rng)
            }
        }
    }
}

impl Masking {
    /// Applies the masks not added yet and sends the masked input. The
    /// input is masked in place, a cache-sized tile at a time with every
    /// remaining mask (and then reduced modulo 2^b): no copy of x_u is
    /// made.
    fn finish(self) -> ClientStep {
        let Masking { next, context, mut values, masks } = self;
        let remaining: Vec<Mask> = masks
            .iter()
            .filter(|mask| !mask.added)
            .map(|mask| Mask { prg: MaskPrg::from_key(&mask.key), sign: mask.sign })
            .collect();
        drop(masks);
        let config = &next.round.config;
        let modulus = config.modulus_mask();
        apply_masks(&remaining, &mut values, |tile| tile.iter_mut().for_each(|v| *v &= modulus));
        drop(remaining);
        // y_u is what the server receives: it leaves the zeroizing wrapper
        // (which is left empty) for the message.
        let vector = MaskedVector { bits: config.modulus_bits, values: core::mem::take(&mut *values) };
        (Client::AwaitingSurvivors(next), Ok(ClientMessage::MaskedInput { context, vector }))
    }
}
