//! Buffered asynchronous aggregation (Nguyen et al., FedBuff, AISTATS
//! 2022) under secure aggregation: the engine's side of an async task.
//!
//! A client checks in and is told to train ([`CheckIn::Train`]) while
//! fewer than `concurrency` clients hold a training slot; it downloads the
//! current model version, trains, and checks in again with the version it
//! trained from. Its update then waits in the buffer; every `buffer_size`
//! waiting updates form one secure-aggregation group: a protocol instance
//! of its own, with a fresh number (above every earlier group's, also
//! across restarts, so that a client's replay guard holds) and the task's
//! security parameters, which the clients check against their policy as in
//! any round. Each member is told its staleness weight (1 + s)^−a and
//! scales its update by it before masking, so the unmasked sum is already
//! weighted. Groups overlap: the coordinator applies each group's sum as
//! the next model version as soon as it is unmasked (one at a time, each
//! persisted before the next), and a group that cannot complete is
//! discarded without applying anything.
//!
//! Staleness is bounded: an update more than `max_staleness` versions
//! behind is refused ([`CheckIn::Stale`]) and its client re-bases. A slow
//! client gives up its slot sooner: once its base lags more than ⌈C / K⌉
//! versions ([`AsyncSpec::slot_lag`], about the lag of a client of typical
//! speed), or once it has trained for longer than the advertise-keys
//! deadline, its slot goes to another client; it trains on, and its update
//! still counts if it arrives within `max_staleness`.

use std::collections::{BTreeMap, HashMap, HashSet};

use cohort_crypto::{Aggregate, ClientId, ProtocolError, Stage, Variant};
use serde::{Deserialize, Serialize};

use super::active::{ActiveRound, Group, GroupState, GroupStep, Place, deadline_for};
use super::engine::{Persist, Schedule, SumCheck, TaskEngine, TickOutcome};
use super::records::{AttemptOutcome, CheckIn, TaskError};
use crate::spec::{AsyncSpec, Groups};

/// A waiting update counts towards a group while its client checked in
/// within this long (it polls every `READY_POLL_MS`).
pub const READY_TTL_MS: i64 = 10_000;

/// How often a client with a waiting update checks in.
const READY_POLL_MS: u64 = 500;

/// An async task's schedule: who trains, who waits, the groups in flight.
pub(super) struct BufferState {
    pub(super) spec: AsyncSpec,
    /// Clients told to train: the version current then, and when.
    training: HashMap<String, (u64, i64)>,
    /// Finished updates waiting for a group, oldest first.
    ready: Vec<Waiting>,
    /// Groups in flight, by number.
    pub(super) groups: BTreeMap<u64, InFlight>,
    /// The number of the last group opened.
    last_number: u64,
    /// The group whose next model is being persisted, if any.
    applying: Option<u64>,
    /// How many applied updates were 0, 1, 2, … versions stale.
    histogram: Vec<u64>,
    /// Updates refused as too stale.
    refused_stale: u64,
    /// Groups given up.
    groups_failed: u64,
}

/// A finished update waiting for a group.
struct Waiting {
    participant: String,
    base: u64,
    identity: Option<[u8; 32]>,
    seen: i64,
    /// When its update became ready.
    since: i64,
}

/// How long the oldest ready update waits for a group that seats at most
/// half of each pool of suspects before it is seated with the oldest
/// others all the same (see `suspects`).
const SEATING_WAIT_MS: i64 = 5_000;

/// A group in flight: its protocol instance and what each member was told.
pub(super) struct InFlight {
    pub(super) round: ActiveRound,
    /// Each member's staleness (versions) when the group formed.
    staleness: HashMap<String, u64>,
}

