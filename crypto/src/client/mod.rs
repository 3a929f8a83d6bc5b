//! The client side of secure aggregation, as a state machine over messages.
//!
//! [`Client::start`] opens a round from the server's [`ServerMessage::Setup`]
//! and returns the first message to send; [`Client::handle`] consumes the
//! current state and one server message and returns the next state together
//! with the reply. A message that does not fit the current stage or round
//! leaves the state as it was; a message that breaks a protocol rule aborts
//! the round ([`Client::Aborted`]) before anything is revealed.
//!
//! An honest client reveals, for every neighbour, either the share of its
//! self-mask seed (the neighbour survived) or the share of its mask key (it
//! dropped), never both: the two lists are built from one partition of the
//! neighbours, and the state that holds the shares is consumed when it
//! answers, so it cannot be asked a second time.

use std::sync::Arc;

use curve25519_dalek::scalar::Scalar;
use rand_core::CryptoRng;
use zeroize::Zeroizing;

use crate::agreement::AgreementKey;
use crate::config::{RoundConfig, RoundContext, Variant};
use crate::derive;
use crate::envelope::EnvelopeKey;
use crate::error::{CryptoError, ProtocolError, Stage};
use crate::ids::ClientId;
use crate::messages::{
    AdvertisedKeys, ClientMessage, ENVELOPE_LEN, ENVELOPE_PLAINTEXT_LEN, Envelope, NoiseAttestation,
    ServerMessage, UnmaskingShares,
};
use crate::prg::MaskSign;
use crate::quantize::QuantizedInput;
use crate::secret::Secret32;
use crate::shamir::{SHARE_LEN, Share, split};
use crate::signature::{IdentityKey, SIGNATURE_LEN, Signed, verify_all};
use crate::validation::noise::{EdgeNoise, NoiseVerifiers};
use crate::validation::{self, RoundValidation};

mod deferred;

pub use deferred::{Deferred, HostSecret, MaskStream, PendingStep, Work};
use deferred::{Masking, Pending};

/// Facts about the round that every stage needs.
struct RoundView {
    config: RoundConfig,
    context: RoundContext,
    me: ClientId,
    /// This client's neighbours, ascending.
    neighbours: Vec<ClientId>,
    identity: Option<Arc<IdentityKey>>,
    /// The norm this client proves its input within (validated rounds).
    validation: Option<RoundValidation>,
    /// Who verifies whose noise (private, validated rounds).
    noise: Option<NoiseVerifiers>,
}

impl RoundView {
    fn threshold(&self) -> u32 {
        self.config.threshold
    }

    fn check_context(&self, context: &RoundContext) -> Result<(), ProtocolError> {
        if *context == self.context { Ok(()) } else { Err(ProtocolError::WrongRound) }
    }

    fn is_neighbour(&self, id: ClientId) -> bool {
        self.neighbours.binary_search(&id).is_ok()
    }

    fn require(&self, stage: Stage, have: usize) -> Result<(), ProtocolError> {
        if have < self.threshold() as usize {
            return Err(ProtocolError::BelowThreshold { stage, have: have as u32, need: self.threshold() });
        }
        Ok(())
    }
}

fn server_error(reason: &'static str) -> ProtocolError {
    ProtocolError::InvalidMessage { client: ClientId::SERVER, reason }
}

fn strictly_ascending(ids: impl Iterator<Item = ClientId>) -> bool {
    let mut last = None;
    for id in ids {
        if last.is_some_and(|previous| previous >= id) {
            return false;
        }
        last = Some(id);
    }
    true
}

/// Waiting for the neighbours' public keys.
pub struct AwaitingPeerKeys {
    round: RoundView,
    cipher: AgreementKey,
    mask: AgreementKey,
    /// b_u, drawn with the keys so that its commitment is advertised with them.
    self_mask_seed: Secret32,
    input: QuantizedInput,
}

