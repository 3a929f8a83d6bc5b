//! A round's groups divided between replicas: handed out by the round's
//! leader as rows in the store, claimed and run by their owners, settled
//! back into the round.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cohort_crypto::Stage;
use tokio::sync::mpsc;

use super::lease::{LEASE_TTL_MS, Routes};
use super::{GroupKey, Replica};
use crate::coordinator::actor::Actor;
use crate::coordinator::{Request, Traced, now_ms};
use crate::round::GroupStep;
use crate::round::TaskError;
use crate::round::owned::{GroupAssignment, GroupReport, OwnedGroup};
use crate::spec::TaskPlan;
use crate::store::{GroupRecord, GroupRowState, SqlStore, StoreError};

/// Groups are handed only to replicas that beat their heart this
/// recently (the leader reads the heartbeats once a second, each a second
/// apart, so a live replica's is up to about two seconds old, more on a
/// busy machine): one that died is still live for the task leases' fair
/// share for a while, but is not given groups once it missed two or three
/// beats, before a round whose group it lost (at [`LEASE_TTL_MS`]) ends.
pub const PEER_FRESH_MS: i64 = 3_500;

/// How often a replica looks for groups handed to it, for the reports of
/// the groups it handed out, and refreshes where groups' clients go.
pub const GROUP_TICK: Duration = Duration::from_millis(200);

/// What the group watcher tells the actor.
pub(crate) enum GroupEvent {
    /// Run this group, just claimed (with its task's spec, or why it could
    /// not be read).
    Own { record: Box<GroupRecord>, plan: Box<Result<TaskPlan, String>> },
    /// Groups of rounds led here changed state (settled ones with their
    /// stored sum, when they completed).
    Changed(Vec<(GroupRecord, Option<Vec<u8>>)>),
}

/// Looks for the groups other replicas hand to this one and for the
/// reports of the groups this one handed out, and refreshes where the
/// clients of groups run elsewhere go: every [`GROUP_TICK`], on the
/// request pool (PostgreSQL only).
pub(crate) struct GroupWatcher {
    pub(crate) store: SqlStore,
    pub(crate) replica: Arc<Replica>,
    pub(crate) routes: Arc<RwLock<Routes>>,
    /// The state and stage last told the actor, per group of a round led here.
    pub(crate) seen: HashMap<GroupKey, (GroupRowState, String)>,
    /// The rosters of the groups routed, parsed once.
    pub(crate) rosters: HashMap<GroupKey, Vec<String>>,
    /// The groups run elsewhere, and where, as last written to the routes:
    /// they are rebuilt only when this changes.
    pub(crate) routed: Vec<(GroupKey, String)>,
}

impl GroupWatcher {
    pub(crate) async fn run(mut self, tx: mpsc::Sender<Traced>) {
        let mut ticker = tokio::time::interval(GROUP_TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            match self.tick().await {
                Ok(events) => {
                    for event in events {
                        if tx.send(Request::Groups(event).into()).await.is_err() {
                            return;
                        }
                    }
                }
                Err(error) => tracing::debug!(%error, "could not read the round groups"),
            }
        }
    }

