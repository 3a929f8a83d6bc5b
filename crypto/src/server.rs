//! The server side of secure aggregation, as a state machine over messages.
//!
//! [`ServerRound::new`] opens a round; [`ServerRound::receive`] takes one
//! client message (validate first, then apply: a refused message changes
//! nothing); [`ServerRound::message_for`] is what each client must be sent
//! to move on; [`ServerRound::advance`] closes the current stage, the driver
//! calling it once every eligible client answered or the stage's deadline
//! passed. The last `advance` unmasks and returns the [`Aggregate`].
//!
//! The server keeps only the running sum of masked inputs, never an
//! individual vector, and refuses to finish with fewer than t survivors.

use std::sync::Arc;

use crate::agreement::is_low_order;
use crate::config::{RoundConfig, RoundContext, Variant};
use crate::derive;
use crate::error::{ProtocolError, Stage};
use crate::graph::CommunicationGraph;
use crate::ids::ClientId;
use crate::messages::NoiseAttestation;
use crate::messages::{
    AdvertisedKeys, ClientMessage, ENVELOPE_LEN, Envelope, MaskedInputHeader, MaskedVector,
    PackedMaskedInput, ServerMessage, UnmaskingShares,
};
use crate::shamir::Share;
use crate::signature::{SIGNATURE_LEN, verify};
pub use crate::unmask::FaultyShare;
use crate::unmask::{UnmaskJob, unmask};
use crate::validation::noise::NoiseVerifiers;
use crate::validation::{self, Commitment, NormProof, RoundValidation};
use crate::wire::{DecodeError, add_packed, last_byte_padding_is_zero, packed_len, subtract_packed};

/// Values added into the running sum per piece (on the worker threads with
/// feature `parallel`): a multiple of 8, so every piece starts at a byte.
const PIECE_VALUES: usize = 1 << 16;

/// The result of a round: Σ x_u over the survivors, in Z_{2^b}.
#[derive(Clone, PartialEq, Eq)]
pub struct Aggregate {
    /// The sum of the survivors' inputs.
    pub sum: Vec<u32>,
    /// The clients whose inputs are in the sum (U3), ascending.
    pub contributors: Vec<ClientId>,
    /// Revealed shares that disagreed with the secret their owner committed
    /// to; the round completed without them. Ascending.
    pub faulty_shares: Vec<FaultyShare>,
    /// Masks the server removed in the unmasking stage (a self mask per
    /// survivor, a pairwise mask per dropped client and surviving
    /// neighbour), each a key stream as long as the vector: the server's
    /// part of the key stream a round expands.
    pub masks_removed: usize,
    /// Clients whose norm proof was refused (validated rounds), and both
    /// ends of a noise edge whose ends committed to different noise
    /// (private, validated rounds): the round went on without them, as if
    /// they had dropped out after AdvertiseKeys. Ascending.
    pub refused: Vec<ClientId>,
    /// The noise edges (owner, verifier) whose two ends committed to
    /// different noise: one end of each lied (private, validated rounds).
    pub disputed: Vec<(ClientId, ClientId)>,
}

impl core::fmt::Debug for Aggregate {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Aggregate")
            .field("len", &self.sum.len())
            .field("contributors", &self.contributors.len())
            .field("faulty_shares", &self.faulty_shares.len())
            .field("refused", &self.refused)
            .field("disputed", &self.disputed)
            .finish()
    }
}

/// Public facts shared by every stage.
struct RoundInfo {
    config: RoundConfig,
    context: RoundContext,
    graph: CommunicationGraph,
    validation: Option<RoundValidation>,
    /// Who verifies whose noise (private, validated rounds).
    noise: Option<NoiseVerifiers>,
}

impl RoundInfo {
    fn threshold(&self) -> u32 {
        self.config.threshold
    }

    fn require(&self, stage: Stage, have: usize) -> Result<(), ProtocolError> {
        if have < self.threshold() as usize {
            return Err(ProtocolError::BelowThreshold { stage, have: have as u32, need: self.threshold() });
        }
        Ok(())
    }

    fn check_sender(&self, from: ClientId, context: &RoundContext) -> Result<(), ProtocolError> {
        if from.get() > self.config.clients {
            return Err(ProtocolError::UnknownClient(from));
        }
        if *context != self.context {
            return Err(ProtocolError::WrongRound);
        }
        Ok(())
    }

    fn members(&self, set: &[bool]) -> Vec<ClientId> {
        set.iter()
            .enumerate()
            .filter(|(_, member)| **member)
            .map(|(index, _)| ClientId::from_index(index))
            .collect()
    }

    /// Neighbours of `client` that belong to `set`, ascending.
    fn neighbours_in(&self, client: ClientId, set: &[bool]) -> Vec<ClientId> {
        self.graph.neighbours(client).into_iter().filter(|v| set[v.index()]).collect()
    }
}

/// Tracks which eligible clients answered in the current stage.
struct Inbox {
    eligible: Vec<bool>,
    received: Vec<bool>,
    count: usize,
}

impl Inbox {
    fn new(eligible: Vec<bool>) -> Self {
        let received = vec![false; eligible.len()];
        Self { eligible, received, count: 0 }
    }

    fn check(&self, from: ClientId, stage: Stage) -> Result<(), ProtocolError> {
        if !self.eligible[from.index()] {
            return Err(ProtocolError::NotEligible { client: from, stage });
        }
        if self.received[from.index()] {
            return Err(ProtocolError::Duplicate(from));
        }
        Ok(())
    }

    fn mark(&mut self, from: ClientId) {
        self.received[from.index()] = true;
        self.count += 1;
    }

    fn complete(&self) -> bool {
        self.count == self.eligible.iter().filter(|&&e| e).count()
    }
}

fn invalid(client: ClientId, reason: &'static str) -> ProtocolError {
    ProtocolError::InvalidMessage { client, reason }
}

/// Collecting AdvertiseKeys.
pub struct CollectingKeys {
    info: Arc<RoundInfo>,
    inbox: Inbox,
    keys: Vec<Option<AdvertisedKeys>>,
}