/// Waiting for the envelopes the neighbours sealed for this client.
pub struct AwaitingShares {
    round: RoundView,
    /// The key opening each peer's envelope, aligned with `peers` (derived
    /// with the sealing key, from the same agreement).
    open_keys: Vec<EnvelopeKey>,
    mask: AgreementKey,
    self_mask_seed: Secret32,
    /// This client's own share of b_u (at its own point): revealed with
    /// its neighbours' shares if it survives, so that b_u is rebuilt from
    /// t − 1 surviving neighbours and itself.
    own_seed_share: Share,
    input: QuantizedInput,
    /// The blindings of the input's row commitments (validated rounds).
    blindings: Zeroizing<Vec<Scalar>>,
    /// Neighbours that advertised keys (U1 ∩ N(u)), ascending.
    peers: Vec<AdvertisedKeys>,
    /// The seeds of this client's noise edges, one per verifier that
    /// advertised keys, by verifier (private, validated rounds).
    noise_seeds: Vec<(ClientId, Secret32)>,
}

/// Shares this client holds for one neighbour.
struct HeldShares {
    owner: ClientId,
    self_mask: Share,
    mask_key: Share,
}

/// Waiting for the survivor list.
pub struct AwaitingSurvivors {
    round: RoundView,
    /// One entry per neighbour in U2, ascending by owner.
    held: Vec<HeldShares>,
    own_seed_share: Share,
}

/// Waiting for the other survivors' signatures (active variant).
pub struct AwaitingSignatures {
    round: RoundView,
    held: Vec<HeldShares>,
    own_seed_share: Share,
    survivors: Vec<ClientId>,
}

/// The client's state in one round.
pub enum Client {
    /// Sent its keys.
    AwaitingPeerKeys(AwaitingPeerKeys),
    /// Sent its shares.
    AwaitingShares(AwaitingShares),
    /// Sent its masked input.
    AwaitingSurvivors(AwaitingSurvivors),
    /// Signed the survivor list.
    AwaitingSignatures(AwaitingSignatures),
    /// Sent its unmasking shares; nothing more to do.
    Finished,
    /// Gave up after a protocol violation; nothing more will be revealed.
    Aborted,
}

impl core::fmt::Debug for Client {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Client").field("stage", &self.stage()).finish_non_exhaustive()
    }
}

/// The outcome of [`Client::handle`]: the next state, and the reply or the
/// reason the message was refused.
pub type ClientStep = (Client, Result<ClientMessage, ProtocolError>);

impl Client {
    /// Opens a round: validates the server's parameters and the input,
    /// draws fresh round keys and returns the AdvertiseKeys message.
    ///
    /// `identity` is required in the active variant and must match the
    /// roster entry for `me`.
    pub fn start<R: CryptoRng + ?Sized>(
        setup: ServerMessage,
        me: ClientId,
        identity: Option<Arc<IdentityKey>>,
        input: QuantizedInput,
        rng: &mut R,
    ) -> Result<(Client, ClientMessage), ProtocolError> {
        let ServerMessage::Setup(config) = setup else {
            return Err(ProtocolError::OutOfPhase { expected: Stage::Setup, got: setup.stage() });
        };
        config.validate()?;
        if me.get() > config.clients {
            return Err(ProtocolError::UnknownClient(me));
        }
        // A validated round's vector ends with the blindings of the
        // commitments, which the client appends itself.
        let validation = RoundValidation::new(&config)?;
        let expected = validation.as_ref().map_or(config.vector_len as usize, RoundValidation::dimension);
        if input.len() != expected {
            return Err(ProtocolError::InputLength { expected: expected as u32, got: input.len() as u32 });
        }
        // Headroom: no value may exceed ⌊(2^b − 1) / n⌋, or the sum could
        // wrap; under differential privacy the sum wraps by design (modular
        // clipping), so any value of the ring is an input, and so is any
        // value of a fitted ring's update part (its example count and
        // metrics after it must not wrap).
        let ring = (1u64 << config.modulus_bits) - 1;
        let (limit, exact_from) = match (&config.quantization.privacy, config.quantization.scale) {
            (Some(_), _) => (ring, input.len()),
            (None, Some(_)) => {
                let quantizer =
                    crate::Quantizer::new(config.quantization, config.modulus_bits, config.clients)?;
                (ring / u64::from(config.clients), input.len().saturating_sub(quantizer.tail_len()))
            }
            (None, None) => (ring / u64::from(config.clients), 0),
        };
        if input.values().iter().any(|&v| u64::from(v) > ring)
            || input.values()[exact_from..].iter().any(|&v| u64::from(v) > limit)
        {
            return Err(ProtocolError::InvalidMessage {
                client: me,
                reason: "input value exceeds the round's headroom",
            });
        }
        let identity = match config.variant {
            Variant::SemiHonest => None,
            Variant::Active => {
                let key = identity.ok_or(ProtocolError::Inconsistent(
                    "the active variant needs this client's identity key",
                ))?;
                if key.public_key() != config.identities[me.index()] {
                    return Err(ProtocolError::Inconsistent(
                        "the roster lists another identity key for this client",
                    ));
                }
                Some(key)
            }
        };
        let context = config.context();
        let neighbours = config.communication_graph().neighbours(me);
        let cipher = AgreementKey::generate(rng);
        let mask = AgreementKey::generate(rng);
        let self_mask_seed = Secret32::random(rng);
        let (cipher_key, mask_key) = (cipher.public_key(), mask.public_key());
        let seed_commitment = derive::seed_commitment(&context, me, &self_mask_seed);
        let signature = identity.as_ref().map(|key| {
            key.sign(&derive::advertise_statement(&context, me, &cipher_key, &mask_key, &seed_commitment))
        });
        let noise = match validation.as_ref().and_then(RoundValidation::edge_variance) {
            Some(_) => Some(NoiseVerifiers::new(&config)?),
            None => None,
        };
        let round = RoundView { config, context, me, neighbours, identity, validation, noise };
        let message =
            ClientMessage::AdvertiseKeys { context, cipher_key, mask_key, seed_commitment, signature };
        let state = AwaitingPeerKeys { round, cipher, mask, self_mask_seed, input };
        Ok((Client::AwaitingPeerKeys(state), message))
    }

