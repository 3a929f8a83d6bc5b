//! The round in progress: selecting its clients, splitting them into
//! secure-aggregation groups, each group's state, and the deadlines of
//! its stages.
//!
//! A round of n selected clients runs as [`Groups::count`] independent
//! protocol instances of [`Groups::size`] clients each (Bonawitz et al.,
//! "Towards Federated Learning at Scale", SysML 2019): every group has its
//! own session, roster, client ids, threshold and deadlines, is unmasked
//! on its own, and only a group's sum, of at least its threshold of
//! clients, is ever unmasked. The round adds the sums of the groups that
//! completed.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::os::unix::fs::FileExt;

use cohort_crypto::messages::MASKED_INPUT_HEADER_LEN;
use cohort_crypto::policy::TaskSecurity;
use cohort_crypto::quantize::{SumSpread, WeightedMean};
use cohort_crypto::{
    Advanced, Aggregate, ClientId, IncomingInput, ProtocolError, Quantizer, ServerRound, Stage, Variant,
};
use rand_chacha::ChaCha20Rng;

use super::builder::{BuiltRound, RoundBuilder, RoundSeeds};
use super::completion::PendingUnmask;
use super::engine::SumCheck;
use super::owned::GroupReport;
use super::records::{
    AttemptOutcome, EngineError, FailedAttempt, GroupMetrics, Poll, RoundMetrics, StageMetrics, TaskError,
};
use crate::spec::{Groups, TaskSpec};

/// Where one group of the round in progress is.
#[allow(clippy::large_enum_variant)] // Collecting is the state nearly always; no box per stage.
pub(super) enum GroupState {
    /// A stage is collecting client messages.
    Collecting(ServerRound),
    /// The final stage closed with a quorum; its server state is with the
    /// [`PendingUnmask`](super::completion::PendingUnmask) off the runtime.
    Unmasking,
    /// Unmasked and decoded: the group's part of the round's sum.
    Done(GroupSum),
    /// Given up in `stage`: too few clients, or its unmasking failed, with
    /// why in words where the group knows it. Nothing of the group is in
    /// the round's sum.
    Failed { stage: Stage, reason: Option<String> },
    /// Run by another replica, its owner: settled from what the owner
    /// stores (see [`super::owned`]).
    Remote(RemoteGroup),
}

/// A group of the round that another replica runs (its URL is the
/// group's `owner`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RemoteGroup {
    /// Whether the owner has taken the group up: its clients are told
    /// they are selected only then, so that their first stage message
    /// finds the group.
    pub(super) adopted: bool,
    /// The stage the owner last reported.
    pub(super) stage: Stage,
}

/// What closing a group's stage came to (`Group::advance`): the one
/// hand-off from a group to whoever drives it (the task's engine, for a
/// group of a sync round or an async group, or the replica that runs a
/// group for another's round).
pub enum GroupStep {
    /// The next stage is collecting.
    Next(Stage),
    /// The masked-input stage opened: these participants are about to be
    /// asked for their masked input. Each of them refuses every later
    /// attempt of this round number (a client sends one masked input per
    /// round), so the driver records them durably before the stage is
    /// served, and gives the group up if it cannot.
    MaskedInputRequested(Vec<String>),
    /// The final stage closed with a quorum: the job to unmask off the
    /// runtime (the group stays `Unmasking` until its result comes back).
    Unmask(Box<PendingUnmask>),
    /// The group was given up in this stage.
    Failed(Stage),
}

/// What serves a selected client's stage messages: a task's engine (the
/// group of its sync round, or its async group, that the client is in), or
/// a group this replica runs for another's round. Each says where the
/// client sits ([`seat`](Self::seat)); the four requests a client makes
/// are written once, here, for both.
pub trait StageHost {
    /// The group `participant` is in, and its client id there; refused
    /// when it is in none that runs here now.
    #[doc(hidden)]
    fn seat(&mut self, participant: &str) -> Result<(&mut Group, ClientId), EngineError>;

    /// The message `participant` should act on now.
    fn poll(&mut self, participant: &str) -> Result<Poll, EngineError> {
        let (group, id) = self.seat(participant)?;
        group.poll(id)
    }

    /// Whether `participant` may post a stage message now, and the largest
    /// body it may send: checked before the body is read, so a client that
    /// is not selected, not eligible for the stage or already answered is
    /// refused without the server reading (or holding) its message.
    fn admit(&mut self, participant: &str) -> Result<usize, EngineError> {
        let (group, id) = self.seat(participant)?;
        group.admit(id)
    }