/// Collecting ShareKeys; U1 is known.
pub struct CollectingShares {
    info: Arc<RoundInfo>,
    keys: Arc<Vec<Option<AdvertisedKeys>>>,
    advertised: Vec<bool>,
    inbox: Inbox,
    /// `envelopes[v]`: envelopes addressed to v, in arrival order.
    envelopes: Vec<Vec<Envelope>>,
    /// `proofs[u]`: u's norm proof, decoded, verified when the stage closes.
    proofs: Vec<Option<NormProof>>,
    /// `attested[u]`: the verifiers' commitments to u's noise edges, with
    /// their digests, by verifier.
    attested: Vec<Vec<Attested>>,
    /// `owned[u]`: u's digests of its noise edges' commitments, by verifier.
    owned: Vec<Vec<(ClientId, [u8; 32])>>,
}

/// What a validated round keeps of its proofs: the input-row commitments
/// of the clients whose proofs verified, and who was refused.
#[derive(Default)]
struct Validated {
    commitments: Vec<Option<Commitment>>,
    refused: Vec<ClientId>,
    /// Edges (owner, verifier) whose two ends committed to different noise.
    disputed: Vec<(ClientId, ClientId)>,
    /// The noise edges' commitments (private rounds).
    noise: Box<NoiseEdges>,
}

/// A verifier's commitment to one of its neighbour's noise edges, and the
/// digest of its bytes (what the owner's digest is compared with).
#[derive(Clone)]
struct Attested {
    verifier: ClientId,
    commitment: Commitment,
    digest: [u8; 32],
}

/// What a private, validated round keeps of its noise attestations.
#[derive(Default)]
struct NoiseEdges {
    /// `attested[u]`: the commitments to u's noise edges, by verifier.
    attested: Vec<Vec<Attested>>,
    /// U2: who completed the second stage, whose attestations count.
    shared: Vec<bool>,
}

/// Collecting masked inputs; U2 is known.
pub struct CollectingMaskedInputs {
    info: Arc<RoundInfo>,
    keys: Arc<Vec<Option<AdvertisedKeys>>>,
    shared: Vec<bool>,
    envelopes: Vec<Vec<Envelope>>,
    inbox: Inbox,
    sum: Vec<u32>,
    /// `arriving[c]`: client c's masked input is arriving in pieces.
    arriving: Vec<bool>,
    /// A broken-off input could not be retracted: the sum is wrong.
    damaged: bool,
    validated: Validated,
}

/// A masked input that arrives in pieces, as its request body does: begun
/// with [`ServerRound::begin_input`], added into the running sum piece by
/// piece with [`ServerRound::continue_input`], then either finished
/// ([`ServerRound::finish_input`]) or, when its body breaks off, is
/// malformed at the end, or the stage closes first, taken back out
/// ([`ServerRound::retract_input`]). The server holds no more of it than
/// one piece: the caller keeps the bytes it handed over (on disk, say) for
/// as long as a retraction may need them.
pub struct IncomingInput {
    from: ClientId,
    context: RoundContext,
    bits: u8,
    len: usize,
    /// Packed bytes added into the sum: whole groups of 8 values, or all.
    added: usize,
    /// Bytes received but not yet added: less than one group of 8 values.
    carry: Vec<u8>,
    finished: bool,
}

impl core::fmt::Debug for IncomingInput {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        // Never the carried bytes: they are part of one client's input.
        f.debug_struct("IncomingInput")
            .field("from", &self.from)
            .field("bits", &self.bits)
            .field("len", &self.len)
            .field("added", &self.added)
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl IncomingInput {
    /// The sender.
    pub fn from(&self) -> ClientId {
        self.from
    }

    /// Packed bytes the whole input holds after its header.
    pub fn expected_bytes(&self) -> usize {
        packed_len(self.len, self.bits)
    }

    /// Packed bytes received so far (added, or waiting for the rest of
    /// their group of 8 values).
    pub fn received_bytes(&self) -> usize {
        self.added + self.carry.len()
    }

    /// Packed bytes already in the running sum: the first this many bytes
    /// handed to [`ServerRound::continue_input`] are what
    /// [`ServerRound::retract_input`] reads back.
    pub fn added_bytes(&self) -> usize {
        self.added
    }

    /// Whether [`ServerRound::finish_input`] accepted it.
    pub fn is_finished(&self) -> bool {
        self.finished
    }
}

/// Collecting consistency signatures (active variant); U3 is known.
pub struct CollectingSignatures {
    info: Arc<RoundInfo>,
    after: AfterMasking,
    inbox: Inbox,
    signatures: Vec<(ClientId, [u8; SIGNATURE_LEN])>,
}

/// Collecting unmasking shares.
pub struct CollectingUnmaskingShares {
    info: Arc<RoundInfo>,
    after: AfterMasking,
    inbox: Inbox,
    signatures: Vec<(ClientId, [u8; SIGNATURE_LEN])>,
    self_mask_shares: Vec<Vec<Share>>,
    mask_key_shares: Vec<Vec<Share>>,
}

/// What the server keeps once masked inputs are in.
struct AfterMasking {
    keys: Arc<Vec<Option<AdvertisedKeys>>>,
    shared: Vec<bool>,
    survived: Vec<bool>,
    survivors: Vec<ClientId>,
    sum: Vec<u32>,
    validated: Validated,
}

/// The server's state in one round.
pub enum ServerRound {
    /// Stage AdvertiseKeys.
    CollectingKeys(CollectingKeys),
    /// Stage ShareKeys.
    CollectingShares(CollectingShares),
    /// Stage MaskedInputCollection.
    CollectingMaskedInputs(CollectingMaskedInputs),
    /// Stage ConsistencyCheck (active variant).
    CollectingSignatures(CollectingSignatures),
    /// Stage Unmasking.
    CollectingUnmaskingShares(CollectingUnmaskingShares),
}

impl core::fmt::Debug for ServerRound {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ServerRound")
            .field("stage", &self.stage())
            .field("received", &self.inbox().count)
            .finish_non_exhaustive()
    }
}

/// What [`ServerRound::advance`] produced.
#[derive(Debug)]
pub enum Advanced {
    /// The next stage.
    Next(ServerRound),
    /// The round is complete.
    Done(Aggregate),
}