    /// The stage whose server message this state waits for.
    pub fn stage(&self) -> Stage {
        match self {
            Client::AwaitingPeerKeys(_) => Stage::ShareKeys,
            Client::AwaitingShares(_) => Stage::MaskedInputCollection,
            Client::AwaitingSurvivors(_) => Stage::ConsistencyCheck,
            Client::AwaitingSignatures(_) => Stage::Unmasking,
            Client::Finished | Client::Aborted => Stage::Finished,
        }
    }

    fn round(&self) -> Option<&RoundView> {
        match self {
            Client::AwaitingPeerKeys(state) => Some(&state.round),
            Client::AwaitingShares(state) => Some(&state.round),
            Client::AwaitingSurvivors(state) => Some(&state.round),
            Client::AwaitingSignatures(state) => Some(&state.round),
            Client::Finished | Client::Aborted => None,
        }
    }

    /// Handles one server message. A message for another stage or round is
    /// refused and the state kept; any other violation aborts the round.
    ///
    /// The step's X25519 agreements and mask key streams are computed here,
    /// in place: [`handle_deferred`](Self::handle_deferred) with every part
    /// of the work left to this core.
    pub fn handle<R: CryptoRng + ?Sized>(self, message: ServerMessage, rng: &mut R) -> ClientStep {
        let mut deferred = self.handle_deferred(message, rng);
        loop {
            match deferred {
                Deferred::Done(step) => return step,
                Deferred::Pending(pending) => deferred = pending.complete(rng),
            }
        }
    }

    /// [`handle`](Self::handle), but a step that needs X25519 agreements or
    /// mask key streams returns them as [`Work`] for the host to compute
    /// (the browser client hands them to WebCrypto) and waits in a
    /// [`PendingStep`]; anything the host leaves undone, the core computes
    /// when the step completes.
    pub fn handle_deferred<R: CryptoRng + ?Sized>(self, message: ServerMessage, rng: &mut R) -> Deferred {
        if matches!(self, Client::Finished | Client::Aborted) {
            return Deferred::Done((self, Err(ProtocolError::Finished)));
        }
        if message.stage() != self.stage() {
            let error = ProtocolError::OutOfPhase { expected: self.stage(), got: message.stage() };
            return Deferred::Done((self, Err(error)));
        }
        // A message from another round is refused without touching the state.
        if let (Some(round), Some(context)) = (self.round(), message.context())
            && round.check_context(context).is_err()
        {
            return Deferred::Done((self, Err(ProtocolError::WrongRound)));
        }
        let outcome = match (self, message) {
            (Client::AwaitingPeerKeys(state), ServerMessage::PeerKeys { context, peers }) => {
                state.receive(context, peers).map(PendingStep::deferred)
            }
            (Client::AwaitingShares(state), ServerMessage::Shares { context, envelopes }) => {
                state.receive(context, envelopes).map(PendingStep::deferred)
            }
            (Client::AwaitingSurvivors(state), ServerMessage::Survivors { context, survivors }) => {
                state.handle(context, survivors).map(Deferred::Done)
            }
            (Client::AwaitingSignatures(state), ServerMessage::Signatures { context, signatures }) => {
                state.handle(context, signatures).map(Deferred::Done)
            }
            // Stages were compared above; no other pairing is possible.
            (state, _) => return Deferred::Done((state, Err(ProtocolError::Finished))),
        };
        let _ = rng; // Drawn from only once the work is done.
        outcome.unwrap_or_else(aborted)
    }
}