    pub(crate) async fn tick(&mut self) -> Result<Vec<GroupEvent>, StoreError> {
        let now = now_ms();
        let mut events = Vec::new();
        for record in self.store.claim_groups(&self.replica.id, now, now + LEASE_TTL_MS).await? {
            let plan = match self.store.task(&record.key.task).await {
                Ok(task) => task
                    .spec()
                    .map_err(|e| e.to_string())
                    .and_then(|spec| TaskPlan::new(spec).map_err(|e| e.to_string())),
                Err(error) => Err(error.to_string()),
            };
            events.push(GroupEvent::Own { record: Box::new(record), plan: Box::new(plan) });
        }
        let mut changed = Vec::new();
        let led = self.store.led_groups(&self.replica.id, now).await?;
        let keys: HashSet<GroupKey> = led.iter().map(|r| r.key.clone()).collect();
        self.seen.retain(|key, _| keys.contains(key));
        for record in led {
            let now_seen = (record.state, record.stage.clone());
            if self.seen.get(&record.key) == Some(&now_seen) {
                continue;
            }
            let mean = match record.state {
                GroupRowState::Done => Some(self.store.group_mean(&record.key).await?),
                _ => None,
            };
            self.seen.insert(record.key.clone(), now_seen);
            changed.push((record, mean));
        }
        if !changed.is_empty() {
            events.push(GroupEvent::Changed(changed));
        }
        let routed = self.store.group_routes(now).await?;
        let live: HashSet<&GroupKey> = routed.iter().map(|r| &r.key).collect();
        self.rosters.retain(|key, _| live.contains(key));
        let routed: Vec<_> = routed.into_iter().filter(|r| r.owner_id != self.replica.id).collect();
        if routed.len() == self.routed.len()
            && routed.iter().zip(&self.routed).all(|(now, then)| now.key == then.0 && now.owner_url == then.1)
        {
            return Ok(events);
        }
        let mut elsewhere = HashMap::new();
        let mut written = Vec::with_capacity(routed.len());
        for route in &routed {
            if !self.rosters.contains_key(&route.key) {
                // Read once per group: a group's roster never changes.
                let roster = match self.store.group_assignment(&route.key).await {
                    Ok(json) => {
                        serde_json::from_str::<GroupAssignment>(&json).map(|a| a.roster).unwrap_or_default()
                    }
                    // Gone since: no longer routed either.
                    Err(StoreError::NotFound(_)) => continue,
                    Err(error) => return Err(error),
                };
                self.rosters.insert(route.key.clone(), roster);
            }
            let roster = self.rosters.get(&route.key).map(Vec::as_slice).unwrap_or_default();
            elsewhere.extend(roster.iter().map(|p| (p.clone(), route.owner_url.clone())));
            written.push((route.key.clone(), route.owner_url.clone()));
        }
        self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner).group_members_elsewhere =
            elsewhere;
        self.routed = written;
        Ok(events)
    }
}

impl Actor {
    /// Whether rounds are divided between replicas: on PostgreSQL (on
    /// SQLite one process runs everything).
    pub(crate) fn divides(&self) -> bool {
        self.store.backend() == crate::store::Backend::Postgres
    }

    /// Stops running group `key` for another replica's round.
    pub(crate) fn disown(&mut self, key: &GroupKey, why: &str) {
        let Some(group) = self.owned.remove(key) else { return };
        tracing::info!(task = %key.task, round = key.round, group = key.group, why, "no longer running the group");
        let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        for participant in group.roster() {
            self.owned_members.remove(participant);
            routes.group_members_here.remove(participant);
        }
    }

    /// Starts running a group claimed for another replica's round.
    pub(crate) async fn own(&mut self, record: GroupRecord, plan: Result<TaskPlan, String>, now: i64) {
        let key = record.key.clone();
        let opened = plan
            .map_err(|error| {
                tracing::error!(task = %key.task, %error, "could not read the spec of a group's task");
                TaskError::GroupReport("the task's spec could not be read")
            })
            .and_then(|plan| {
                let assignment: GroupAssignment = serde_json::from_str(&record.assignment)?;
                OwnedGroup::open(key.clone(), assignment, plan, now)
            });
        match opened {
            Ok(group) => {
                let mut routes = self.routes.write().unwrap_or_else(std::sync::PoisonError::into_inner);
                for participant in group.roster() {
                    self.owned_members.insert(participant.clone(), key.clone());
                    routes.group_members_here.insert(participant.clone());
                }
                drop(routes);
                tracing::info!(task = %key.task, round = key.round, group = key.group, "running a group for the round's leader");
                self.owned.insert(key, group);
            }
            Err(error) => {
                tracing::error!(task = %key.task, round = key.round, group = key.group, %error, "could not run a group handed here; giving it up");
                let report = GroupReport::unbuilt();
                self.settle_owned(&key, &report, None).await;
            }
        }
    }