impl ServerRound {
    /// Opens a round with validated parameters.
    pub fn new(config: RoundConfig) -> Result<Self, ProtocolError> {
        config.validate()?;
        let n = config.clients as usize;
        let validation = RoundValidation::new(&config)?;
        let noise = match validation.as_ref().and_then(RoundValidation::edge_variance) {
            Some(_) => Some(NoiseVerifiers::new(&config)?),
            None => None,
        };
        let info = Arc::new(RoundInfo {
            context: config.context(),
            graph: config.communication_graph(),
            config,
            validation,
            noise,
        });
        Ok(ServerRound::CollectingKeys(CollectingKeys {
            info,
            inbox: Inbox::new(vec![true; n]),
            keys: vec![None; n],
        }))
    }

    fn info(&self) -> &RoundInfo {
        match self {
            ServerRound::CollectingKeys(s) => &s.info,
            ServerRound::CollectingShares(s) => &s.info,
            ServerRound::CollectingMaskedInputs(s) => &s.info,
            ServerRound::CollectingSignatures(s) => &s.info,
            ServerRound::CollectingUnmaskingShares(s) => &s.info,
        }
    }

    fn inbox(&self) -> &Inbox {
        match self {
            ServerRound::CollectingKeys(s) => &s.inbox,
            ServerRound::CollectingShares(s) => &s.inbox,
            ServerRound::CollectingMaskedInputs(s) => &s.inbox,
            ServerRound::CollectingSignatures(s) => &s.inbox,
            ServerRound::CollectingUnmaskingShares(s) => &s.inbox,
        }
    }

    /// The round's parameters.
    pub fn config(&self) -> &RoundConfig {
        &self.info().config
    }

    /// The round context.
    pub fn context(&self) -> RoundContext {
        self.info().context
    }

    /// The stage whose client messages are being collected.
    pub fn stage(&self) -> Stage {
        match self {
            ServerRound::CollectingKeys(_) => Stage::AdvertiseKeys,
            ServerRound::CollectingShares(_) => Stage::ShareKeys,
            ServerRound::CollectingMaskedInputs(_) => Stage::MaskedInputCollection,
            ServerRound::CollectingSignatures(_) => Stage::ConsistencyCheck,
            ServerRound::CollectingUnmaskingShares(_) => Stage::Unmasking,
        }
    }

    /// Messages accepted in the current stage.
    pub fn received(&self) -> usize {
        self.inbox().count
    }

    /// Clients allowed to send in the current stage.
    pub fn eligible(&self) -> Vec<ClientId> {
        self.info().members(&self.inbox().eligible)
    }

    /// Whether `client` may send a message in the current stage.
    pub fn is_eligible(&self, client: ClientId) -> bool {
        client.get() >= 1
            && client.get() <= self.info().config.clients
            && self.inbox().eligible[client.index()]
    }

    /// The largest message an eligible client may send now: one of the
    /// current stage, or a late copy of its message of the stage before
    /// (which is then refused as out of phase, not as oversized). See
    /// [`ClientMessage::max_encoded_len`].
    pub fn max_message_len(&self) -> usize {
        let config = self.config();
        let previous = match self.stage() {
            Stage::ShareKeys => Stage::AdvertiseKeys,
            Stage::MaskedInputCollection => Stage::ShareKeys,
            Stage::ConsistencyCheck => Stage::MaskedInputCollection,
            Stage::Unmasking if config.variant == Variant::Active => Stage::ConsistencyCheck,
            Stage::Unmasking => Stage::MaskedInputCollection,
            _ => Stage::Setup,
        };
        ClientMessage::max_encoded_len(config, self.stage())
            .max(ClientMessage::max_encoded_len(config, previous))
    }

    /// Whether `client` already sent its message for the current stage.
    pub fn has_received(&self, client: ClientId) -> bool {
        client.get() >= 1
            && client.get() <= self.info().config.clients
            && self.inbox().received[client.index()]
    }

    /// Whether every eligible client has sent its message.
    pub fn is_complete(&self) -> bool {
        self.inbox().complete()
    }

    /// Whether enough messages arrived for [`advance`](Self::advance) to succeed.
    pub fn has_quorum(&self) -> bool {
        self.received() >= self.info().threshold() as usize
    }

    /// The message that opens the round for every client.
    pub fn setup_message(&self) -> ServerMessage {
        ServerMessage::Setup(self.info().config.clone())
    }

    /// What `client` must be sent to take part in the current stage, or
    /// `None` if it is not eligible.
    pub fn message_for(&self, client: ClientId) -> Option<ServerMessage> {
        let info = self.info();
        if client.get() == 0 || client.get() > info.config.clients || !self.inbox().eligible[client.index()] {
            return None;
        }
        let context = info.context;
        Some(match self {
            ServerRound::CollectingKeys(_) => self.setup_message(),
            ServerRound::CollectingShares(s) => ServerMessage::PeerKeys {
                context,
                peers: info
                    .neighbours_in(client, &s.advertised)
                    .into_iter()
                    .filter_map(|v| s.keys[v.index()].clone())
                    .collect(),
            },
            ServerRound::CollectingMaskedInputs(s) => {
                let mut envelopes = s.envelopes[client.index()].clone();
                envelopes.sort_by_key(|envelope| envelope.peer);
                ServerMessage::Shares { context, envelopes }
            }
            ServerRound::CollectingSignatures(s) => {
                ServerMessage::Survivors { context, survivors: s.after.survivors.clone() }
            }
            ServerRound::CollectingUnmaskingShares(s) => match info.config.variant {
                Variant::SemiHonest => {
                    ServerMessage::Survivors { context, survivors: s.after.survivors.clone() }
                }
                // Each client is handed the first t signatures of its own
                // neighbourhood (itself and its neighbours): the only ones
                // it counts.
                Variant::Active => ServerMessage::Signatures {
                    context,
                    signatures: s
                        .signatures
                        .iter()
                        .filter(|(signer, _)| *signer == client || info.graph.are_neighbours(*signer, client))
                        .take(info.threshold() as usize)
                        .copied()
                        .collect(),
                },
            },
        })
    }

