//! Groups of a round run by a replica that does not lead the round.
//!
//! With several replicas on one PostgreSQL database, the leader of a
//! task's rounds selects a round's clients and splits them into groups
//! (see `active`); it runs some groups itself and hands each other one to
//! a replica, its owner, as a [`GroupAssignment`] row in the store. The
//! owner builds the same protocol instance from it (the task's settings,
//! the roster and the round's public seeds fix it: see
//! [`RoundBuilder::build_with`]), serves the group's clients, closes its
//! stages at their deadlines, unmasks it and stores a [`GroupReport`]: the
//! group's decoded sum, never one client's. The leader adds the reports of
//! the groups that completed into the round, as it does with its own.
//!
//! The owner holds each group through a lease in the store, renewed with
//! its task leases; a group whose lease lapses (its owner died or was cut
//! off from the database) is given up by the leader, and its clients
//! count as dropouts. Privacy holds per group exactly as in one process:
//! the owner's instance unmasks nothing below the group's threshold.

use std::collections::HashMap;

use cohort_crypto::metrics::{Metric, MetricSums};
use cohort_crypto::quantize::WeightedMean;
use cohort_crypto::{Aggregate, ClientId, ProtocolError, Stage};
use serde::{Deserialize, Serialize};

use super::active::{Group, GroupState, GroupStep, GroupSum, Place, StageHost, deadline_for};
use super::builder::{RoundBuilder, RoundSeeds};
use super::engine::SumCheck;
use super::records::{EngineError, StageMetrics, TaskError};
use crate::spec::{TaskPlan, TaskSpec};
pub use crate::store::GroupKey;

/// What an owner needs to run a group: with the task's settings, the same
/// protocol instance that the leader would have run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupAssignment {
    /// The group's participants in client-id order (id = position + 1).
    pub roster: Vec<String>,
    /// Their Ed25519 identity keys, in the same order (active variant only).
    #[serde(with = "hex_keys")]
    pub identities: Vec<[u8; 32]>,
    /// The group's public seeds (session id, transform seed, a fitted
    /// ring's scale).
    pub seeds: RoundSeeds,
    /// The digest of the model the round trains from (hex), which the
    /// group's round configuration names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// What an owner stores when its group settles: for a completed group its
/// decoded sum's weight, metric sums and survivors (the sum itself goes
/// beside it, see [`GroupReport::encode_mean`]), for a failed one the stage it
/// was given up in; for both the stage records and traffic, so that the
/// round's metrics add every group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupReport {
    /// Survivors whose inputs are in the sum (0 when failed).
    pub survivors: u32,
    /// Σ of their weights.
    pub total_weight: u64,
    /// In a fitted ring, the fraction of the sum's coordinates beyond half
    /// the ring ([`WeightedMean::overflow`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overflow: Option<f64>,
    /// Per metric: its name, the sum over the survivors that reported it
    /// and their number.
    pub metrics: Vec<(String, f64, u32)>,
    /// Revealed shares that did not match their owner's commitment, as
    /// (owner, holder) participants.
    pub faulty_shares: Vec<(String, String)>,
    /// Participants whose norm proofs were refused (validated rounds).
    #[serde(default)]
    pub refused: Vec<String>,
    /// The group's closed stages.
    pub stages: Vec<StageMetrics>,
    /// Bytes received from the group's clients.
    pub bytes_up: u64,
    /// Bytes sent to them.
    pub bytes_down: u64,
    /// The stage the group was given up in, if it was.
    pub failed_at: Option<Stage>,
    /// A validated group: its sum check, as the leader's suspects take it
    /// (`None`: not validated, or the group failed before it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sum_check: Option<ReportedCheck>,
    /// A private, validated group: its disputed noise edges, as (owner,
    /// verifier) participants, each a failed test of its two ends.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disputes: Vec<(String, String)>,
}

/// A validated group's sum check in an owner's report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReportedCheck {
    /// The sum opened these contributors' commitments.
    Passed(Vec<String>),
    /// It did not: one of these masked another vector.
    Failed(Vec<String>),
}

impl GroupReport {
    /// The report of a completed group and its weighted mean, as stored.
    fn completed(group: &Group, sum: GroupSum) -> (Self, Vec<f32>) {
        let metrics = Metric::ALL
            .iter()
            .filter_map(|m| sum.mean.metrics.sum(*m).map(|(total, n)| (m.name().to_string(), total, n)))
            .collect();
        let report = Self {
            survivors: sum.survivors,
            total_weight: sum.mean.total_weight,
            overflow: sum.mean.overflow,
            metrics,
            faulty_shares: sum.faulty_shares,
            refused: sum.refused,
            ..Self::of(group, None)
        };
        (report, sum.mean.mean)
    }