/// The step of a violation: the round is aborted.
fn aborted(error: ProtocolError) -> Deferred {
    Deferred::Done((Client::Aborted, Err(error)))
}

impl AwaitingPeerKeys {
    /// Checks the neighbours' keys (and, in the active variant, their
    /// signatures); the agreements with their cipher keys come next.
    fn receive(self, context: RoundContext, peers: Vec<AdvertisedKeys>) -> Result<Pending, ProtocolError> {
        let round = &self.round;
        if !strictly_ascending(peers.iter().map(|peer| peer.id)) {
            return Err(server_error("peer keys are not in ascending order"));
        }
        if peers.iter().any(|peer| !round.is_neighbour(peer.id)) {
            return Err(server_error("peer keys include a client that is not a neighbour"));
        }
        round.require(Stage::ShareKeys, peers.len())?;
        if round.config.variant == Variant::Active {
            let statements: Vec<Vec<u8>> = peers
                .iter()
                .map(|peer| {
                    derive::advertise_statement(
                        &context,
                        peer.id,
                        &peer.cipher_key,
                        &peer.mask_key,
                        &peer.seed_commitment,
                    )
                })
                .collect();
            let batch = peers
                .iter()
                .zip(&statements)
                .map(|(peer, statement)| {
                    let signature = peer.signature.as_ref().ok_or(server_error("peer keys are unsigned"))?;
                    Ok((&round.config.identities[peer.id.index()], statement.as_slice(), signature))
                })
                .collect::<Result<Vec<Signed<'_>>, ProtocolError>>()?;
            verify_all(&batch)?;
        }
        let publics = peers.iter().map(|peer| peer.cipher_key).collect();
        Ok(Pending::CipherAgreements { state: self, context, peers, publics })
    }