    /// Accepts one message from `from`. A refused message leaves the state
    /// unchanged, so the round goes on for everybody else.
    pub fn receive(&mut self, from: ClientId, message: ClientMessage) -> Result<(), ProtocolError> {
        let stage = self.admit(from, message.stage(), message.context())?;
        match (self, message) {
            (ServerRound::CollectingKeys(s), message) => s.receive(from, message),
            (ServerRound::CollectingShares(s), ClientMessage::ShareKeys { envelopes, proof, noise, .. }) => {
                s.receive(from, envelopes, proof, noise)
            }
            (ServerRound::CollectingMaskedInputs(s), ClientMessage::MaskedInput { vector, .. }) => {
                s.receive(from, vector)
            }
            (ServerRound::CollectingSignatures(s), ClientMessage::Consistency { signature, .. }) => {
                s.receive(from, signature)
            }
            (ServerRound::CollectingUnmaskingShares(s), ClientMessage::Unmasking { shares, .. }) => {
                s.receive(from, shares)
            }
            // The stage comparison above rules out every other pairing.
            (_, message) => Err(ProtocolError::OutOfPhase { expected: stage, got: message.stage() }),
        }
    }

    /// Accepts one encoded message from `from`, as [`receive`](Self::receive)
    /// does its decoded form. A masked input is never decoded into a
    /// vector: its packed values are checked and added straight into the
    /// running sum (on parallel threads with feature `parallel`), which
    /// saves a copy of the vector and its allocation for every client.
    pub fn receive_encoded(&mut self, from: ClientId, bytes: &[u8]) -> Result<(), ProtocolError> {
        if let Some(input) = PackedMaskedInput::peek(bytes)? {
            self.admit(from, Stage::MaskedInputCollection, &input.context)?;
            if let ServerRound::CollectingMaskedInputs(s) = self {
                return s.receive_packed(from, &input);
            }
        }
        self.receive(from, ClientMessage::decode(bytes)?)
    }

    /// What every message must pass before its content is read: it belongs
    /// to the stage in progress, comes from a client of the roster for this
    /// round, and is that client's first in the stage. Returns the stage.
    fn admit(&self, from: ClientId, got: Stage, context: &RoundContext) -> Result<Stage, ProtocolError> {
        let stage = self.stage();
        if got != stage {
            return Err(ProtocolError::OutOfPhase { expected: stage, got });
        }
        self.info().check_sender(from, context)?;
        self.inbox().check(from, stage)?;
        if let ServerRound::CollectingMaskedInputs(s) = self
            && s.arriving[from.index()]
        {
            return Err(ProtocolError::Duplicate(from));
        }
        Ok(stage)
    }

    /// Begins a masked input that arrives in pieces (see [`IncomingInput`])
    /// from its first [`MASKED_INPUT_HEADER_LEN`](crate::messages::MASKED_INPUT_HEADER_LEN) bytes: the same checks as
    /// a whole message's header (stage, sender, context, first in the
    /// stage, width and length). Until it is finished or retracted the
    /// sender may send nothing else and the stage may not close.
    pub fn begin_input(&mut self, from: ClientId, header: &[u8]) -> Result<IncomingInput, ProtocolError> {
        let header = MaskedInputHeader::parse(header)?;
        self.admit(from, Stage::MaskedInputCollection, &header.context)?;
        let ServerRound::CollectingMaskedInputs(s) = self else {
            return Err(ProtocolError::OutOfPhase {
                expected: self.stage(),
                got: Stage::MaskedInputCollection,
            });
        };
        s.check_shape(from, header.bits, header.len)?;
        s.arriving[from.index()] = true;
        Ok(IncomingInput {
            from,
            context: header.context,
            bits: header.bits,
            len: header.len,
            added: 0,
            carry: Vec::with_capacity(usize::from(header.bits)),
            finished: false,
        })
    }

    /// Adds the next `bytes` of `input`'s packed values into the running
    /// sum: every whole group of 8 values (a group is `bits` bytes and
    /// starts at a byte boundary); up to one group's bytes wait for the
    /// next piece. Bytes past the input's length, or non-zero padding bits
    /// in its last byte, are refused before anything of this piece is
    /// added; what earlier pieces added stays until the input is finished
    /// or retracted.
    pub fn continue_input(&mut self, input: &mut IncomingInput, bytes: &[u8]) -> Result<(), ProtocolError> {
        let s = self.arriving(input)?;
        let total = input.expected_bytes();
        let received = input.received_bytes();
        if bytes.len() > total - received {
            return Err(DecodeError::TrailingBytes(bytes.len() - (total - received)).into());
        }
        let complete = received + bytes.len() == total;
        if complete
            && let Some(last) = bytes.last()
            && !last_byte_padding_is_zero(*last, input.len, input.bits)
        {
            return Err(ProtocolError::from(DecodeError::Invalid("padding bits")));
        }
        let group = usize::from(input.bits);
        let mut rest = bytes;
        if !input.carry.is_empty() {
            let take = (group - input.carry.len()).min(rest.len());
            input.carry.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if input.carry.len() == group || (complete && rest.is_empty()) {
                s.add_region(input.added, &input.carry, input.bits, input.len, true);
                input.added += input.carry.len();
                input.carry.clear();
            }
        }
        let whole = if complete { rest.len() } else { rest.len() / group * group };
        if whole > 0 {
            s.add_region(input.added, &rest[..whole], input.bits, input.len, true);
            input.added += whole;
        }
        input.carry.extend_from_slice(&rest[whole..]);
        debug_assert!(input.carry.len() < group);
        Ok(())
    }

    /// Accepts `input` once all its bytes are in: the sender now counts as
    /// having sent its masked input. A short input is refused
    /// (`Truncated`) and must be retracted.
    pub fn finish_input(&mut self, input: &mut IncomingInput) -> Result<(), ProtocolError> {
        let s = self.arriving(input)?;
        if input.added != input.expected_bytes() {
            return Err(DecodeError::Truncated.into());
        }
        s.arriving[input.from.index()] = false;
        s.inbox.mark(input.from);
        input.finished = true;
        Ok(())
    }