    /// Closes the stages of a group run here that are ready and acts on
    /// what that comes to.
    pub(crate) async fn tick_owned(&mut self, key: &GroupKey) {
        if !self.leases_hold() {
            return;
        }
        let now = now_ms();
        while let Some(step) = self.owned.get_mut(key).and_then(|group| group.tick(now)) {
            match step {
                GroupStep::Next(stage) => self.report_stage(key, stage).await,
                GroupStep::MaskedInputRequested(participants) => {
                    let round = key.round as i64;
                    match self.store.record_contributors(&key.task, round, &participants, now, None).await {
                        Ok(()) => self.report_stage(key, Stage::MaskedInputCollection).await,
                        Err(error) => {
                            tracing::error!(task = %key.task, round, %error, "could not record the group's contributors; the group is given up");
                            if let Some(report) = self.owned.get(key).map(OwnedGroup::failure) {
                                self.settle_owned(key, &report, None).await;
                            }
                        }
                    }
                }
                GroupStep::Unmask(job) => {
                    let key = key.clone();
                    self.unmask(*job, move |result| Request::OwnedUnmasked { key, result });
                }
                GroupStep::Failed(_) => {
                    if let Some(report) = self.owned.get(key).map(OwnedGroup::failure) {
                        self.settle_owned(key, &report, None).await;
                    }
                }
            }
        }
    }

    /// Tells the round's leader which stage a group run here is in.
    pub(crate) async fn report_stage(&mut self, key: &GroupKey, stage: Stage) {
        if let Err(error) = self.store.group_stage(key, &self.replica.id, &stage.to_string()).await {
            tracing::debug!(%error, "could not record a group's stage");
        }
    }

    /// Stores a settled group's report (and sum) for the round's leader and
    /// stops running it.
    pub(crate) async fn settle_owned(&mut self, key: &GroupKey, report: &GroupReport, mean: Option<&[f32]>) {
        let stored = match serde_json::to_string(report) {
            Ok(json) => {
                let bytes = mean.map(GroupReport::encode_mean);
                self.store.settle_group(key, &self.replica.id, now_ms(), &json, bytes.as_deref()).await
            }
            Err(_) => Err(StoreError::Corrupt("group report")),
        };
        match stored {
            Ok(true) => {
                tracing::info!(task = %key.task, round = key.round, group = key.group, survivors = report.survivors, "group settled")
            }
            Ok(false) => {
                tracing::warn!(task = %key.task, round = key.round, group = key.group, "the group was no longer this replica's to settle")
            }
            Err(error) => {
                tracing::error!(task = %key.task, round = key.round, group = key.group, %error, "could not store the group's report; its lease lapses and the leader gives it up")
            }
        }
        self.disown(key, "it settled");
    }

    /// Hands the groups of a round just started to the live replicas, in
    /// turn from this one's place (rotated by the round number so that
    /// every replica leads its share): the groups this replica does not
    /// run are stored for their owners to claim, then marked remote in
    /// the engine. When they cannot be stored, this replica runs them all.
    pub(crate) async fn divide(&mut self, id: &str, round: u64, now: i64) {
        let me = self.replica.id.clone();
        let peers: Vec<(String, String)> = {
            let routes = self.routes.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            let fresh =
                |(id, _, heartbeat): &&(String, String, i64)| *id == me || now - heartbeat <= PEER_FRESH_MS;
            routes.peers.iter().filter(fresh).map(|(id, url, _)| (id.clone(), url.clone())).collect()
        };
        let divides = self.divides();
        let Some(engine) = self.engines.get(id) else { return };
        let count = engine.group_count();
        if !divides || count < 2 || peers.len() < 2 {
            return;
        }
        let start = peers.iter().position(|(peer, _)| *peer == me).unwrap_or(0);
        let mut records = Vec::new();
        for group in 0..count {
            let (owner_id, owner_url) = &peers[(start + group + round as usize) % peers.len()];
            if *owner_id == me {
                continue;
            }
            let Some((key, assignment)) = engine.assignment(group) else { continue };
            let Ok(assignment) = serde_json::to_string(&assignment) else { continue };
            records.push(GroupRecord {
                key,
                leader_id: me.clone(),
                owner_id: owner_id.clone(),
                owner_url: owner_url.clone(),
                assignment,
                state: GroupRowState::Assigned,
                stage: Stage::AdvertiseKeys.to_string(),
                expires_at: now + LEASE_TTL_MS,
                report: None,
            });
        }
        if records.is_empty() {
            return;
        }
        match self.store.assign_groups(&records, self.fences.get(id)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => {
                self.drop_task(id, "another replica took its lease over", false);
                return;
            }
            Err(error) => {
                tracing::warn!(task = id, round, %error, "could not hand groups to other replicas; running them here");
                return;
            }
        }
        let Ok(engine) = self.engine(id) else { return };
        for record in &records {
            engine.hand_off(&record.key, &record.owner_url);
        }
        let members = engine.remote_members();
        self.routes
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .group_members_elsewhere
            .extend(members);
        tracing::info!(
            task = id,
            round,
            handed = records.len(),
            groups = count,
            "groups handed to other replicas"
        );
    }