    /// The ShareKeys message, from the agreements with each peer's cipher
    /// key, in the peers' order.
    fn share_keys<R: CryptoRng + ?Sized>(
        self,
        context: RoundContext,
        peers: Vec<AdvertisedKeys>,
        agreed: Vec<Result<Secret32, CryptoError>>,
        rng: &mut R,
    ) -> Result<ClientStep, ProtocolError> {
        let round = &self.round;
        let points: Vec<u32> = peers.iter().map(|peer| peer.id.get()).collect();
        let threshold = round.threshold() as usize;
        // b_u is shared with the neighbours and with this client itself (as
        // in the original protocol, whose share set includes the sender):
        // a survivor's seed is rebuilt from t − 1 surviving neighbours and
        // its own share. s_u is shared with the neighbours only: it is
        // rebuilt only for a client that dropped, which reveals nothing.
        let seed_points: Vec<u32> = points.iter().copied().chain([round.me.get()]).collect();
        let mut seed_shares = split(&self.self_mask_seed, threshold, &seed_points, rng);
        let own_seed_share = seed_shares.pop().ok_or(server_error("no share of the seed for this client"))?;
        let key_shares = split(&self.mask.export_secret(), threshold, &points, rng);
        let mut envelopes = Vec::with_capacity(peers.len());
        let mut open_keys = Vec::with_capacity(peers.len());
        let mut plaintext = Zeroizing::new(Vec::with_capacity(ENVELOPE_PLAINTEXT_LEN));
        // In a private, validated round the same agreement seeds the noise
        // edges: this client's own (to its verifiers), and those of the
        // neighbours it verifies. It commits to both kinds: the coordinator
        // compares the two ends' commitments, so neither end alone can
        // shift an edge's noise.
        let my_verifiers = round.noise.as_ref().map(|noise| noise.of(round.me)).unwrap_or_default();
        let my_owners = round.noise.as_ref().map(|noise| noise.verified_by(round.me)).unwrap_or_default();
        let edge_variance = round.validation.as_ref().and_then(RoundValidation::edge_variance);
        let mut noise_edges: Vec<(ClientId, Secret32)> = Vec::new();
        let mut noise = Vec::new();
        for (((peer, seed_share), key_share), shared) in
            peers.iter().zip(&seed_shares).zip(&key_shares).zip(agreed)
        {
            let shared = shared?;
            if let (Some(variance), Some(validation)) = (edge_variance, &round.validation) {
                let mut commit = |owner: ClientId, verifier: ClientId| -> Result<Secret32, ProtocolError> {
                    let seed = derive::noise_edge_seed(&shared, &context, owner, verifier);
                    let edge = EdgeNoise::derive(&seed, validation.bound(), variance);
                    let mut commitment = edge.commit(validation.bound())?.to_bytes();
                    if owner == round.me {
                        commitment = validation::noise::commitment_digest(&commitment).to_vec();
                    }
                    noise.push(NoiseAttestation { owner, verifier, commitment });
                    Ok(seed)
                };
                if my_verifiers.contains(&peer.id) {
                    noise_edges.push((peer.id, commit(round.me, peer.id)?));
                }
                if my_owners.contains(&peer.id) {
                    commit(peer.id, round.me)?;
                }
            }
            plaintext.clear();
            seed_share.encode_into(&mut plaintext);
            key_share.encode_into(&mut plaintext);
            let (seal, open) = derive::envelope_keys(&shared, &context, round.me, peer.id);
            let aad = derive::envelope_aad(&context, round.me, peer.id);
            envelopes.push(Envelope { peer: peer.id, ciphertext: seal.seal(&aad, &plaintext) });
            open_keys.push(open);
        }
        // In a validated round, the commitment to the input and its proof
        // ride with the envelopes; the blindings wait for the masking.
        let (proof, blindings) = match &round.validation {
            None => (None, Zeroizing::new(Vec::new())),
            Some(validation) => {
                let centred = Zeroizing::new(validation.centred(self.input.values()));
                let context = RoundValidation::context(&round.context, round.me);
                let proven = validation::prove(validation.bound(), &context, &centred, rng)?;
                (Some(proven.proof.to_bytes()), proven.blindings)
            }
        };
        // The commitments in the message's order.
        noise.sort_by_key(|a| (a.owner, a.verifier));
        // The cipher key is dropped (and zeroized) here: the open keys (and
        // the noise seeds) are all this client needs of it.
        let next = AwaitingShares {
            round: self.round,
            open_keys,
            mask: self.mask,
            self_mask_seed: self.self_mask_seed,
            own_seed_share,
            input: self.input,
            blindings,
            peers,
            noise_seeds: noise_edges,
        };
        Ok((Client::AwaitingShares(next), Ok(ClientMessage::ShareKeys { context, envelopes, proof, noise })))
    }
}

impl AwaitingShares {
    /// Opens the envelopes and keeps the shares; the agreements with the
    /// mask keys of the neighbours whose envelopes came are next.
    fn receive(mut self, context: RoundContext, envelopes: Vec<Envelope>) -> Result<Pending, ProtocolError> {
        // Each open key is used once, here.
        let mut open_keys: Vec<Option<EnvelopeKey>> =
            core::mem::take(&mut self.open_keys).into_iter().map(Some).collect();
        let round = &self.round;
        if !strictly_ascending(envelopes.iter().map(|envelope| envelope.peer)) {
            return Err(server_error("envelopes are not in ascending order"));
        }
        round.require(Stage::MaskedInputCollection, envelopes.len())?;
        let mut held = Vec::with_capacity(envelopes.len());
        let mut partners = Vec::with_capacity(envelopes.len());
        let mut publics = Vec::with_capacity(envelopes.len());
        for envelope in &envelopes {
            let index = self
                .peers
                .binary_search_by_key(&envelope.peer, |peer| peer.id)
                .map_err(|_| server_error("an envelope comes from a client that advertised no keys"))?;
            let peer = &self.peers[index];
            // Envelopes are strictly ascending, so each key is taken once.
            let key = open_keys[index].take().ok_or(server_error("two envelopes from one client"))?;
            if envelope.ciphertext.len() != ENVELOPE_LEN {
                return Err(server_error("an envelope has the wrong length"));
            }
            let aad = derive::envelope_aad(&context, peer.id, round.me);
            let plaintext = key.open(&aad, &envelope.ciphertext)?;
            let (first, second) = plaintext.split_at(SHARE_LEN);
            let decode = |bytes: &[u8]| {
                bytes
                    .try_into()
                    .ok()
                    .and_then(Share::decode)
                    .filter(|share| share.point() == round.me.get())
                    .ok_or(ProtocolError::InvalidMessage {
                        client: peer.id,
                        reason: "a share envelope holds a malformed share",
                    })
            };
            held.push(HeldShares { owner: peer.id, self_mask: decode(first)?, mask_key: decode(second)? });
            partners.push(peer.id);
            publics.push(peer.mask_key);
        }
        Ok(Pending::MaskAgreements { state: self, context, held, partners, publics })
    }