    /// Takes what `input` added back out of the running sum: `read(offset,
    /// buffer)` must fill `buffer` with the packed bytes at `offset` of
    /// those handed to [`continue_input`](Self::continue_input), up to
    /// [`IncomingInput::added_bytes`]. The sender counts as not having
    /// sent anything (a dropout, unless it sends again before the stage
    /// closes). A finished input is never retracted (nothing happens). If
    /// `read` fails the sum cannot be mended: the stage then refuses to
    /// close ([`ProtocolError::SumDamaged`]) and the round ends without
    /// unmasking anything.
    pub fn retract_input<E>(
        &mut self,
        input: IncomingInput,
        mut read: impl FnMut(usize, &mut [u8]) -> Result<(), E>,
    ) -> Result<(), ProtocolError> {
        if input.finished {
            return Ok(());
        }
        let s = self.arriving(&input)?;
        s.arriving[input.from.index()] = false;
        let step = PIECE_VALUES / 8 * usize::from(input.bits);
        let mut buffer = vec![0u8; step.min(input.added)];
        let mut offset = 0;
        while offset < input.added {
            let piece = &mut buffer[..step.min(input.added - offset)];
            if read(offset, piece).is_err() {
                s.damaged = true;
                return Err(ProtocolError::SumDamaged);
            }
            s.add_region(offset, piece, input.bits, input.len, false);
            offset += piece.len();
        }
        Ok(())
    }

    /// The masked-input stage that `input` is arriving in.
    fn arriving(&mut self, input: &IncomingInput) -> Result<&mut CollectingMaskedInputs, ProtocolError> {
        let stage = self.stage();
        let ServerRound::CollectingMaskedInputs(s) = self else {
            return Err(ProtocolError::OutOfPhase { expected: stage, got: Stage::MaskedInputCollection });
        };
        if input.context != s.info.context {
            return Err(ProtocolError::WrongRound);
        }
        if input.finished || !s.arriving[input.from.index()] {
            return Err(invalid(input.from, "no masked input of this client is arriving"));
        }
        Ok(s)
    }

    /// Closes the current stage. Fails, ending the round, when fewer than t
    /// clients answered; the last stage reconstructs the dropped clients'
    /// keys and the survivors' seeds, removes the masks and returns the sum.
    pub fn advance(self) -> Result<Advanced, ProtocolError> {
        match self {
            ServerRound::CollectingKeys(s) => s.advance().map(Advanced::Next),
            ServerRound::CollectingShares(s) => s.advance().map(Advanced::Next),
            ServerRound::CollectingMaskedInputs(s) => s.advance().map(Advanced::Next),
            ServerRound::CollectingSignatures(s) => s.advance().map(Advanced::Next),
            ServerRound::CollectingUnmaskingShares(s) => s.finish().map(Advanced::Done),
        }
    }
}

impl CollectingKeys {
    fn receive(&mut self, from: ClientId, message: ClientMessage) -> Result<(), ProtocolError> {
        let ClientMessage::AdvertiseKeys { cipher_key, mask_key, seed_commitment, signature, .. } = message
        else {
            return Err(ProtocolError::OutOfPhase { expected: Stage::AdvertiseKeys, got: message.stage() });
        };
        let info = &self.info;
        if cipher_key == mask_key {
            return Err(invalid(from, "the two advertised keys must differ"));
        }
        if is_low_order(&cipher_key) || is_low_order(&mask_key) {
            return Err(invalid(from, "an advertised key is of low order"));
        }
        match (info.config.variant, signature) {
            (Variant::SemiHonest, None) => {}
            (Variant::SemiHonest, Some(_)) => return Err(invalid(from, "unexpected signature")),
            (Variant::Active, None) => return Err(invalid(from, "missing signature")),
            (Variant::Active, Some(sig)) => {
                let statement = derive::advertise_statement(
                    &info.context,
                    from,
                    &cipher_key,
                    &mask_key,
                    &seed_commitment,
                );
                verify(&info.config.identities[from.index()], &statement, &sig)?;
            }
        }
        self.keys[from.index()] =
            Some(AdvertisedKeys { id: from, cipher_key, mask_key, seed_commitment, signature });
        self.inbox.mark(from);
        Ok(())
    }

    fn advance(self) -> Result<ServerRound, ProtocolError> {
        let info = self.info;
        info.require(Stage::AdvertiseKeys, self.inbox.count)?;
        let advertised = self.inbox.received;
        // A client with fewer than t advertising neighbours cannot share its
        // secrets safely and will abort; nobody expects its shares.
        let eligible: Vec<bool> = (0..advertised.len())
            .map(|i| {
                advertised[i]
                    && info.neighbours_in(ClientId::from_index(i), &advertised).len()
                        >= info.threshold() as usize
            })
            .collect();
        let n = advertised.len();
        Ok(ServerRound::CollectingShares(CollectingShares {
            info,
            keys: Arc::new(self.keys),
            advertised,
            inbox: Inbox::new(eligible),
            envelopes: vec![Vec::new(); n],
            proofs: vec![None; n],
            attested: vec![Vec::new(); n],
            owned: vec![Vec::new(); n],
        }))
    }
}