    /// Accepts `participant`'s encoded stage message.
    fn receive(&mut self, participant: &str, bytes: &[u8]) -> Result<(), EngineError> {
        let (group, id) = self.seat(participant)?;
        group.receive(id, bytes)
    }

    /// A step of `participant`'s masked input arriving in pieces (see
    /// [`InputStep`]).
    fn input(&mut self, participant: &str, step: InputStep) -> Result<u64, EngineError> {
        let (group, id) = self.seat(participant)?;
        group.input(id, step)
    }
}

/// Where a group sits, for the jobs it hands out: its task, its round
/// (an async group's number) and its index in the round.
#[derive(Debug, Clone, Copy)]
pub(super) struct Place<'a> {
    pub(super) task: &'a str,
    pub(super) round: u64,
    pub(super) index: usize,
}

/// What a completed group contributes: the decoded sum of its survivors'
/// inputs (never one client's), their number, and the revealed shares that
/// did not match their owner's commitment as (owner, holder) participants.
pub(super) struct GroupSum {
    pub(super) mean: WeightedMean,
    pub(super) survivors: u32,
    pub(super) faulty_shares: Vec<(String, String)>,
    /// Participants whose norm proofs were refused (validated rounds).
    pub(super) refused: Vec<String>,
}

/// One secure-aggregation instance of the round.
pub struct Group {
    /// The round's public randomness for this group (its session id is
    /// `seeds.session`).
    pub(super) seeds: RoundSeeds,
    /// The digest of the model the group's clients trained from (a sync
    /// round), which its round configuration names.
    pub(super) model: Option<[u8; 16]>,
    /// The roster's identity keys, in roster order (active variant only).
    pub(super) identities: Vec<[u8; 32]>,
    pub(super) stage_started_at: i64,
    pub(super) deadline: i64,
    /// Participants in client-id order (id = position + 1).
    pub(super) roster: Vec<String>,
    /// Changed only by the group's own methods (see [`Group::state`]).
    state: GroupState,
    pub(super) stages: Vec<StageMetrics>,
    /// This group's quantizer (its transform seed is the group's).
    pub(super) quantizer: Quantizer,
    pub(super) bytes_up: u64,
    pub(super) bytes_down: u64,
    /// The URL of the replica the group was handed to, if it was: where
    /// its clients' stage messages go while it is remote, and what the
    /// round's metrics name after it settled (so it outlives the `Remote`
    /// state).
    pub(super) owner: Option<String>,
    /// Members that said they left ([`TaskEngine::leave`](super::TaskEngine::leave)):
    /// no stage waits for them.
    pub(super) left: BTreeSet<ClientId>,
    /// Masked inputs arriving in pieces, by sender.
    arriving: HashMap<ClientId, Arriving>,
    /// The number of the next upload to begin.
    next_upload: u64,
}

/// A step of a masked input that arrives in pieces, as its request body
/// does (see [`ServerRound::begin_input`]): the server holds one piece of
/// it at a time, never the whole body. `Begin` answers with the upload's
/// number, which every later step names: a client that sends its input
/// again while an earlier try is still arriving (a retry after a
/// connection that broke) replaces that try, whose late steps then find
/// nothing.
#[derive(Debug)]
pub enum InputStep {
    /// The first [`MASKED_INPUT_HEADER_LEN`] bytes.
    Begin(Vec<u8>),
    /// The next bytes of an upload.
    Piece(u64, Vec<u8>),
    /// The upload's body ended.
    Finish(u64),
    /// The upload's body broke off (or its request was dropped): take back
    /// out what it added.
    Abort(u64),
}

/// A masked input arriving in pieces, and the bytes it was handed so far
/// in an unlinked temporary file: what taking it back out of the sum reads
/// (the file goes with it, and holds nothing readable by name meanwhile).
struct Arriving {
    upload: u64,
    input: IncomingInput,
    spool: std::fs::File,
}

impl Arriving {
    /// Takes the input back out of `server`'s running sum. Where its bytes
    /// cannot be read back the sum is wrong: the stage then refuses to
    /// close and the group fails without unmasking anything.
    fn retract(self, server: &mut ServerRound) {
        let Arriving { input, spool, .. } = self;
        let client = input.from();
        let read = |offset: usize, buffer: &mut [u8]| spool.read_exact_at(buffer, offset as u64);
        if let Err(error) = server.retract_input(input, read) {
            tracing::error!(client = client.get(), %error, "a masked input that broke off could not be taken back out");
        }
    }
}