    /// The report of `group`'s stages and traffic, with nothing summed,
    /// given up at `failed_at` (`None` for a completed group's base).
    fn of(group: &Group, failed_at: Option<Stage>) -> Self {
        Self {
            stages: group.stages.clone(),
            bytes_up: group.bytes_up,
            bytes_down: group.bytes_down,
            failed_at,
            ..Self::unbuilt()
        }
    }

    /// The report of a group that could not be built from its assignment.
    pub fn unbuilt() -> Self {
        Self {
            survivors: 0,
            total_weight: 0,
            overflow: None,
            metrics: Vec::new(),
            faulty_shares: Vec::new(),
            refused: Vec::new(),
            stages: Vec::new(),
            bytes_up: 0,
            bytes_down: 0,
            failed_at: Some(Stage::AdvertiseKeys),
            sum_check: None,
            disputes: Vec::new(),
        }
    }

    /// The group's sum check, for the leader's suspects: the names the
    /// owner reported that are in the group's `roster`.
    pub(super) fn sum_check(&self, roster: &std::collections::HashSet<String>) -> Option<SumCheck> {
        let listed = |members: &[String]| members.iter().filter(|m| roster.contains(*m)).cloned().collect();
        self.sum_check.as_ref().map(|check| match check {
            ReportedCheck::Passed(members) => SumCheck::Passed(listed(members)),
            ReportedCheck::Failed(members) => SumCheck::Failed(listed(members)),
        })
    }

    /// The group's disputed edges, for the leader's suspects: those whose
    /// two ends are in the group's `roster`.
    pub(super) fn disputes(&self, roster: &std::collections::HashSet<String>) -> Vec<SumCheck> {
        self.disputes
            .iter()
            .filter(|(owner, verifier)| roster.contains(owner) && roster.contains(verifier))
            .map(SumCheck::dispute)
            .collect()
    }

    /// The group's sum again, from this report and its stored `mean` of
    /// `dimension` coordinates; an error when they do not fit together.
    pub(super) fn sum(&self, mean: Vec<f32>, dimension: usize) -> Result<GroupSum, TaskError> {
        if mean.len() != dimension || self.failed_at.is_some() {
            return Err(TaskError::GroupReport("a completed group's sum does not fit the model"));
        }
        let mut metrics = MetricSums::default();
        for (name, total, reporters) in &self.metrics {
            let metric = Metric::from_name(name).ok_or(TaskError::GroupReport("unknown metric"))?;
            metrics.insert(metric, *total, *reporters);
        }
        Ok(GroupSum {
            mean: WeightedMean { mean, total_weight: self.total_weight, metrics, overflow: self.overflow },
            survivors: self.survivors,
            faulty_shares: self.faulty_shares.clone(),
            refused: self.refused.clone(),
        })
    }