    /// Acts on the watcher's news of the groups of rounds led here.
    pub(crate) async fn groups_changed(&mut self, changed: Vec<(GroupRecord, Option<Vec<u8>>)>) {
        let now = now_ms();
        let mut ticked = HashSet::new();
        for (record, mean) in changed {
            let key = record.key.clone();
            if !self.engines.contains_key(&key.task) {
                continue;
            }
            let stage = record.stage.parse().unwrap_or(Stage::AdvertiseKeys);
            // Once a group may have asked for masked inputs (it reached that
            // stage, or settled or was lost), who it asked is read back once.
            let asked = match record.state {
                GroupRowState::Assigned => false,
                GroupRowState::Running => stage >= Stage::MaskedInputCollection,
                GroupRowState::Done | GroupRowState::Failed | GroupRowState::Lost => true,
            };
            if asked && self.contributors_read.insert(key.clone()) {
                self.read_contributors(&key).await;
            }
            let Ok(engine) = self.engine(&key.task) else { continue };
            match record.state {
                GroupRowState::Assigned => {}
                GroupRowState::Running => engine.remote_adopted(&key, stage),
                GroupRowState::Done | GroupRowState::Failed => {
                    let report: Option<GroupReport> =
                        record.report.as_deref().and_then(|json| serde_json::from_str(json).ok());
                    let mean = mean.and_then(|bytes| GroupReport::decode_mean(&bytes).ok());
                    match report {
                        Some(report) => engine.remote_settled(&key, &report, mean, now),
                        None => engine.remote_lost(&key, now),
                    }
                }
                GroupRowState::Lost => {
                    tracing::warn!(task = %key.task, round = key.round, group = key.group, owner = %record.owner_url, "the replica running a group stopped renewing it; the group is given up");
                    engine.remote_lost(&key, now);
                }
            }
            ticked.insert(key.task);
        }
        for task in ticked {
            self.tick(&task).await;
        }
    }

    /// Reads back who a remote group asked for its masked input.
    pub(crate) async fn read_contributors(&mut self, key: &GroupKey) {
        match self.store.contributors(&key.task, key.round as i64).await {
            Ok(participants) => {
                if let Ok(engine) = self.engine(&key.task) {
                    engine.add_contributors(key.round, participants);
                }
            }
            Err(error) => tracing::warn!(task = %key.task, %error, "could not read a group's contributors"),
        }
    }

    /// Deletes a task's group rows once its round ended (PostgreSQL): the
    /// groups' sums do not outlive the round.
    pub(crate) async fn forget_groups(&mut self, id: &str) {
        if !self.divides() {
            return;
        }
        self.contributors_read.retain(|key| key.task != id);
        // Only the task's leader deletes its rows, under its lease: a
        // stale leader must not wipe its successor's round.
        let Some(fence) = self.fences.get(id).cloned() else { return };
        match self.store.delete_groups(id, Some(&fence)).await {
            Ok(()) => {}
            Err(StoreError::Fenced) => self.drop_task(id, "another replica took its lease over", false),
            Err(error) => {
                tracing::warn!(task = id, %error, "could not delete the round's group rows; the next round replaces them")
            }
        }
    }
}