/// Client `id`'s arriving input, taken out of `arriving`, if it is upload
/// number `upload` (a replaced try's steps find nothing).
fn take_upload(arriving: &mut HashMap<ClientId, Arriving>, id: ClientId, upload: u64) -> Option<Arriving> {
    match arriving.entry(id) {
        Entry::Occupied(entry) if entry.get().upload == upload => Some(entry.remove()),
        _ => None,
    }
}

/// The refusal of a masked input's bytes that could not be kept for a
/// retraction.
fn spool_error(error: std::io::Error) -> EngineError {
    tracing::error!(%error, "a masked input's bytes could not be written to a temporary file");
    EngineError::Spool
}

impl Group {
    /// Opens the group of the `roster` (with its `identities` in the
    /// active variant) as round `number` with `seeds`, training from the
    /// model with digest `model` (`None`: an async group); `None` when the
    /// task's parameters make no valid round of its size.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        builder: &RoundBuilder<'_>,
        number: u64,
        roster: Vec<String>,
        identities: Vec<[u8; 32]>,
        model: Option<[u8; 16]>,
        seeds: RoundSeeds,
        deadline: i64,
        now: i64,
    ) -> Option<(Self, u8)> {
        let n = u32::try_from(roster.len()).ok()?;
        let BuiltRound { config, quantizer } =
            builder.build_with(number, n, identities.clone(), model, seeds).ok()?;
        let modulus_bits = config.modulus_bits;
        let server = ServerRound::new(config).ok()?;
        let group = Group {
            seeds,
            model,
            identities,
            stage_started_at: now,
            deadline,
            roster,
            state: GroupState::Collecting(server),
            stages: Vec::new(),
            quantizer,
            bytes_up: 0,
            bytes_down: 0,
            owner: None,
            left: BTreeSet::new(),
            arriving: HashMap::new(),
            next_upload: 1,
        };
        Some((group, modulus_bits))
    }

    /// The stage the group is in (`Finished` once done or failed).
    pub(super) fn stage(&self) -> Stage {
        match &self.state {
            GroupState::Collecting(server) => server.stage(),
            GroupState::Unmasking => Stage::Unmasking,
            GroupState::Done(_) | GroupState::Failed { .. } => Stage::Finished,
            GroupState::Remote(remote) => remote.stage,
        }
    }

    /// When the group's collecting stage closes at the latest (`None` when
    /// no stage of it is collecting here).
    pub(super) fn deadline(&self) -> Option<i64> {
        matches!(self.state, GroupState::Collecting(_)).then_some(self.deadline)
    }

    /// Whether the group is done or failed.
    pub(super) fn is_settled(&self) -> bool {
        matches!(self.state, GroupState::Done(_) | GroupState::Failed { .. })
    }

    /// Feeds `hasher` what a member waiting on the group can wait for: its
    /// stage, whether it settled, and whether its owner took it up.
    pub(super) fn mark(&self, hasher: &mut impl std::hash::Hasher) {
        use std::hash::Hash;
        self.stage().hash(hasher);
        self.is_settled().hash(hasher);
        if let GroupState::Remote(remote) = &self.state {
            remote.adopted.hash(hasher);
        }
    }

    /// The participant with client id `id` in this group.
    pub(super) fn name(&self, id: ClientId) -> Option<&String> {
        self.roster.get(id.get() as usize - 1)
    }

    /// Closes the collecting stage's record at `now`.
    pub(super) fn close_stage(&mut self, server: &ServerRound, now: i64) {
        self.stages.push(StageMetrics {
            stage: server.stage(),
            eligible: server.eligible().len(),
            received: server.received(),
            dropouts: server.eligible().len() - server.received(),
            duration_ms: now - self.stage_started_at,
        });
        self.stage_started_at = now;
    }

    /// The message client `id` should act on now.
    pub(super) fn poll(&mut self, id: ClientId) -> Result<Poll, EngineError> {
        let server = match &self.state {
            GroupState::Collecting(server) => server,
            GroupState::Unmasking | GroupState::Done(_) => return Ok(Poll::Wait),
            GroupState::Failed { .. } => return Ok(Poll::Dropped),
            GroupState::Remote(_) => return Err(self.elsewhere()),
        };
        if server.has_received(id) {
            return Ok(Poll::Wait);
        }
        let Some(message) = server.message_for(id) else {
            return Ok(Poll::Dropped);
        };
        let bytes = message.encode();
        self.bytes_down += bytes.len() as u64;
        Ok(Poll::Message(bytes))
    }

    /// The answer to a client of a group another replica runs.
    fn elsewhere(&self) -> EngineError {
        EngineError::Elsewhere(self.owner.clone().unwrap_or_default())
    }

    /// Whether client `id` may post a stage message now, and the largest
    /// body it may send.
    pub(super) fn admit(&self, id: ClientId) -> Result<usize, EngineError> {
        let server = match &self.state {
            GroupState::Collecting(server) => server,
            GroupState::Remote(_) => return Err(self.elsewhere()),
            _ => {
                return Err(
                    ProtocolError::OutOfPhase { expected: Stage::Finished, got: Stage::Unmasking }.into()
                );
            }
        };
        if !server.is_eligible(id) {
            return Err(ProtocolError::NotEligible { client: id, stage: server.stage() }.into());
        }
        if server.has_received(id) {
            return Err(ProtocolError::Duplicate(id).into());
        }
        Ok(server.max_message_len())
    }

    /// Accepts client `id`'s encoded stage message.
    pub(super) fn receive(&mut self, id: ClientId, bytes: &[u8]) -> Result<(), EngineError> {
        let server = match &mut self.state {
            GroupState::Collecting(server) => server,
            GroupState::Remote(_) => return Err(self.elsewhere()),
            _ => {
                let message = cohort_crypto::ClientMessage::decode(bytes).map_err(ProtocolError::from)?;
                return Err(
                    ProtocolError::OutOfPhase { expected: Stage::Finished, got: message.stage() }.into()
                );
            }
        };
        // A masked input is added into the running sum from the body's
        // bytes, never decoded into a vector of its own.
        server.receive_encoded(id, bytes)?;
        self.bytes_up += bytes.len() as u64;
        Ok(())
    }

    /// A step of client `id`'s masked input arriving in pieces (see
    /// [`InputStep`]); `Begin` answers with the upload's number. Any
    /// refusal takes back out what the input added, so the sum holds whole
    /// inputs only, and the client may send again while the stage is open.
    pub(super) fn input(&mut self, id: ClientId, step: InputStep) -> Result<u64, EngineError> {
        let server = match &mut self.state {
            GroupState::Collecting(server) => server,
            GroupState::Remote(_) => return Err(self.elsewhere()),
            // The stage closed: whatever had arrived was taken back out then.
            _ if matches!(step, InputStep::Abort(_)) => return Ok(0),
            _ => {
                return Err(ProtocolError::OutOfPhase {
                    expected: Stage::Finished,
                    got: Stage::MaskedInputCollection,
                }
                .into());
            }
        };
        let (upload, piece) = match step {
            InputStep::Begin(header) => {
                // A new try replaces one still arriving.
                if let Some(earlier) = self.arriving.remove(&id) {
                    earlier.retract(server);
                }
                let spool = tempfile::tempfile().map_err(spool_error)?;
                let input = server.begin_input(id, &header)?;
                let upload = self.next_upload;
                self.next_upload += 1;
                self.arriving.insert(id, Arriving { upload, input, spool });
                return Ok(upload);
            }
            InputStep::Piece(upload, bytes) => (upload, Some(bytes)),
            InputStep::Finish(upload) => (upload, None),
            InputStep::Abort(upload) => {
                if let Some(arriving) = take_upload(&mut self.arriving, id, upload) {
                    arriving.retract(server);
                }
                return Ok(upload);
            }
        };
        let Some(mut arriving) = take_upload(&mut self.arriving, id, upload) else {
            if server.stage() != Stage::MaskedInputCollection {
                return Err(ProtocolError::OutOfPhase {
                    expected: server.stage(),
                    got: Stage::MaskedInputCollection,
                }
                .into());
            }
            return Err(ProtocolError::InvalidMessage {
                client: id,
                reason: "this upload of the masked input was replaced by a newer one, or broke off",
            }
            .into());
        };
        let result = match piece {
            Some(bytes) => arriving
                .spool
                .write_all(&bytes)
                .map_err(spool_error)
                .and_then(|()| server.continue_input(&mut arriving.input, &bytes).map_err(Into::into)),
            None => server.finish_input(&mut arriving.input).map_err(Into::into),
        };
        match result {
            Ok(()) if arriving.input.is_finished() => {
                self.bytes_up += (MASKED_INPUT_HEADER_LEN + arriving.input.expected_bytes()) as u64;
            }
            Ok(()) => {
                self.arriving.insert(id, arriving);
            }
            Err(_) => arriving.retract(server),
        }
        result.map(|()| upload)
    }

    /// Eligible clients of the collecting stage that have not answered and
    /// have not left: the answers the stage may still get.
    pub(super) fn awaited(&self, server: &ServerRound) -> usize {
        server
            .eligible()
            .into_iter()
            .filter(|id| !server.has_received(*id) && !self.left.contains(id))
            .count()
    }

    /// Eligible clients of the collecting stage that said they left.
    pub(super) fn left_of(&self, server: &ServerRound) -> usize {
        if self.left.is_empty() {
            return 0;
        }
        server.eligible().iter().filter(|id| self.left.contains(id)).count()
    }

    /// " (N left)" for a failure's reason, or nothing when no one left.
    fn left_note(&self, server: &ServerRound) -> String {
        match self.left_of(server) {
            0 => String::new(),
            left => format!(" ({left} left)"),
        }
    }

    /// Closes the collecting stage when it is ready: every eligible client
    /// answered or left, its deadline passed, in the advertise-keys or the
    /// masked-input stage `wanted` answers arrived (so that over-selected
    /// stragglers hold up neither: a client trains before it advertises
    /// its keys, and one that has not advertised them by then is simply
    /// not in the round), or too few clients are left to reach the
    /// threshold (the group is given up at once instead of at the
    /// deadline). `None` when it is not ready.
    pub(super) fn advance(
        &mut self,
        place: Place<'_>,
        spec: &TaskSpec,
        wanted: usize,
        now: i64,
    ) -> Option<GroupStep> {
        let ready = match &self.state {
            GroupState::Collecting(s) => {
                // Only a member that left can cut a stage short: without
                // one, "no one else to wait for" is `is_complete`, and a
                // stage never opens below the threshold (see below), so
                // the stage's eligible list is not walked on every tick.
                let cut_short = !self.left.is_empty() && {
                    let awaited = self.awaited(s);
                    awaited == 0 || s.received() + awaited < s.config().threshold as usize
                };
                s.is_complete()
                    || cut_short
                    || now >= self.deadline
                    || (matches!(s.stage(), Stage::AdvertiseKeys | Stage::MaskedInputCollection)
                        && s.received() >= wanted)
            }
            _ => false,
        };
        if !ready {
            return None;
        }
        let GroupState::Collecting(mut server) = std::mem::replace(&mut self.state, GroupState::Unmasking)
        else {
            return None;
        };
        // Inputs still arriving at the close are taken back out: their
        // senders count as dropouts.
        for (_, arriving) in std::mem::take(&mut self.arriving) {
            arriving.retract(&mut server);
        }
        let awaited = self.awaited(&server);
        self.close_stage(&server, now);
        let stage = server.stage();
        if stage == Stage::Unmasking {
            if server.has_quorum() {
                return Some(GroupStep::Unmask(Box::new(PendingUnmask {
                    task_id: place.task.to_string(),
                    round: place.round,
                    group: place.index,
                    session: self.seeds.session,
                    server,
                })));
            }
            return Some(self.fail(&server, awaited, now));
        }
        if !server.has_quorum() {
            return Some(self.fail(&server, awaited, now));
        }
        let (answered, eligible) = (server.received(), server.eligible().len());
        let left = self.left_note(&server);
        let threshold = server.config().threshold as usize;
        match server.advance() {
            // Too few answered for anyone to go on: in the complete graph
            // of three, a client that never advertised its keys leaves each
            // other client one neighbour to share its mask key with, fewer
            // than t.
            Ok(Advanced::Next(next)) if next.eligible().len() < threshold => {
                let reason = format!(
                    "{stage}: {answered} of {eligible} clients answered{left}, which leaves {} with the {threshold} \
                     neighbours (the threshold) the next stage needs",
                    next.eligible().len()
                );
                Some(self.give_up(next.stage(), Some(reason)))
            }
            Ok(Advanced::Next(next)) => {
                self.deadline = now + deadline_for(spec, next.stage());
                let step = if next.stage() == Stage::MaskedInputCollection {
                    let participants =
                        next.eligible().iter().filter_map(|id| self.name(*id).cloned()).collect();
                    GroupStep::MaskedInputRequested(participants)
                } else {
                    GroupStep::Next(next.stage())
                };
                self.state = GroupState::Collecting(next);
                Some(step)
            }
            Ok(Advanced::Done(_)) => {
                Some(self.give_up(stage, Some(format!("{stage} closed without a next stage"))))
            }
            Err(error) => Some(self.give_up(stage, Some(format!("{stage} could not close: {error}")))),
        }
    }

    /// Gives the group up in `server`'s stage, which closed with fewer
    /// answers than the threshold, saying why: how many answered, how many
    /// left, and whether the deadline passed or no one else could answer.
    fn fail(&mut self, server: &ServerRound, awaited: usize, now: i64) -> GroupStep {
        let stage = server.stage();
        let eligible = server.eligible().len();
        let left = self.left_note(server);
        let threshold = server.config().threshold;
        let when = if awaited > 0 && now >= self.deadline {
            "by the deadline"
        } else {
            "and no one else can answer"
        };
        let reason = format!(
            "{stage}: {} of {eligible} clients answered {when}{left}; the threshold is {threshold}",
            server.received()
        );
        self.give_up(stage, Some(reason))
    }

    /// Gives the group up in `stage`.
    fn give_up(&mut self, stage: Stage, reason: Option<String>) -> GroupStep {
        self.state = GroupState::Failed { stage, reason };
        GroupStep::Failed(stage)
    }

    /// Where the group is. Only its own methods change it: the stages
    /// close in [`advance`](Self::advance), and the other transitions are
    /// [`unmasked`](Self::unmasked), [`hand_off`](Self::hand_off),
    /// [`remote_adopted`](Self::remote_adopted),
    /// [`settle_remote`](Self::settle_remote) and
    /// [`lose_remote`](Self::lose_remote).
    pub(super) fn state(&self) -> &GroupState {
        &self.state
    }

    /// Takes the group's unmasking `result`, while it is unmasking: done
    /// with its decoded sum, or given up in the unmasking stage (the error
    /// is handed back to be reported). `None` when it was not unmasking.
    pub(super) fn unmasked(
        &mut self,
        result: Result<Aggregate, ProtocolError>,
        dimension: usize,
    ) -> Option<Result<(), TaskError>> {
        if !matches!(self.state, GroupState::Unmasking) {
            return None;
        }
        Some(match result.map_err(TaskError::from).and_then(|aggregate| self.decode(aggregate, dimension)) {
            Ok(sum) => {
                self.state = GroupState::Done(sum);
                Ok(())
            }
            Err(error) => {
                self.give_up(Stage::Unmasking, Some(error.to_string()));
                Err(error)
            }
        })
    }

    /// What a validated group's unmasking `result` says of its
    /// contributors: their sum check passed, or failed (`None` for any
    /// other failure, which says nothing about who cheated).
    pub(super) fn sum_check(&self, result: &Result<Aggregate, ProtocolError>) -> Option<SumCheck> {
        let names = |ids: &[ClientId]| ids.iter().filter_map(|&id| self.name(id).cloned()).collect();
        match result {
            Ok(aggregate) => Some(SumCheck::Passed(names(&aggregate.contributors))),
            Err(ProtocolError::CommitmentMismatch { suspects }) => Some(SumCheck::Failed(names(suspects))),
            Err(_) => None,
        }
    }

    /// The disputed noise edges of a validated group's unmasked `result`,
    /// as (owner, verifier) participants: one end of each lied about the
    /// edge's noise (claim 79).
    pub(super) fn disputes(&self, result: &Result<Aggregate, ProtocolError>) -> Vec<(String, String)> {
        let Ok(aggregate) = result else { return Vec::new() };
        aggregate
            .disputed
            .iter()
            .filter_map(|&(owner, verifier)| Some((self.name(owner)?.clone(), self.name(verifier)?.clone())))
            .collect()
    }

    /// Hands the group to the replica at `owner`: it runs there from now
    /// on, and settles from the owner's report.
    pub(super) fn hand_off(&mut self, owner: &str) {
        self.owner = Some(owner.to_string());
        self.state = GroupState::Remote(RemoteGroup { adopted: false, stage: Stage::AdvertiseKeys });
    }

    /// The owner took the group up and reports its `stage`.
    pub(super) fn remote_adopted(&mut self, stage: Stage) {
        if let GroupState::Remote(remote) = &mut self.state {
            remote.adopted = true;
            remote.stage = stage;
        }
    }

    /// Settles a remote group from its owner's `report` (with the stored
    /// sum when it completed): done, or given up in the report's stage (a
    /// report that does not fit gives it up too). `None` when the group is
    /// not remote; the stage it was given up in, if it was.
    pub(super) fn settle_remote(
        &mut self,
        report: &GroupReport,
        mean: Option<Vec<f32>>,
        dimension: usize,
    ) -> Option<Option<Stage>> {
        if !matches!(self.state, GroupState::Remote(_)) {
            return None;
        }
        self.stages = report.stages.clone();
        self.bytes_up = report.bytes_up;
        self.bytes_down = report.bytes_down;
        let settled = match (report.failed_at, mean) {
            (None, Some(mean)) => report.sum(mean, dimension).map_err(|e| (e, Stage::Unmasking)),
            (Some(stage), _) => Err((TaskError::GroupReport("given up by its owner"), stage)),
            (None, None) => {
                Err((TaskError::GroupReport("a completed group without its sum"), Stage::Unmasking))
            }
        };
        Some(match settled {
            Ok(sum) => {
                self.state = GroupState::Done(sum);
                None
            }
            Err((error, stage)) => {
                tracing::debug!(%error, "remote group given up");
                self.give_up(stage, None);
                Some(stage)
            }
        })
    }

    /// Gives a remote group up (its owner's lease lapsed before it
    /// reported) in the stage it last reported, which is handed back;
    /// `None` when the group is not remote.
    pub(super) fn lose_remote(&mut self) -> Option<Stage> {
        let GroupState::Remote(remote) = &self.state else { return None };
        let stage = remote.stage;
        self.give_up(stage, None);
        Some(stage)
    }

    /// The group's sum from its unmasked aggregate: decoded with the
    /// group's quantizer, with the shares that failed their check named.
    pub(super) fn decode(&self, aggregate: Aggregate, dimension: usize) -> Result<GroupSum, TaskError> {
        let survivors = aggregate.contributors.len() as u32;
        let mean = self.quantizer.decode(&aggregate.sum, survivors, dimension)?;
        let name = |id: ClientId| self.name(id).cloned().unwrap_or_default();
        let faulty_shares =
            aggregate.faulty_shares.iter().map(|fault| (name(fault.owner), name(fault.holder))).collect();
        let refused = aggregate.refused.iter().map(|&id| name(id)).collect();
        Ok(GroupSum { mean, survivors, faulty_shares, refused })
    }

    fn metrics(&self) -> GroupMetrics {
        let (survivors, failed_at) = match &self.state {
            GroupState::Done(sum) => (sum.survivors, None),
            GroupState::Failed { stage, .. } => (0, Some(*stage)),
            _ => (0, None),
        };
        GroupMetrics { selected: self.roster.len(), survivors, failed_at, owner: self.owner.clone() }
    }
}