/// An async task's schedule, for the admin API and the dashboard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct BufferView {
    /// The model version (updates applied).
    pub version: u64,
    /// Clients holding a training slot, of `concurrency`.
    pub training: usize,
    /// Clients that gave up their slot (their base lags more than
    /// `slot_lag` versions) and train on: their update still counts if it
    /// arrives within `max_staleness`.
    #[serde(default)]
    pub training_on: usize,
    /// The task's concurrency.
    pub concurrency: u32,
    /// Finished updates waiting for a group, of `buffer_size`.
    pub waiting: usize,
    /// Updates per group.
    pub buffer_size: u32,
    /// The staleness bound.
    pub max_staleness: u32,
    /// How many versions a client's base may lag while it holds its slot
    /// (⌈C / K⌉, at most the bound).
    #[serde(default)]
    pub slot_lag: u64,
    /// The groups in flight, oldest first.
    pub groups: Vec<GroupInFlight>,
    /// How many applied updates were 0, 1, 2, … versions stale.
    pub staleness_histogram: Vec<u64>,
    /// Updates refused as too stale.
    pub refused_stale: u64,
    /// Groups given up (too few clients, or unmasking failed).
    pub groups_failed: u64,
}

/// One group in flight.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GroupInFlight {
    /// The group's number (its protocol instance's round number).
    pub number: u64,
    /// Its stage.
    pub stage: Stage,
    /// Its clients.
    pub clients: usize,
    /// Answers to its current stage.
    pub received: usize,
    /// When it formed (Unix ms).
    pub started_at: i64,
}

impl BufferState {
    pub(super) fn new(spec: AsyncSpec) -> Self {
        Self {
            spec,
            training: HashMap::new(),
            ready: Vec::new(),
            groups: BTreeMap::new(),
            last_number: 0,
            applying: None,
            histogram: Vec::new(),
            refused_stale: 0,
            groups_failed: 0,
        }
    }

    /// Clients that hold a training slot at `now` under version `version`.
    fn slots_held(&self, version: u64, allowance: i64, now: i64) -> usize {
        self.training
            .values()
            .filter(|(base, since)| self.spec.holds_slot(*base, version) && now - since <= allowance)
            .count()
    }

    /// Clients past their slot lag whose update may still count.
    fn training_on(&self, version: u64, allowance: i64, now: i64) -> usize {
        self.training
            .values()
            .filter(|(base, since)| {
                !self.spec.holds_slot(*base, version)
                    && self.spec.fresh(*base, version)
                    && now - since <= allowance
            })
            .count()
    }

    /// The group `number`'s member `participant`, if it is in one.
    fn member(&self, participant: &str) -> Option<(u64, usize, ClientId)> {
        self.groups.iter().find_map(|(number, flight)| {
            flight.round.members.get(participant).map(|(group, id)| (*number, *group, *id))
        })
    }

    /// The group being applied was stored as the next model: it is done.
    /// Its number and members (who may still report metrics for it).
    pub(super) fn applied(&mut self) -> Option<(u64, HashSet<String>)> {
        let number = self.applying.take()?;
        let flight = self.groups.remove(&number)?;
        self.record(flight.staleness.into_values());
        Some((number, flight.round.members.into_keys().collect()))
    }

    /// The group being applied could not be stored: it is discarded.
    pub(super) fn abandon(&mut self) {
        if let Some(number) = self.applying.take() {
            self.groups.remove(&number);
            self.groups_failed += 1;
        }
    }

    /// Group `number`, whose masked-input request could not be recorded,
    /// is given up before anyone was asked.
    pub(super) fn withdraw(&mut self, number: u64) {
        if self.groups.remove(&number).is_some() {
            self.groups_failed += 1;
        }
    }

    /// The staleness of the groups' and the histogram's updates.
    fn record(&mut self, staleness: impl IntoIterator<Item = u64>) {
        for s in staleness {
            let s = s as usize;
            if self.histogram.len() <= s {
                self.histogram.resize(s + 1, 0);
            }
            self.histogram[s] += 1;
        }
    }
}