    /// The input with its noise and blindings, and the keys of the masks
    /// to add to it, from the agreements with each partner's mask key (the
    /// neighbours whose envelopes came, ascending).
    fn masking(
        self,
        context: RoundContext,
        held: Vec<HeldShares>,
        partners: Vec<ClientId>,
        agreed: Vec<Result<Secret32, CryptoError>>,
    ) -> Result<Masking, ProtocolError> {
        let round = &self.round;
        // y_u = x_u + PRG(b_u) + Σ_{v ∈ U2, u < v} PRG(s_uv) − Σ_{v ∈ U2, u > v} PRG(s_uv)
        let mut masks = Vec::with_capacity(partners.len() + 1);
        masks.push(MaskStream::new(
            derive::self_mask_key(&self.self_mask_seed, &context, round.me),
            MaskSign::Add,
        ));
        for (peer, shared) in partners.iter().zip(agreed) {
            masks.push(MaskStream::new(
                derive::pairwise_mask_key(&shared?, &context, round.me, *peer),
                derive::pairwise_sign(round.me, *peer),
            ));
        }
        let mut values = self.input.into_values();
        let mut blindings = self.blindings;
        if let (Some(verifiers), Some(validation)) = (&round.noise, &round.validation) {
            // The noise of the first two verifiers that completed stage 2
            // (their envelopes came), as the coordinator will count them.
            let completed = |j: ClientId| partners.binary_search(&j).is_ok();
            let edges = verifiers.edges(round.me, completed).ok_or(ProtocolError::Validation(
                validation::ValidationError::Input("fewer than two of this client's noise verifiers remain"),
            ))?;
            let variance = validation.edge_variance().unwrap_or_default();
            let modulus = round.config.modulus_mask();
            for j in edges {
                let (_, seed) = self
                    .noise_seeds
                    .iter()
                    .find(|(v, _)| *v == j)
                    .ok_or(server_error("an envelope comes from a verifier that advertised no keys"))?;
                let edge = EdgeNoise::derive(seed, validation.bound(), variance);
                for (v, &e) in values.iter_mut().zip(edge.values()) {
                    *v = v.wrapping_add(e as u32) & modulus;
                }
                for (b, e) in blindings.iter_mut().zip(edge.blindings()) {
                    *b += e;
                }
            }
        }
        if let Some(validation) = &round.validation {
            validation.append_blindings(&mut values, &blindings);
        }
        // The seed b_u and the mask key s_sk_u are dropped (and zeroized)
        // here: from now on the client only holds peers' shares, and the
        // keys of its masks until they are applied.
        let next = AwaitingSurvivors { round: self.round, held, own_seed_share: self.own_seed_share };
        Ok(Masking { next, context, values, masks })
    }
}