    /// The weighted mean as stored: little-endian `f32`s.
    pub fn encode_mean(mean: &[f32]) -> Vec<u8> {
        mean.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// The weighted mean from its stored bytes.
    pub fn decode_mean(bytes: &[u8]) -> Result<Vec<f32>, TaskError> {
        if bytes.len() % 4 != 0 {
            return Err(TaskError::GroupReport("a stored sum is not a whole number of f32s"));
        }
        Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
}

/// A group this replica runs for another replica's round.
pub struct OwnedGroup {
    key: GroupKey,
    spec: TaskSpec,
    group: Group,
    members: HashMap<String, ClientId>,
    /// When this replica took the group up (its lease renewals that began
    /// earlier may not list it yet).
    pub claimed_at: i64,
}

impl OwnedGroup {
    /// Feeds `hasher` the group's round and its protocol state's stage
    /// mark (`Group::mark`).
    pub fn mark(&self, hasher: &mut impl std::hash::Hasher) {
        std::hash::Hash::hash(&(self.key.round, self.key.attempt, self.key.group), hasher);
        self.group.mark(hasher);
    }

    /// Builds the group's protocol instance from its assignment and the
    /// task's plan.
    pub fn open(
        key: GroupKey,
        assignment: GroupAssignment,
        plan: TaskPlan,
        now: i64,
    ) -> Result<Self, TaskError> {
        let security = plan.security();
        let spec = plan.into_spec();
        let builder = RoundBuilder::for_task(&spec, &security);
        let deadline = now + deadline_for(&spec, Stage::AdvertiseKeys);
        let GroupAssignment { roster, identities, seeds, model } = assignment;
        let model = match model {
            None => None,
            Some(digest) => {
                let mut bytes = [0u8; 16];
                hex::decode_to_slice(&digest, &mut bytes).map_err(|_| {
                    TaskError::GroupReport("the assignment's model digest is not 16 bytes of hex")
                })?;
                Some(bytes)
            }
        };
        let (group, _) = Group::open(&builder, key.round, roster, identities, model, seeds, deadline, now)
            .ok_or(TaskError::GroupReport("the assignment makes no valid round"))?;
        let members = group
            .roster
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((p.clone(), ClientId::new(i as u32 + 1)?)))
            .collect();
        Ok(Self { key, spec, group, members, claimed_at: now })
    }

    /// The group's key.
    pub fn key(&self) -> &GroupKey {
        &self.key
    }

    /// The group's participants.
    pub fn roster(&self) -> &[String] {
        &self.group.roster
    }

    /// When the group's collecting stage closes at the latest (see
    /// [`TaskEngine::next_deadline`](super::TaskEngine::next_deadline)).
    pub fn next_deadline(&self) -> Option<i64> {
        self.group.deadline()
    }

    /// Closes the stage when it is ready (see `Group::advance`): what the
    /// owner acts on, as the task's engine would. A group given up
    /// ([`GroupStep::Failed`]) reports its [`failure`](Self::failure).
    pub fn tick(&mut self, now: i64) -> Option<GroupStep> {
        let wanted = self.spec.inputs_per_group() as usize;
        let place = Place { task: &self.key.task, round: self.key.round, index: self.key.group as usize };
        self.group.advance(place, &self.spec, wanted, now)
    }

    /// The report of the group given up: in the stage it failed in, or,
    /// if it has not failed (its masked-input request could not be
    /// recorded), in its current stage.
    pub fn failure(&self) -> GroupReport {
        let stage = match self.group.state() {
            GroupState::Failed { stage, .. } => *stage,
            _ => self.group.stage(),
        };
        GroupReport::of(&self.group, Some(stage))
    }

    /// The report of the group's unmasking `result`: its decoded sum, or a
    /// failure in the unmasking stage.
    pub fn unmasked(&self, result: Result<Aggregate, ProtocolError>) -> (GroupReport, Option<Vec<f32>>) {
        let dimension = self.spec.model.layout.len();
        let sum_check =
            self.spec.validation.and_then(|_| self.group.sum_check(&result)).map(|check| match check {
                SumCheck::Passed(members) => ReportedCheck::Passed(members),
                SumCheck::Failed(members) => ReportedCheck::Failed(members),
            });
        let disputes = match &self.spec.validation {
            Some(_) => self.group.disputes(&result),
            None => Vec::new(),
        };
        let (report, mean) = match result
            .map_err(TaskError::from)
            .and_then(|aggregate| self.group.decode(aggregate, dimension))
        {
            Ok(sum) => {
                let (report, mean) = GroupReport::completed(&self.group, sum);
                (report, Some(mean))
            }
            Err(error) => {
                tracing::warn!(task = %self.key.task, round = self.key.round, group = self.key.group, %error, "a group could not be unmasked");
                (GroupReport::of(&self.group, Some(Stage::Unmasking)), None)
            }
        };
        (GroupReport { sum_check, disputes, ..report }, mean)
    }
}

/// Identity keys as a list of hex strings.
mod hex_keys {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(keys: &[[u8; 32]], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(keys.iter().map(hex::encode))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<[u8; 32]>, D::Error> {
        Vec::<String>::deserialize(deserializer)?
            .iter()
            .map(|key| {
                let mut bytes = [0u8; 32];
                hex::decode_to_slice(key, &mut bytes).map_err(serde::de::Error::custom)?;
                Ok(bytes)
            })
            .collect()
    }
}

/// A client of a group run here for another replica's round.
impl StageHost for OwnedGroup {
    fn seat(&mut self, participant: &str) -> Result<(&mut Group, ClientId), EngineError> {
        let id = self.members.get(participant).copied().ok_or(EngineError::NotSelected)?;
        Ok((&mut self.group, id))
    }
}