impl TaskEngine {
    /// An async task's check-in: `trained_on` is the version a finished
    /// update was trained from, if the client has one.
    pub(super) fn buffered_check_in(
        &mut self,
        participant: &str,
        identity: Option<[u8; 32]>,
        trained_on: Option<u64>,
        now: i64,
    ) -> CheckIn {
        let version = self.completed;
        let allowance = deadline_for(&self.spec, Stage::AdvertiseKeys);
        let plaintext = self.spec.client_metrics.plaintext;
        let active = self.variant() == Variant::Active;
        let Some(state) = self.fedbuff_mut() else { return CheckIn::Wait { retry_after_ms: 1_000 } };
        if let Some(selected) = selected_reply(state, participant, plaintext) {
            return selected;
        }
        match trained_on {
            Some(base) => {
                state.training.remove(participant);
                if !state.spec.fresh(base, version) {
                    state.ready.retain(|w| w.participant != participant);
                    state.refused_stale += 1;
                    return CheckIn::Stale { version, max_staleness: state.spec.max_staleness };
                }
                if active && identity.is_none() {
                    return CheckIn::Wait { retry_after_ms: 2_000 };
                }
                match state.ready.iter_mut().find(|w| w.participant == participant) {
                    Some(waiting) => {
                        waiting.base = base;
                        waiting.seen = now;
                        waiting.identity = identity;
                    }
                    None => state.ready.push(Waiting {
                        participant: participant.to_string(),
                        base,
                        identity,
                        seen: now,
                        since: now,
                    }),
                }
                self.form_groups(now);
                let state = self.fedbuff().unwrap_or_else(|| unreachable!("an async task"));
                selected_reply(state, participant, plaintext)
                    .unwrap_or(CheckIn::Wait { retry_after_ms: READY_POLL_MS })
            }
            None => {
                // A client without an update: whatever it held is given up.
                state.ready.retain(|w| w.participant != participant);
                state.training.remove(participant);
                if active && identity.is_none() {
                    return CheckIn::Wait { retry_after_ms: 2_000 };
                }
                if state.slots_held(version, allowance, now) < state.spec.concurrency as usize {
                    state.training.insert(participant.to_string(), (version, now));
                    CheckIn::Train { version }
                } else {
                    CheckIn::Wait { retry_after_ms: 1_000 }
                }
            }
        }
    }

    /// Opens a group for every `buffer_size` fresh waiting updates, oldest
    /// first; waiting updates whose clients stopped checking in, or that
    /// became too stale, are dropped first.
    fn form_groups(&mut self, now: i64) {
        let version = self.completed;
        let Self {
            schedule: Schedule::Async(state),
            spec: task_spec,
            security,
            rng,
            task_id,
            pending,
            suspects,
            spread,
            ..
        } = self
        else {
            return;
        };
        let spec = state.spec;
        state.ready.retain(|w| now - w.seen <= READY_TTL_MS && spec.fresh(w.base, version));
        let k = state.spec.buffer_size as usize;
        loop {
            if state.ready.len() < k {
                break;
            }
            // The oldest ready updates, but at most half of a pool of
            // suspects in one group (see `suspects`): a later member waits
            // for the next group. When the pools leave too few to fill a
            // group for `SEATING_WAIT_MS`, the oldest go together all the
            // same: training never waits long for the search.
            let mut seats: Vec<usize> = Vec::with_capacity(k);
            for (i, waiting) in state.ready.iter().enumerate() {
                if seats.len() == k {
                    break;
                }
                let seated = seats.iter().map(|&j| state.ready[j].participant.as_str());
                if suspects.may_seat(seated, &waiting.participant) {
                    seats.push(i);
                }
            }
            if seats.len() < k {
                if state.ready.iter().all(|w| now - w.since < SEATING_WAIT_MS) {
                    break;
                }
                seats = (0..k).collect();
            }
            let mut index = 0;
            let (members, kept): (Vec<Waiting>, Vec<Waiting>) =
                std::mem::take(&mut state.ready).into_iter().partition(|_| {
                    index += 1;
                    seats.contains(&(index - 1))
                });
            state.ready = kept;
            let number = (state.last_number + 1).max(u64::try_from(now).unwrap_or(0));
            let selected = members.iter().map(|w| (w.participant.clone(), w.identity)).collect();
            let groups = Groups { count: 1, size: state.spec.buffer_size };
            let Some(round) = ActiveRound::open(
                number,
                1,
                selected,
                groups, // Its members trained from different versions.
                None,
                task_spec,
                security,
                rng,
                spread.as_ref(),
                now,
            ) else {
                tracing::error!(task = %task_id, "an async group could not be opened");
                return;
            };
            state.last_number = number;
            let staleness = members.iter().map(|w| (w.participant.clone(), version - w.base)).collect();
            state.groups.insert(number, InFlight { round, staleness });
            pending.push_back(TickOutcome::Started(number));
        }
    }