impl AwaitingSurvivors {
    fn handle(self, context: RoundContext, survivors: Vec<ClientId>) -> Result<ClientStep, ProtocolError> {
        let round = &self.round;
        if !strictly_ascending(survivors.iter().copied())
            || survivors.last().is_some_and(|id| id.get() > round.config.clients)
        {
            return Err(server_error("the survivor list is not a set of roster ids"));
        }
        if survivors.binary_search(&round.me).is_err() {
            return Err(ProtocolError::Inconsistent("this client is missing from the survivor list"));
        }
        // The server learns the sum of the survivors: never allow fewer than t.
        round.require(Stage::Unmasking, survivors.len())?;
        let shared_with = |id: &ClientId| self.held.binary_search_by_key(id, |h| h.owner).is_ok();
        if survivors.iter().any(|id| round.is_neighbour(*id) && !shared_with(id)) {
            return Err(ProtocolError::Inconsistent(
                "a surviving neighbour never shared keys with this client",
            ));
        }
        match round.config.variant {
            Variant::SemiHonest => {
                let shares = reveal(self.held, (round.me, self.own_seed_share), &survivors);
                Ok((Client::Finished, Ok(ClientMessage::Unmasking { context, shares })))
            }
            Variant::Active => {
                let Some(identity) = round.identity.as_ref() else {
                    return Err(ProtocolError::Inconsistent("missing identity key"));
                };
                let signature = identity.sign(&derive::consistency_statement(&context, round.me, &survivors));
                let next = AwaitingSignatures {
                    round: self.round,
                    held: self.held,
                    own_seed_share: self.own_seed_share,
                    survivors,
                };
                Ok((Client::AwaitingSignatures(next), Ok(ClientMessage::Consistency { context, signature })))
            }
        }
    }
}

impl AwaitingSignatures {
    fn handle(
        self,
        context: RoundContext,
        signatures: Vec<(ClientId, [u8; SIGNATURE_LEN])>,
    ) -> Result<ClientStep, ProtocolError> {
        let round = &self.round;
        if !strictly_ascending(signatures.iter().map(|(id, _)| *id)) {
            return Err(server_error("signatures are not in ascending order"));
        }
        round.require(Stage::Unmasking, signatures.len())?;
        if signatures.iter().any(|(signer, _)| self.survivors.binary_search(signer).is_err()) {
            return Err(ProtocolError::Inconsistent("a signer is not in the survivor list"));
        }
        // The signers must be this client's own neighbourhood: itself and
        // its neighbours, the holders of its seed's shares. t signers
        // anywhere in the round are not enough on a sparse graph: a
        // coordinator could show this client and t of its neighbours a list
        // on which they survived and the rest of the round one on which they
        // dropped, each side signed by t of its own members, and so collect
        // the neighbours' mask keys from their other neighbours while this
        // side reveals a seed. With t of its own k + 1 signing its list and
        // 2t > k + 1 + c, no other list can gather t of them (see
        // the adversary model in `crypto/adversary` and THREAT_MODEL claim 6).
        if signatures.iter().any(|(signer, _)| *signer != round.me && !round.is_neighbour(*signer)) {
            return Err(ProtocolError::Inconsistent("a signer is not in this client's neighbourhood"));
        }
        // t distinct members of the neighbourhood that signed this very list
        // are what the check needs; any further signatures add nothing, so
        // only the first t are checked. A valid signature over a different
        // list fails here: somebody was shown another survivor set.
        let first = &signatures[..round.threshold() as usize];
        let statements: Vec<Vec<u8>> = first
            .iter()
            .map(|(signer, _)| derive::consistency_statement(&context, *signer, &self.survivors))
            .collect();
        let batch: Vec<Signed<'_>> = first
            .iter()
            .zip(&statements)
            .map(|((signer, signature), statement)| {
                (&round.config.identities[signer.index()], statement.as_slice(), signature)
            })
            .collect();
        verify_all(&batch)
            .map_err(|_| ProtocolError::Inconsistent("a survivor signed a different survivor list"))?;
        let shares = reveal(self.held, (round.me, self.own_seed_share), &self.survivors);
        Ok((Client::Finished, Ok(ClientMessage::Unmasking { context, shares })))
    }
}

/// Splits the held shares by the survivor list: the self-mask share of
/// each surviving neighbour, the mask-key share of each dropped one. Each
/// neighbour's pair is consumed once, so no neighbour gets both revealed.
/// The client's `own` seed share goes with the self-mask shares: it is in
/// the survivor list (checked before), so its seed is rebuilt anyway.
fn reveal(held: Vec<HeldShares>, own: (ClientId, Share), survivors: &[ClientId]) -> UnmaskingShares {
    let mut shares = UnmaskingShares { self_mask: vec![own], mask_key: Vec::new() };
    for HeldShares { owner, self_mask, mask_key } in held {
        if survivors.binary_search(&owner).is_ok() {
            shares.self_mask.push((owner, self_mask));
            drop(mask_key);
        } else {
            shares.mask_key.push((owner, mask_key));
            drop(self_mask);
        }
    }
    shares.self_mask.sort_unstable_by_key(|(owner, _)| *owner);
    shares
}