/// The round in progress.
pub(super) struct ActiveRound {
    pub(super) number: u64,
    pub(super) started_at: i64,
    /// Each selected participant's group and client id in it.
    pub(super) members: HashMap<String, (usize, ClientId)>,
    pub(super) groups: Vec<Group>,
    /// What every group shares (attempt, degree, threshold, ring), and
    /// the suspects and exclusions of its sum checks as they come.
    pub(super) metrics: RoundMetrics,
}

impl ActiveRound {
    /// Feeds `hasher` the round's number and attempt and each group's
    /// [`Group::mark`].
    pub(super) fn mark(&self, hasher: &mut impl std::hash::Hasher) {
        use std::hash::Hash;
        (self.number, self.metrics.attempt).hash(hasher);
        self.groups.iter().for_each(|group| group.mark(hasher));
    }

    /// Opens round `number` (its `attempt`) for the `selected` clients in
    /// `groups` of consecutive ones, each with fresh session and transform
    /// seeds, training from the model with digest `model` (`None`: an async
    /// group); `None` when the task's parameters make no valid round.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn open(
        number: u64,
        attempt: u32,
        selected: Vec<(String, Option<[u8; 32]>)>,
        groups: Groups,
        model: Option<[u8; 16]>,
        spec: &TaskSpec,
        security: &TaskSecurity,
        rng: &mut ChaCha20Rng,
        spread: Option<&SumSpread>,
        now: i64,
    ) -> Option<Self> {
        let builder = RoundBuilder::for_task(spec, security);
        let mut members = HashMap::with_capacity(selected.len());
        let mut opened = Vec::with_capacity(groups.count as usize);
        let mut modulus_bits = 0;
        let mut ring_scale: Option<f64> = None;
        for (index, chunk) in selected.chunks(groups.size as usize).enumerate() {
            let identities = match security.variant {
                Variant::Active => chunk.iter().filter_map(|(_, identity)| *identity).collect(),
                Variant::SemiHonest => Vec::new(),
            };
            let roster: Vec<String> = chunk.iter().map(|(id, _)| id.clone()).collect();
            for (i, participant) in roster.iter().enumerate() {
                members.insert(participant.clone(), (index, ClientId::new(i as u32 + 1)?));
            }
            let deadline = now + deadline_for(spec, Stage::AdvertiseKeys);
            let mut seeds = RoundSeeds::draw(rng);
            // Under DP the privacy plan fits its own ring.
            if spec.privacy.is_none() {
                seeds.scale = spec.quantization.scale_for(roster.len() as u32, spread);
            }
            if let Some(scale) = seeds.scale {
                ring_scale = Some(ring_scale.map_or(scale, |lowest: f64| lowest.min(scale)));
            }
            let (group, bits) =
                Group::open(&builder, number, roster, identities, model, seeds, deadline, now)?;
            modulus_bits = bits;
            opened.push(group);
        }
        Some(Self {
            number,
            started_at: now,
            members,
            groups: opened,
            metrics: RoundMetrics {
                modulus_bits,
                ring_scale,
                attempt,
                degree: security.degree,
                threshold: security.threshold,
                ..RoundMetrics::default()
            },
        })
    }

    /// Clients selected, over every group.
    pub(super) fn selected(&self) -> usize {
        self.members.len()
    }

    /// The round's stage: the earliest of its unsettled groups'
    /// (`Unmasking` once all are settled and the round is being stored).
    pub(super) fn stage(&self) -> Stage {
        self.groups.iter().filter(|g| !g.is_settled()).map(Group::stage).min().unwrap_or(Stage::Unmasking)
    }

    /// Every group's closed stages, added up per stage: clients summed,
    /// the longest duration.
    pub(super) fn stages(&self) -> Vec<StageMetrics> {
        let mut merged: BTreeMap<Stage, StageMetrics> = BTreeMap::new();
        for record in self.groups.iter().flat_map(|g| &g.stages) {
            merged
                .entry(record.stage)
                .and_modify(|m| {
                    m.eligible += record.eligible;
                    m.received += record.received;
                    m.dropouts += record.dropouts;
                    m.duration_ms = m.duration_ms.max(record.duration_ms);
                })
                .or_insert_with(|| record.clone());
        }
        merged.into_values().collect()
    }

    /// Each group's size, survivors and where it failed.
    pub(super) fn group_metrics(&self) -> Vec<GroupMetrics> {
        self.groups.iter().map(Group::metrics).collect()
    }

    /// Bytes received from and sent to clients, over every group.
    pub(super) fn bytes(&self) -> (u64, u64) {
        self.groups.iter().fold((0, 0), |(up, down), g| (up + g.bytes_up, down + g.bytes_down))
    }

    /// Why the round's groups were given up: the one group's reason, or
    /// each group's.
    pub(super) fn failures(&self) -> String {
        let reasons: Vec<(usize, &str)> = self
            .groups
            .iter()
            .enumerate()
            .filter_map(|(index, g)| match &g.state {
                GroupState::Failed { reason: Some(reason), .. } => Some((index, reason.as_str())),
                _ => None,
            })
            .collect();
        match reasons.as_slice() {
            [] => "every group was given up".to_string(),
            [(_, reason)] if self.groups.len() == 1 => (*reason).to_string(),
            _ => reasons
                .iter()
                .map(|(index, reason)| format!("group {}: {reason}", index + 1))
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    /// The record of this attempt, which ended at `now` in `stage`
    /// without a new model.
    pub(super) fn failed(
        &self,
        outcome: AttemptOutcome,
        stage: Stage,
        reason: String,
        now: i64,
    ) -> FailedAttempt {
        FailedAttempt {
            round: self.number,
            attempt: self.metrics.attempt,
            outcome,
            stage,
            reason,
            selected: self.selected(),
            started_at: self.started_at,
            ended_at: now,
            stages: self.stages(),
        }
    }
}

/// How long `stage` may collect messages.
pub(super) fn deadline_for(spec: &TaskSpec, stage: Stage) -> i64 {
    let d = spec.deadlines;
    let ms = match stage {
        Stage::AdvertiseKeys => d.advertise_keys_ms,
        Stage::ShareKeys => d.share_keys_ms,
        Stage::MaskedInputCollection => d.masked_input_ms,
        _ => d.unmasking_ms,
    };
    // Specs bound deadlines to a day; never let a stored value overflow.
    i64::try_from(ms).unwrap_or(i64::MAX / 4).min(crate::spec::MAX_DEADLINE_MS as i64)
}