impl CollectingShares {
    fn receive(
        &mut self,
        from: ClientId,
        envelopes: Vec<Envelope>,
        proof: Option<Vec<u8>>,
        noise: Vec<NoiseAttestation>,
    ) -> Result<(), ProtocolError> {
        let expected = self.info.neighbours_in(from, &self.advertised);
        if envelopes.len() != expected.len()
            || envelopes.iter().zip(&expected).any(|(envelope, id)| envelope.peer != *id)
        {
            return Err(invalid(from, "envelopes must address exactly the neighbours that advertised keys"));
        }
        if envelopes.iter().any(|envelope| envelope.ciphertext.len() != ENVELOPE_LEN) {
            return Err(invalid(from, "an envelope has the wrong length"));
        }
        // The proof is decoded now (a malformed one refuses the message) and
        // verified with the others when the stage closes.
        let proof = match (&self.info.validation, proof) {
            (None, None) => None,
            (None, Some(_)) => return Err(invalid(from, "a proof in a round without validation")),
            (Some(_), None) => return Err(invalid(from, "a validated round needs the input's norm proof")),
            (Some(validation), Some(bytes)) => Some(
                NormProof::decode(validation.bound(), &bytes)
                    .map_err(|_| invalid(from, "the norm proof is malformed"))?,
            ),
        };
        // Exactly one commitment for every noise edge between this client
        // and an advertising neighbour: its own edges, and those it
        // verifies.
        let attestations = match (&self.info.noise, &self.info.validation) {
            (Some(verifiers), Some(validation)) => {
                let mut edges: Vec<(ClientId, ClientId)> = verifiers
                    .verified_by(from)
                    .into_iter()
                    .map(|u| (u, from))
                    .chain(verifiers.of(from).into_iter().map(|j| (from, j)))
                    .filter(|&(u, j)| expected.binary_search(if u == from { &j } else { &u }).is_ok())
                    .collect();
                edges.sort_unstable();
                edges.dedup();
                if noise.len() != edges.len()
                    || noise.iter().zip(&edges).any(|(a, edge)| (a.owner, a.verifier) != *edge)
                {
                    return Err(invalid(
                        from,
                        "noise commitments must cover exactly the client's edges with neighbours that advertised keys",
                    ));
                }
                noise
                    .iter()
                    .map(|a| {
                        let malformed = || invalid(from, "a noise commitment is malformed");
                        if a.owner == from {
                            let digest: [u8; 32] =
                                a.commitment.as_slice().try_into().map_err(|_| malformed())?;
                            Ok::<_, ProtocolError>((a.owner, a.verifier, digest, None::<Commitment>))
                        } else {
                            let commitment = Commitment::decode(validation.bound(), &a.commitment)
                                .map_err(|_| malformed())?;
                            let digest = validation::noise::commitment_digest(&a.commitment);
                            Ok((a.owner, a.verifier, digest, Some(commitment)))
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            _ if !noise.is_empty() => {
                return Err(invalid(from, "noise attestations in a round without them"));
            }
            _ => Vec::new(),
        };
        self.proofs[from.index()] = proof;
        for (owner, verifier, digest, commitment) in attestations {
            match commitment {
                None => self.owned[from.index()].push((verifier, digest)),
                Some(commitment) => {
                    self.attested[owner.index()].push(Attested { verifier: from, commitment, digest });
                }
            }
        }
        for Envelope { peer, ciphertext } in envelopes {
            self.envelopes[peer.index()].push(Envelope { peer: from, ciphertext });
        }
        self.inbox.mark(from);
        Ok(())
    }

    /// Takes `out` (ascending, each of them received) back out of the
    /// stage as if they had never shared their keys: their envelopes are
    /// withdrawn, so no neighbour masks with them and nothing of theirs
    /// needs unmasking.
    fn withdraw(&mut self, out: &[ClientId]) {
        for id in out {
            self.inbox.received[id.index()] = false;
            self.inbox.count -= 1;
        }
        self.envelopes.iter_mut().for_each(|list| list.retain(|e| out.binary_search(&e.peer).is_err()));
    }

    fn advance(mut self) -> Result<ServerRound, ProtocolError> {
        let info = Arc::clone(&self.info);
        // Every proof is verified in one batch; a client whose proof fails
        // is taken out as if it had never shared its keys: its envelopes are
        // withdrawn, so no neighbour masks with it and nothing of it needs
        // unmasking.
        let validated = match &info.validation {
            None => Validated::default(),
            Some(validation) => {
                let validated = verify_proofs(&info.context, validation, &self.proofs);
                self.withdraw(&validated.refused);
                validated
            }
        };
        // An edge whose two ends committed to different noise: one of them
        // lies (a verifier that shifts its attestation could otherwise add
        // the shift to its own input unseen). Both are taken out as a
        // refused proof is, and named.
        let mut validated = validated;
        let disputes = disputed_edges(&self.owned, &self.attested, &self.inbox.received);
        if !disputes.is_empty() {
            let mut out: Vec<ClientId> = disputes.iter().flat_map(|&(u, j)| [u, j]).collect();
            out.sort_unstable();
            out.dedup();
            self.withdraw(&out);
            validated.refused.extend(out);
            validated.refused.sort_unstable();
            validated.refused.dedup();
            validated.disputed = disputes;
        }
        info.require(Stage::ShareKeys, self.inbox.count)?;
        let shared = self.inbox.received;
        let noise = Box::new(NoiseEdges { attested: self.attested, shared: shared.clone() });
        let validated = Validated { noise, ..validated };
        // Envelopes from clients that never completed the stage cannot
        // exist: a message is applied whole or not at all.
        let eligible: Vec<bool> = (0..shared.len())
            .map(|i| shared[i] && self.envelopes[i].len() >= info.threshold() as usize)
            .collect();
        let sum = vec![0u32; info.config.vector_len as usize];
        Ok(ServerRound::CollectingMaskedInputs(CollectingMaskedInputs {
            info,
            keys: self.keys,
            shared,
            envelopes: self.envelopes,
            arriving: vec![false; eligible.len()],
            damaged: false,
            inbox: Inbox::new(eligible),
            sum,
            validated,
        }))
    }
}

impl CollectingMaskedInputs {
    /// Whether a masked input of `bits` and `len` fits the round.
    fn check_shape(&self, from: ClientId, bits: u8, len: usize) -> Result<(), ProtocolError> {
        let config = &self.info.config;
        if bits != config.modulus_bits {
            return Err(invalid(from, "masked input uses the wrong modulus"));
        }
        if len != config.vector_len as usize {
            return Err(invalid(from, "masked input has the wrong length"));
        }
        if let Some(verifiers) = &self.info.noise
            && verifiers.edges(from, |j| self.shared[j.index()]).is_none()
        {
            return Err(invalid(
                from,
                "fewer than two of the client's noise verifiers completed the second stage",
            ));
        }
        Ok(())
    }

    fn receive(&mut self, from: ClientId, vector: MaskedVector) -> Result<(), ProtocolError> {
        self.check_shape(from, vector.bits, vector.values.len())?;
        // Only the running sum is kept; the individual vector is dropped here.
        for (total, value) in self.sum.iter_mut().zip(&vector.values) {
            *total = total.wrapping_add(*value);
        }
        self.inbox.mark(from);
        Ok(())
    }

    fn receive_packed(&mut self, from: ClientId, input: &PackedMaskedInput<'_>) -> Result<(), ProtocolError> {
        self.check_shape(from, input.bits, input.len)?;
        self.add_region(0, input.packed, input.bits, input.len, true);
        self.inbox.mark(from);
        Ok(())
    }

    /// Adds (or subtracts) the packed values in `bytes`, which start at
    /// byte `offset` of a vector of `len` values of `bits` bits (a multiple
    /// of `bits` bytes: a whole number of groups of 8 values), into the
    /// sum, in pieces of [`PIECE_VALUES`] on the worker threads. `bytes`
    /// ends at a group boundary or at the vector's end.
    fn add_region(&mut self, offset: usize, bytes: &[u8], bits: u8, len: usize, add: bool) {
        let group = usize::from(bits);
        debug_assert_eq!(offset % group, 0);
        let first = offset / group * 8;
        let values =
            if bytes.len() % group == 0 { (bytes.len() / group * 8).min(len - first) } else { len - first };
        debug_assert_eq!(packed_len(values, bits), bytes.len());
        let sum = &mut self.sum[first..first + values];
        let bytes_per_piece = PIECE_VALUES / 8 * group;
        let combine = |(piece, sum): (&[u8], &mut [u32])| {
            if add { add_packed(piece, bits, sum) } else { subtract_packed(piece, bits, sum) }
        };
        #[cfg(feature = "parallel")]
        {
            use rayon::prelude::*;
            bytes.par_chunks(bytes_per_piece).zip(sum.par_chunks_mut(PIECE_VALUES)).for_each(combine);
        }
        #[cfg(not(feature = "parallel"))]
        bytes.chunks(bytes_per_piece).zip(sum.chunks_mut(PIECE_VALUES)).for_each(combine);
    }

    fn advance(self) -> Result<ServerRound, ProtocolError> {
        let arriving = self.arriving.iter().filter(|&&a| a).count();
        if arriving > 0 {
            return Err(ProtocolError::InputsArriving(arriving as u32));
        }
        if self.damaged {
            return Err(ProtocolError::SumDamaged);
        }
        let info = self.info;
        // The invariant that protects individual inputs: fewer than t
        // survivors and the round ends without unmasking anything.
        info.require(Stage::MaskedInputCollection, self.inbox.count)?;
        let survived = self.inbox.received;
        let survivors = info.members(&survived);
        let after = AfterMasking {
            keys: self.keys,
            shared: self.shared,
            survived: survived.clone(),
            survivors,
            sum: self.sum,
            validated: self.validated,
        };
        drop(self.envelopes);
        Ok(match info.config.variant {
            Variant::Active => ServerRound::CollectingSignatures(CollectingSignatures {
                info,
                after,
                inbox: Inbox::new(survived),
                signatures: Vec::new(),
            }),
            Variant::SemiHonest => {
                let n = survived.len();
                ServerRound::CollectingUnmaskingShares(CollectingUnmaskingShares {
                    info,
                    after,
                    inbox: Inbox::new(survived),
                    signatures: Vec::new(),
                    self_mask_shares: (0..n).map(|_| Vec::new()).collect(),
                    mask_key_shares: (0..n).map(|_| Vec::new()).collect(),
                })
            }
        })
    }
}

impl CollectingSignatures {
    fn receive(&mut self, from: ClientId, signature: [u8; SIGNATURE_LEN]) -> Result<(), ProtocolError> {
        let statement = derive::consistency_statement(&self.info.context, from, &self.after.survivors);
        verify(&self.info.config.identities[from.index()], &statement, &signature)?;
        self.signatures.push((from, signature));
        self.inbox.mark(from);
        Ok(())
    }

    fn advance(mut self) -> Result<ServerRound, ProtocolError> {
        self.info.require(Stage::ConsistencyCheck, self.inbox.count)?;
        // A client goes on once t of its own neighbourhood signed the list it
        // saw (each signature here was checked on arrival): every signature
        // is kept, and each client is relayed the first t of its
        // neighbourhood (`message_for`).
        self.signatures.sort_by_key(|(id, _)| *id);
        let n = self.inbox.received.len();
        Ok(ServerRound::CollectingUnmaskingShares(CollectingUnmaskingShares {
            info: self.info,
            after: self.after,
            inbox: Inbox::new(self.inbox.received),
            signatures: self.signatures,
            self_mask_shares: (0..n).map(|_| Vec::new()).collect(),
            mask_key_shares: (0..n).map(|_| Vec::new()).collect(),
        }))
    }
}

impl CollectingUnmaskingShares {
    fn receive(&mut self, from: ClientId, shares: UnmaskingShares) -> Result<(), ProtocolError> {
        let after = &self.after;
        // `from` holds shares of exactly its neighbours that sent envelopes.
        let held = self.info.neighbours_in(from, &after.shared);
        let (survived, dropped): (Vec<ClientId>, Vec<ClientId>) =
            held.into_iter().partition(|v| after.survived[v.index()]);
        // A survivor reveals its own seed share with its surviving
        // neighbours' (b_u is shared with u itself too).
        let mut seeds = survived;
        seeds.push(from);
        seeds.sort_unstable();
        let owners = |list: &[(ClientId, Share)]| list.iter().map(|(id, _)| *id).collect::<Vec<_>>();
        if owners(&shares.self_mask) != seeds || owners(&shares.mask_key) != dropped {
            return Err(invalid(
                from,
                "shares must cover exactly itself and the surviving neighbours, and the dropped neighbours",
            ));
        }
        let all = shares.self_mask.iter().chain(&shares.mask_key);
        if all.clone().any(|(_, share)| share.point() != from.get()) {
            return Err(invalid(from, "a share carries another client's evaluation point"));
        }
        for (owner, share) in shares.self_mask {
            self.self_mask_shares[owner.index()].push(share);
        }
        for (owner, share) in shares.mask_key {
            self.mask_key_shares[owner.index()].push(share);
        }
        self.inbox.mark(from);
        Ok(())
    }

    fn finish(self) -> Result<Aggregate, ProtocolError> {
        let info = self.info;
        info.require(Stage::Unmasking, self.inbox.count)?;
        let mut after = self.after;
        // The masks come off the running sum in place.
        let mut sum = core::mem::take(&mut after.sum);
        let dropped: Vec<ClientId> = (0..after.shared.len())
            .filter(|&i| after.shared[i] && !after.survived[i])
            .map(ClientId::from_index)
            .collect();
        let jobs = UnmaskJob {
            context: &info.context,
            threshold: info.threshold() as usize,
            keys: &after.keys,
            survivors: &after.survivors,
            dropped: &dropped,
            self_mask_shares: &self.self_mask_shares,
            mask_key_shares: &self.mask_key_shares,
            partners_of_dropped: &|v| {
                info.graph.neighbours(v).into_iter().filter(|u| after.survived[u.index()]).collect()
            },
        };
        let (faulty_shares, masks_removed) = unmask(&jobs, &mut sum)?;
        let modulus = info.config.modulus_mask();
        sum.iter_mut().for_each(|v| *v &= modulus);
        if let Some(validation) = &info.validation {
            check_commitments(
                &info.context,
                validation,
                info.noise.as_ref(),
                &after.validated,
                &after.survivors,
                &sum,
            )?;
            sum.truncate(validation.dimension());
        }
        Ok(Aggregate {
            sum,
            contributors: after.survivors.clone(),
            faulty_shares,
            masks_removed,
            refused: after.validated.refused,
            disputed: after.validated.disputed,
        })
    }
}

/// The edges between two clients that both completed the second stage whose
/// owner's digest differs from that of its verifier's commitment (a missing
/// one counts as different), ascending.
fn disputed_edges(
    owned: &[Vec<(ClientId, [u8; 32])>],
    attested: &[Vec<Attested>],
    received: &[bool],
) -> Vec<(ClientId, ClientId)> {
    let mut disputes = Vec::new();
    for (index, edges) in owned.iter().enumerate() {
        if !received[index] {
            continue;
        }
        let owner = ClientId::from_index(index);
        for (verifier, own) in edges {
            if !received[verifier.index()] {
                continue;
            }
            let theirs = attested[index].iter().find(|a| a.verifier == *verifier).map(|a| &a.digest);
            if theirs != Some(own) {
                disputes.push((owner, *verifier));
            }
        }
    }
    disputes
}

/// Batch-verifies the proofs received, with weights drawn from a hash of
/// the round and every proof (no prover can know them before its proof is
/// fixed).
fn verify_proofs(
    context: &RoundContext,
    validation: &RoundValidation,
    proofs: &[Option<NormProof>],
) -> Validated {
    let contexts: Vec<(ClientId, Vec<u8>)> = proofs
        .iter()
        .enumerate()
        .filter(|(_, proof)| proof.is_some())
        .map(|(index, _)| {
            let id = ClientId::from_index(index);
            (id, RoundValidation::context(context, id))
        })
        .collect();
    let items: Vec<(&[u8], &NormProof)> = contexts
        .iter()
        .filter_map(|(id, bytes)| Some((bytes.as_slice(), proofs[id.index()].as_ref()?)))
        .collect();
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(b"cohort/validation/v1/batch-weights");
    digest.update(&context.0);
    items.iter().for_each(|(context, proof)| {
        digest.update(context);
        digest.update(&proof.to_bytes());
    });
    let mut rng = weights_rng(digest);
    let verified = validation::verify_each(validation.bound(), &items, &mut rng);
    let mut commitments = vec![None; proofs.len()];
    let mut refused = Vec::new();
    for ((id, _), commitment) in contexts.iter().zip(verified) {
        match commitment {
            Some(commitment) => commitments[id.index()] = Some(commitment),
            None => refused.push(*id),
        }
    }
    Validated { commitments, refused, ..Validated::default() }
}

/// The sum check of a validated round: the unmasked sum (its committed
/// part, centred) must open the sum of the survivors' row commitments under
/// the unmasked sum of their blindings (the tail).
fn check_commitments(
    context: &RoundContext,
    validation: &RoundValidation,
    noise: Option<&NoiseVerifiers>,
    validated: &Validated,
    survivors: &[ClientId],
    sum: &[u32],
) -> Result<(), ProtocolError> {
    let (committed, tail) = sum.split_at(validation.dimension());
    let centred = validation.centred_sum(committed, survivors.len());
    let blinding_sums = validation.blinding_sums(tail);
    let mut commitments: Option<Vec<&Commitment>> =
        survivors.iter().map(|id| validated.commitments.get(id.index())?.as_ref()).collect();
    let mismatch = || ProtocolError::CommitmentMismatch { suspects: survivors.to_vec() };
    // A private round's noise: each survivor's edges, as it took them, as
    // their verifiers committed to them.
    if let (Some(verifiers), Some(rows)) = (noise, commitments.as_mut()) {
        for &u in survivors {
            let edges = verifiers.edges(u, |j| validated.noise.shared[j.index()]).ok_or_else(mismatch)?;
            for j in edges {
                let attested = validated.noise.attested[u.index()].iter().find(|a| a.verifier == j);
                rows.push(&attested.ok_or_else(mismatch)?.commitment);
            }
        }
    }
    let rows = commitments.ok_or_else(mismatch)?;
    // The weights need only be unpredictable before the sum is known: every
    // commitment was fixed (and hashed into the proofs' batch) before any
    // masked input arrived, and the sum decides them here.
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    digest.update(b"cohort/validation/v1/sum-weights");
    digest.update(&context.0);
    sum.iter().for_each(|v| digest.update(&v.to_le_bytes()));
    survivors.iter().for_each(|id| digest.update(&id.get().to_le_bytes()));
    let mut rng = weights_rng(digest);
    validation::check_sum(validation.bound(), &rows, &centred, &blinding_sums, &mut rng)
        .map_err(|_| mismatch())
}

/// A ChaCha20 generator keyed by a finished digest.
fn weights_rng(digest: ring::digest::Context) -> rand_chacha::ChaCha20Rng {
    use rand_core::SeedableRng;
    let mut seed = [0u8; 32];
    seed.copy_from_slice(digest.finish().as_ref());
    rand_chacha::ChaCha20Rng::from_seed(seed)
}