#[cfg(test)]
mod tests {
    use rand_chacha::ChaCha20Rng;
    use rand_core::SeedableRng;

    use super::*;
    use crate::graph::GraphSpec;
    use crate::quantize::{QuantizationSpec, Transform};

    fn id(i: u32) -> ClientId {
        ClientId::new(i).unwrap()
    }

    /// A peer that seals, in an envelope that opens correctly, a share
    /// evaluated at another client's point: the recipient refuses it before
    /// it masks anything. (Taken in, such a share would be revealed later as
    /// this client's, and a coordinator that collects shares at chosen
    /// points could rebuild a secret from fewer honest holders.)
    #[test]
    fn an_envelope_holding_a_share_at_another_point_is_refused() {
        let config = RoundConfig {
            session: [3; 16],
            round: 1,
            variant: Variant::SemiHonest,
            clients: 4,
            identities: Vec::new(),
            graph: GraphSpec::Complete,
            threshold: 2,
            vector_len: 4,
            modulus_bits: 16,
            quantization: QuantizationSpec {
                clip: 1.0,
                max_weight: 1,
                transform: Transform::None,
                metrics: crate::MetricSet::NONE,
                privacy: None,
                validation: None,
                scale: None,
            },
            model: None,
        };
        let context = config.context();
        let mut rng = ChaCha20Rng::seed_from_u64(5);
        let input = QuantizedInput::from_values(vec![1; 4]);
        let (client, keys) =
            Client::start(ServerMessage::Setup(config), id(1), None, input, &mut rng).unwrap();
        let ClientMessage::AdvertiseKeys { cipher_key: client_key, .. } = keys else { panic!("keys") };
        // Peers 2 to 4, whose keys this test holds.
        let peers: Vec<(AgreementKey, AdvertisedKeys)> = (2..=4)
            .map(|i| {
                let cipher = AgreementKey::generate(&mut rng);
                let mask = AgreementKey::generate(&mut rng);
                let advertised = AdvertisedKeys {
                    id: id(i),
                    cipher_key: cipher.public_key(),
                    mask_key: mask.public_key(),
                    seed_commitment: [0; 32],
                    signature: None,
                };
                (cipher, advertised)
            })
            .collect();
        let message =
            ServerMessage::PeerKeys { context, peers: peers.iter().map(|(_, keys)| keys.clone()).collect() };
        let (client, reply) = client.handle(message, &mut rng);
        assert!(matches!(reply, Ok(ClientMessage::ShareKeys { .. })));
        // Each peer seals a pair of shares for client 1; peer 3's seed share
        // is evaluated at point 4, not 1.
        let envelopes: Vec<Envelope> = peers
            .iter()
            .map(|(cipher, keys)| {
                let point = if keys.id == id(3) { 4 } else { 1 };
                let seed = split(&Secret32::random(&mut rng), 2, &[point, 9], &mut rng);
                let key = split(&Secret32::random(&mut rng), 2, &[1, 9], &mut rng);
                let mut plaintext = Vec::new();
                seed[0].encode_into(&mut plaintext);
                key[0].encode_into(&mut plaintext);
                let shared = cipher.agree(&client_key).unwrap();
                let (seal, _) = derive::envelope_keys(&shared, &context, keys.id, id(1));
                let aad = derive::envelope_aad(&context, keys.id, id(1));
                Envelope { peer: keys.id, ciphertext: seal.seal(&aad, &plaintext) }
            })
            .collect();
        let (state, reply) = client.handle(ServerMessage::Shares { context, envelopes }, &mut rng);
        let refused = ProtocolError::InvalidMessage {
            client: id(3),
            reason: "a share envelope holds a malformed share",
        };
        assert!(matches!(reply, Err(ref error) if *error == refused), "{reply:?}");
        assert!(matches!(state, Client::Aborted));
    }
}