    /// Advances every group in flight, discards those given up, and hands
    /// out the next model of the oldest completed group when none is being
    /// persisted.
    pub(super) fn buffered_tick(&mut self, now: i64) {
        if self.completed >= u64::from(self.spec.rounds) {
            self.status = crate::store::TaskStatus::Completed;
            if let Some(state) = self.fedbuff_mut() {
                *state = BufferState::new(state.spec);
            }
            return;
        }
        self.form_groups(now);
        let wanted = self.spec.inputs_per_group() as usize;
        let Self { schedule: Schedule::Async(state), spec, pending, task_id, .. } = self else { return };
        let mut failed = Vec::new();
        for (number, flight) in &mut state.groups {
            let Some(group) = flight.round.groups.first_mut() else { continue };
            let place = Place { task: task_id, round: *number, index: 0 };
            match group.advance(place, spec, wanted, now) {
                Some(GroupStep::Failed(stage)) => failed.push((*number, stage)),
                Some(step) => pending.extend(step.outcome(place, false)),
                None => {}
            }
        }
        for (number, stage) in failed {
            self.discard_group(number, stage, None, now);
        }
        self.apply_next(now);
    }

    /// Gives up group `number` in `stage` (because of `error`, or too few
    /// clients): nothing of it is applied.
    fn discard_group(&mut self, number: u64, stage: Stage, error: Option<&TaskError>, now: i64) {
        if let Some(state) = self.fedbuff_mut()
            && let Some(flight) = state.groups.remove(&number)
        {
            state.groups_failed += 1;
            if state.applying == Some(number) {
                state.applying = None;
            }
            let reason = error.map_or_else(|| flight.round.failures(), ToString::to_string);
            let attempt = Box::new(flight.round.failed(AttemptOutcome::Aborted, stage, reason, now));
            self.pending.push_back(TickOutcome::Aborted { round: number, stage, attempt });
        }
    }

    /// The next model from the oldest completed group, when no other is
    /// being persisted.
    fn apply_next(&mut self, now: i64) {
        let Some(state) = self.fedbuff() else { return };
        if state.applying.is_some() {
            return;
        }
        let done = state
            .groups
            .iter()
            .find(|(_, flight)| {
                matches!(flight.round.groups.first().map(Group::state), Some(GroupState::Done(_)))
            })
            .map(|(number, _)| *number);
        let Some(number) = done else { return };
        let version = self.completed + 1;
        let computed = {
            let flight = &state.groups[&number];
            let mut staleness: Vec<u64> = flight.staleness.values().copied().collect();
            staleness.sort_unstable();
            self.compute_from(&flight.round, version, Some((number, staleness)), now)
        };
        match computed {
            Ok(completion) => {
                if let Some(state) = self.fedbuff_mut() {
                    state.applying = Some(number);
                }
                self.pending.push_back(TickOutcome::Persist(Persist::Model(Box::new(completion))));
            }
            Err(error) => {
                let flight = self.fedbuff_mut().and_then(|state| {
                    state.groups_failed += 1;
                    state.groups.remove(&number)
                });
                if let Some(flight) = flight {
                    let attempt = Box::new(flight.round.failed(
                        AttemptOutcome::Abandoned,
                        Stage::Unmasking,
                        error.to_string(),
                        now,
                    ));
                    self.pending.push_back(TickOutcome::Abandoned { round: number, error, attempt });
                }
            }
        }
    }

    /// Group `number`'s unmasking result.
    pub(super) fn buffered_unmasked(
        &mut self,
        number: u64,
        session: [u8; 16],
        result: Result<Aggregate, ProtocolError>,
        now: i64,
    ) -> Result<(), TaskError> {
        let dimension = self.spec.model.layout.len();
        let validated = self.spec.validation.is_some();
        let group = self
            .fedbuff_mut()
            .and_then(|state| state.groups.get_mut(&number))
            .and_then(|flight| flight.round.groups.first_mut())
            .filter(|g| g.seeds.session == session)
            .ok_or(TaskError::NoSuchRound(number))?;
        let check = validated.then(|| group.sum_check(&result)).flatten();
        let disputes: Vec<SumCheck> = if validated {
            group.disputes(&result).iter().map(SumCheck::dispute).collect()
        } else {
            Vec::new()
        };
        let outcome = group.unmasked(result, dimension).ok_or(TaskError::NoSuchRound(number))?;
        for check in check.iter().chain(&disputes) {
            self.sum_checked(check, Some(number));
        }
        match outcome {
            Ok(()) => {
                self.apply_next(now);
                Ok(())
            }
            Err(error) => {
                self.discard_group(number, Stage::Unmasking, Some(&error), now);
                Err(error)
            }
        }
    }

    /// The group `participant` is in and its id there, for its stage
    /// messages.
    pub(super) fn buffered_member(
        &mut self,
        participant: &str,
    ) -> Option<(&mut super::active::Group, ClientId)> {
        let state = self.fedbuff_mut()?;
        let (number, group, id) = state.member(participant)?;
        let flight = state.groups.get_mut(&number)?;
        Some((flight.round.groups.get_mut(group)?, id))
    }

    /// An async task's part of [`TaskEngine::leave`]: the participant's
    /// training slot and waiting update are dropped, and no group it is
    /// in waits for it.
    pub(super) fn buffered_leave(&mut self, participant: &str) {
        let Some(state) = self.fedbuff_mut() else { return };
        state.training.remove(participant);
        state.ready.retain(|waiting| waiting.participant != participant);
        if let Some((group, id)) = self.buffered_member(participant) {
            group.left.insert(id);
        }
    }

    /// The schedule of an async task.
    pub fn buffer(&self, now: i64) -> Option<BufferView> {
        let state = self.fedbuff()?;
        let version = self.completed;
        let allowance = deadline_for(&self.spec, Stage::AdvertiseKeys);
        let groups = state
            .groups
            .iter()
            .map(|(number, flight)| {
                let group = flight.round.groups.first();
                let received = match group.map(Group::state) {
                    Some(GroupState::Collecting(server)) => server.received(),
                    _ => 0,
                };
                GroupInFlight {
                    number: *number,
                    stage: group.map_or(Stage::Finished, super::active::Group::stage),
                    clients: flight.round.selected(),
                    received,
                    started_at: flight.round.started_at,
                }
            })
            .collect();
        Some(BufferView {
            version,
            training: state.slots_held(version, allowance, now),
            training_on: state.training_on(version, allowance, now),
            concurrency: state.spec.concurrency,
            waiting: state.ready.iter().filter(|w| now - w.seen <= READY_TTL_MS).count(),
            buffer_size: state.spec.buffer_size,
            max_staleness: state.spec.max_staleness,
            slot_lag: state.spec.slot_lag(),
            groups,
            staleness_histogram: state.histogram.clone(),
            refused_stale: state.refused_stale,
            groups_failed: state.groups_failed,
        })
    }

    /// The oldest group in flight, as the round in progress.
    pub(super) fn oldest_group(&self) -> Option<&ActiveRound> {
        self.fedbuff()?.groups.values().next().map(|flight| &flight.round)
    }

    /// Whether `participant` is in an async group numbered `round`.
    pub(super) fn in_buffered_group(&self, participant: &str, round: u64) -> bool {
        self.fedbuff()
            .and_then(|state| state.groups.get(&round))
            .is_some_and(|flight| flight.round.members.contains_key(participant))
    }

    /// A paused or stopped async task gives up everything in flight.
    pub(super) fn buffered_reset(&mut self) {
        if let Some(state) = self.fedbuff_mut() {
            let mut fresh = BufferState::new(state.spec);
            fresh.last_number = state.last_number;
            fresh.histogram = std::mem::take(&mut state.histogram);
            fresh.refused_stale = state.refused_stale;
            fresh.groups_failed = state.groups_failed + state.groups.len() as u64;
            *state = fresh;
        }
    }
}

/// The reply to a member of a group in flight.
fn selected_reply(state: &BufferState, participant: &str, plaintext_metrics: bool) -> Option<CheckIn> {
    let (number, group, id) = state.member(participant)?;
    let flight = &state.groups[&number];
    let staleness = flight.staleness.get(participant).copied().unwrap_or(0);
    Some(CheckIn::Selected {
        round: number,
        client_id: id.get(),
        attempt: 1,
        session: flight.round.groups.get(group).map(|g| hex::encode(g.seeds.session)),
        plaintext_metrics,
        staleness_weight: Some(f64::from(state.spec.weight(staleness))),
    })
}

#[cfg(test)]
mod tests;
