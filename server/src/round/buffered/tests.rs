//! An async task's schedule in the engine: training slots, buffers that
//! become secure-aggregation groups, overlapping groups applied as they
//! complete, staleness weights and refusals, groups given up.

use cohort_crypto::testing::ProtocolClient;
use cohort_crypto::{Stage, Variant};

use crate::round::{CheckIn, Completion, PendingUnmask, Persist, Poll, StageHost, TaskEngine, TickOutcome};
use crate::spec::tests::small_spec;
use crate::spec::{AsyncSpec, Cadence, TaskMode, TaskPlan, TaskSpec};
use crate::store::TaskStatus;

/// Buffers of three (t = 2) with up to `concurrency` clients training and
/// updates at most `max_staleness` versions stale.
fn async_spec(concurrency: u32, max_staleness: u32) -> TaskSpec {
    let mut spec = small_spec();
    spec.rounds = 10;
    spec.clients_per_round = 3;
    spec.secure_aggregation.threshold = Some(2);
    spec.mode = TaskMode::Async;
    spec.asynchronous =
        Some(AsyncSpec { concurrency, buffer_size: 3, max_staleness, staleness_exponent: 0.5 });
    spec
}

fn engine(spec: TaskSpec) -> TaskEngine {
    let initial = TaskEngine::initial_checkpoint("t", &spec, 0).unwrap();
    TaskEngine::new("t".into(), TaskPlan::new(spec).unwrap(), TaskStatus::Active, &initial, []).unwrap()
}

/// A client of an async task: trains (its update is fixed) from the
/// version it was told, then answers its group's stages with its update
/// scaled by the weight it was given.
struct AsyncClient {
    name: String,
    update: Vec<f32>,
    base: u64,
    protocol: ProtocolClient,
    weight: Option<f64>,
}

impl AsyncClient {
    fn new(i: usize) -> Self {
        let update = vec![0.05 * i as f32 - 0.2, 0.1, -0.3 + 0.02 * i as f32, 0.04];
        Self {
            name: format!("a{i}"),
            protocol: ProtocolClient::new(100 + i as u64, update.clone(), 10),
            update,
            base: 0,
            weight: None,
        }
    }

    /// Checks in without an update; returns the reply (and keeps the
    /// version it is told to train from).
    fn ask(&mut self, engine: &mut TaskEngine, now: i64) -> CheckIn {
        let reply = engine.check_in_trained(&self.name, None, None, now);
        if let CheckIn::Train { version } = reply {
            self.base = version;
        }
        reply
    }

    /// Checks in with the finished update; a selection sets the weight.
    fn ready(&mut self, engine: &mut TaskEngine, now: i64) -> CheckIn {
        let reply = engine.check_in_trained(&self.name, None, Some(self.base), now);
        if let CheckIn::Selected { staleness_weight, .. } = reply {
            let weight = staleness_weight.expect("an async group names the weight");
            self.weight = Some(weight);
            self.protocol.update = self.update.iter().map(|v| v * weight as f32).collect();
        }
        reply
    }

    /// Polls once and answers; returns whether it sent something.
    fn step(&mut self, engine: &mut TaskEngine, now: i64) -> bool {
        let CheckIn::Selected { client_id, .. } = self.ready(engine, now) else {
            return false;
        };
        let Ok(Poll::Message(bytes)) = engine.poll(&self.name) else { return false };
        let reply = self.protocol.respond(client_id, &bytes);
        engine.receive(&self.name, &reply).unwrap();
        true
    }
}

/// Ticks until the engine is idle; returns what it handed out.
fn drain(engine: &mut TaskEngine, now: i64) -> Vec<TickOutcome> {
    let mut outcomes = Vec::new();
    loop {
        match engine.tick(now) {
            TickOutcome::Idle => return outcomes,
            outcome => outcomes.push(outcome),
        }
    }
}

/// Runs group `number` with `members` answering (and `vanish` silent after
/// ShareKeys) until it is handed out for unmasking, or given up.
fn run_group(
    engine: &mut TaskEngine,
    clients: &mut [AsyncClient],
    members: &[usize],
    vanish: &[usize],
    number: u64,
    now: &mut i64,
) -> Option<PendingUnmask> {
    for stage in 0..8 {
        for &i in members {
            if !(stage >= 2 && vanish.contains(&i)) {
                clients[i].step(engine, *now);
            }
        }
        *now += 10;
        let mut outcomes = drain(engine, *now);
        if stage >= 2 && !vanish.is_empty() && outcomes.is_empty() {
            *now += 400_000;
            outcomes = drain(engine, *now);
        }
        for outcome in outcomes {
            match outcome {
                TickOutcome::Unmask(job) if job.round == number => return Some(*job),
                TickOutcome::Aborted { round, .. } if round == number => return None,
                _ => {}
            }
        }
    }
    panic!("group {number} does not progress");
}

/// Unmasks a group and takes the next model the engine hands out.
fn apply(engine: &mut TaskEngine, job: PendingUnmask, now: i64) -> Completion {
    let number = job.round;
    engine.unmasked(number, 0, job.session, job.run(), now).unwrap();
    let completion = drain(engine, now).into_iter().find_map(|outcome| match outcome {
        TickOutcome::Persist(Persist::Model(completion)) => Some(*completion),
        _ => None,
    });
    completion.unwrap_or_else(|| panic!("group {number} gave no next model"))
}

/// The mean of `members`' updates, each scaled by its weight (all
/// clients have ten examples).
fn weighted(clients: &[AsyncClient], members: &[usize]) -> Vec<f32> {
    let mut mean = vec![0f32; 4];
    for &i in members {
        let weight = clients[i].weight.unwrap() as f32;
        for (m, v) in mean.iter_mut().zip(&clients[i].update) {
            *m += v * weight / members.len() as f32;
        }
    }
    mean
}

#[track_caller]
fn assert_close(actual: &[f32], expected: &[f32]) {
    for (a, e) in actual.iter().zip(expected) {
        assert!((a - e).abs() < 2e-4, "{actual:?} vs {expected:?}");
    }
}

fn selected_round(reply: &CheckIn) -> Option<u64> {
    match reply {
        CheckIn::Selected { round, .. } => Some(*round),
        _ => None,
    }
}

#[test]
fn overlapping_groups_are_applied_as_they_complete_and_stale_updates_are_refused() {
    let mut engine = engine(async_spec(6, 1));
    let mut clients: Vec<AsyncClient> = (0..8).map(AsyncClient::new).collect();
    let mut now = 0;
    // Six slots: six clients train from version 0, the seventh waits.
    for client in &mut clients[..6] {
        assert_eq!(client.ask(&mut engine, now), CheckIn::Train { version: 0 });
    }
    assert_eq!(clients[6].ask(&mut engine, now), CheckIn::Wait { retry_after_ms: 1_000 });
    assert_eq!(engine.buffer(now).unwrap().training, 6);
    // The first two finished updates wait; the third fills the buffer.
    assert_eq!(clients[0].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[1].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    let first = selected_round(&clients[2].ready(&mut engine, now)).expect("the buffer is full");
    // A freed slot goes to the client that waited.
    assert_eq!(clients[6].ask(&mut engine, now), CheckIn::Train { version: 0 });
    // A second group forms while the first is in flight.
    for i in [3, 4] {
        assert_eq!(clients[i].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    }
    let second = selected_round(&clients[5].ready(&mut engine, now)).expect("a second buffer");
    assert!(second > first);
    assert!(
        matches!(drain(&mut engine, now)[..], [TickOutcome::Started(a), TickOutcome::Started(b)] if a == first && b == second)
    );
    let view = engine.buffer(now).unwrap();
    assert_eq!(view.groups.len(), 2);
    assert!(view.groups.iter().all(|g| g.clients == 3 && g.stage == Stage::AdvertiseKeys));

    // The second group completes first and is applied first: version 1.
    let job = run_group(&mut engine, &mut clients, &[3, 4, 5], &[], second, &mut now).unwrap();
    let completion = apply(&mut engine, job, now);
    assert_eq!(completion.round.round, 1);
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["buffer"]["group"], second);
    assert_eq!(metrics["buffer"]["staleness_histogram"], serde_json::json!([3]));
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_eq!(engine.completed_rounds(), 1);
    assert_close(engine.weights(), &weighted(&clients, &[3, 4, 5]));
    assert!(clients[3..6].iter().all(|c| c.weight == Some(1.0)));

    // The first group, formed at version 0, is applied on top: version 2.
    let after_second = engine.weights().to_vec();
    let job = run_group(&mut engine, &mut clients, &[0, 1, 2], &[], first, &mut now).unwrap();
    let completion = apply(&mut engine, job, now);
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_eq!(engine.completed_rounds(), 2);
    let step = weighted(&clients, &[0, 1, 2]);
    let expected: Vec<f32> = after_second.iter().zip(&step).map(|(w, s)| w + s).collect();
    assert_close(engine.weights(), &expected);

    // Client 6 trained from version 0: two versions behind, more than 1.
    assert_eq!(clients[6].ready(&mut engine, now), CheckIn::Stale { version: 2, max_staleness: 1 });
    // It re-bases: told to train from version 2.
    assert_eq!(clients[6].ask(&mut engine, now), CheckIn::Train { version: 2 });

    // A group of updates from versions 2, 2 and 1: the one a version
    // behind is weighted 1/√2 by its client.
    for i in [0, 1] {
        assert_eq!(clients[i].ask(&mut engine, now), CheckIn::Train { version: 2 });
    }
    clients[7].base = 1;
    clients[0].ready(&mut engine, now);
    clients[7].ready(&mut engine, now);
    let third = selected_round(&clients[1].ready(&mut engine, now)).unwrap();
    for i in [0, 7] {
        clients[i].ready(&mut engine, now);
    }
    assert_eq!(clients[7].weight, Some(f64::from(0.5f32.sqrt())));
    assert_eq!(clients[0].weight, Some(1.0));
    let before = engine.weights().to_vec();
    let job = run_group(&mut engine, &mut clients, &[0, 1, 7], &[], third, &mut now).unwrap();
    let completion = apply(&mut engine, job, now);
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["buffer"]["staleness_histogram"], serde_json::json!([2, 1]));
    engine.advance(Persist::Model(Box::new(completion)), true);
    let step = weighted(&clients, &[0, 1, 7]);
    let expected: Vec<f32> = before.iter().zip(&step).map(|(w, s)| w + s).collect();
    assert_close(engine.weights(), &expected);
    let view = engine.buffer(now).unwrap();
    assert_eq!((view.version, view.refused_stale, view.groups_failed), (3, 1, 0));
    assert_eq!(view.staleness_histogram, vec![8, 1]);
}

#[test]
fn a_group_that_cannot_complete_is_discarded_and_applies_nothing() {
    let mut engine = engine(async_spec(6, 2));
    let mut clients: Vec<AsyncClient> = (0..3).map(AsyncClient::new).collect();
    let mut now = 0;
    for client in &mut clients {
        client.ask(&mut engine, now);
    }
    clients[0].ready(&mut engine, now);
    clients[1].ready(&mut engine, now);
    let number = selected_round(&clients[2].ready(&mut engine, now)).unwrap();
    let initial = engine.weights().to_vec();
    // Two of three vanish after their key shares: one survivor, below t = 2.
    assert!(run_group(&mut engine, &mut clients, &[0, 1, 2], &[1, 2], number, &mut now).is_none());
    assert_eq!(engine.weights(), initial.as_slice());
    assert_eq!(engine.completed_rounds(), 0);
    let view = engine.buffer(now).unwrap();
    assert_eq!((view.groups.len(), view.groups_failed), (0, 1));
    // The survivor is no longer in a group: it checks in for new work.
    assert_eq!(clients[0].ask(&mut engine, now), CheckIn::Train { version: 0 });
}

#[test]
fn slots_go_to_others_when_a_trainer_falls_behind_or_takes_too_long() {
    let spec = async_spec(3, 1);
    let allowance = spec.deadlines.advertise_keys_ms as i64;
    let mut engine = engine(spec);
    let mut clients: Vec<AsyncClient> = (0..7).map(AsyncClient::new).collect();
    let mut now = 0;
    for client in &mut clients[..3] {
        assert_eq!(client.ask(&mut engine, now), CheckIn::Train { version: 0 });
    }
    assert_eq!(clients[3].ask(&mut engine, now), CheckIn::Wait { retry_after_ms: 1_000 });
    // A trainer that never reports frees its slot after the allowance.
    now += allowance + 1;
    assert_eq!(engine.buffer(now).unwrap().training, 0);
    for client in &mut clients[3..6] {
        assert_eq!(client.ask(&mut engine, now), CheckIn::Train { version: 0 });
    }
    // Waiting updates of clients that stopped checking in do not form groups.
    clients[3].ready(&mut engine, now);
    clients[4].ready(&mut engine, now);
    now += super::READY_TTL_MS + 1;
    assert_eq!(clients[5].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    drain(&mut engine, now);
    assert_eq!(engine.buffer(now).unwrap().waiting, 1);
    assert!(engine.buffer(now).unwrap().groups.is_empty());
}

/// Runs group `number` of `members` to its next model and applies it;
/// returns the round's metrics.
fn apply_group(
    engine: &mut TaskEngine,
    clients: &mut [AsyncClient],
    members: &[usize],
    number: u64,
    now: &mut i64,
) -> serde_json::Value {
    let job = run_group(engine, clients, members, &[], number, now).unwrap();
    let completion = apply(engine, job, *now);
    let metrics = serde_json::from_str(&completion.round.metrics).unwrap();
    engine.advance(Persist::Model(Box::new(completion)), true);
    metrics
}

/// With C = K, a client of typical speed sees about one version pass while
/// it trains: one that lags two gives its slot to another client, trains
/// on, and its update still counts (weighted) while it is within
/// `max_staleness`; later, it is refused.
#[test]
fn a_slow_client_gives_up_its_slot_after_the_slot_lag_and_still_counts_within_the_bound() {
    let spec = async_spec(3, 3);
    assert_eq!(spec.asynchronous.unwrap().slot_lag(), 1);
    let mut engine = engine(spec);
    let mut clients: Vec<AsyncClient> = (0..9).map(AsyncClient::new).collect();
    let mut now = 0;
    // The slow client 0 and two others train from version 0.
    for client in &mut clients[..3] {
        assert_eq!(client.ask(&mut engine, now), CheckIn::Train { version: 0 });
    }
    assert_eq!(clients[3].ask(&mut engine, now), CheckIn::Wait { retry_after_ms: 1_000 });
    // Version 1 from clients 1, 2 and 3 (who takes 1's slot).
    assert_eq!(clients[1].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[3].ask(&mut engine, now), CheckIn::Train { version: 0 });
    assert_eq!(clients[2].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[4].ask(&mut engine, now), CheckIn::Train { version: 0 });
    let number = selected_round(&clients[3].ready(&mut engine, now)).expect("a full buffer");
    apply_group(&mut engine, &mut clients, &[1, 2, 3], number, &mut now);
    // Clients 0 and 4 lag one version, within the slot lag: they hold two
    // of the three slots.
    assert_eq!((engine.buffer(now).unwrap().training, engine.buffer(now).unwrap().training_on), (2, 0));
    assert_eq!(clients[5].ask(&mut engine, now), CheckIn::Train { version: 1 });
    assert_eq!(clients[6].ask(&mut engine, now), CheckIn::Wait { retry_after_ms: 1_000 });
    // Version 2 from clients 4, 5 and 6 (who takes 4's slot).
    assert_eq!(clients[4].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[6].ask(&mut engine, now), CheckIn::Train { version: 1 });
    assert_eq!(clients[5].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    let number = selected_round(&clients[6].ready(&mut engine, now)).expect("a full buffer");
    apply_group(&mut engine, &mut clients, &[4, 5, 6], number, &mut now);
    assert_eq!(engine.completed_rounds(), 2);
    // Client 0 lags two versions, more than the slot lag: its slot is free
    // although it has not reported, and three others train.
    let view = engine.buffer(now).unwrap();
    assert_eq!((view.training, view.training_on, view.slot_lag), (0, 1, 1));
    for i in [1, 2, 3] {
        assert_eq!(clients[i].ask(&mut engine, now), CheckIn::Train { version: 2 });
    }
    assert_eq!(clients[7].ask(&mut engine, now), CheckIn::Wait { retry_after_ms: 1_000 });
    // Its update, two versions stale, is within max_staleness 3: it joins
    // a group, weighted 1/√3.
    assert_eq!(clients[0].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[1].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    let number = selected_round(&clients[2].ready(&mut engine, now)).expect("a full buffer");
    let before = engine.weights().to_vec();
    let metrics = apply_group(&mut engine, &mut clients, &[0, 1, 2], number, &mut now);
    assert_eq!(clients[0].weight, Some(f64::from((1.0f32 / 3.0).sqrt())));
    assert_eq!(metrics["buffer"]["staleness_histogram"], serde_json::json!([2, 0, 1]));
    let step = weighted(&clients, &[0, 1, 2]);
    let expected: Vec<f32> = before.iter().zip(&step).map(|(w, s)| w + s).collect();
    assert_close(engine.weights(), &expected);
    // Version 4 from client 3 (still in its slot) and 1 and 2 again.
    for i in [1, 2] {
        assert_eq!(clients[i].ask(&mut engine, now), CheckIn::Train { version: 3 });
    }
    assert_eq!(clients[1].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    assert_eq!(clients[2].ready(&mut engine, now), CheckIn::Wait { retry_after_ms: 500 });
    let number = selected_round(&clients[3].ready(&mut engine, now)).expect("a full buffer");
    apply_group(&mut engine, &mut clients, &[1, 2, 3], number, &mut now);
    // An update four versions stale, more than max_staleness, is refused.
    clients[8].base = 0;
    assert_eq!(clients[8].ready(&mut engine, now), CheckIn::Stale { version: 4, max_staleness: 3 });
    assert_eq!(engine.buffer(now).unwrap().refused_stale, 1);
}

#[test]
fn an_active_async_task_takes_only_clients_with_identity_keys_and_stops_when_paused() {
    let mut spec = async_spec(4, 1);
    spec.secure_aggregation.variant = Some(crate::spec::VariantChoice::Active);
    let mut engine = engine(spec);
    assert_eq!(engine.variant(), Variant::Active);
    // Its groups name no model: clients pin that at enrollment.
    assert!(!engine.security().model_bound);
    assert_eq!(engine.check_in_trained("keyless", None, None, 0), CheckIn::Wait { retry_after_ms: 2_000 });
    assert_eq!(engine.check_in_trained("keyed", Some([7; 32]), None, 0), CheckIn::Train { version: 0 });
    engine.set_status(TaskStatus::Paused);
    assert_eq!(
        engine.check_in_trained("keyed", Some([7; 32]), Some(0), 0),
        CheckIn::Wait { retry_after_ms: 2_000 }
    );
    engine.set_status(TaskStatus::Stopped);
    assert_eq!(engine.check_in_trained("keyed", Some([7; 32]), Some(0), 0), CheckIn::Finished);
}

#[test]
fn async_specs_are_checked_field_by_field() {
    let field = |spec: TaskSpec| match spec.validate() {
        Err(crate::spec::SpecError::Field { field, .. }) => field,
        other => panic!("accepted: {other:?}"),
    };
    let mut spec = async_spec(6, 1);
    spec.asynchronous.as_mut().unwrap().buffer_size = 8;
    spec.clients_per_round = 8;
    assert_eq!(field(spec), "async.buffer_size");
    let mut spec = async_spec(6, 1);
    spec.asynchronous.as_mut().unwrap().max_staleness = 0;
    assert_eq!(field(spec), "async.max_staleness");
    let mut spec = async_spec(6, 1);
    spec.clients_per_round = 4;
    assert_eq!(field(spec), "clients_per_round");
    let mut spec = async_spec(6, 1);
    spec.asynchronous = None;
    assert_eq!(field(spec), "async");
    let mut spec = small_spec();
    spec.asynchronous = async_spec(6, 1).asynchronous;
    assert_eq!(field(spec), "async");
    let mut spec = async_spec(6, 1);
    spec.over_selection = 0.5;
    assert_eq!(field(spec), "over_selection");
    let mut spec = async_spec(6, 1);
    spec.asynchronous.as_mut().unwrap().staleness_exponent = f64::NAN;
    assert_eq!(field(spec), "async.staleness_exponent");
    let json = serde_json::json!({
        "name": "a", "rounds": 5, "clients_per_round": 10, "mode": "async",
        "async": {"concurrency": 20, "buffer_size": 10, "max_staleness": 3},
        "model": {"architecture": "x", "layout": {"tensors": [{"name": "w", "shape": [4]}]}}
    });
    let spec: TaskSpec = serde_json::from_value(json).unwrap();
    spec.validate().unwrap();
    assert_eq!(spec.asynchronous.unwrap().staleness_exponent, 0.5);
    assert_eq!(spec.asynchronous.unwrap().weight(3), 0.5);
    // Without max_staleness, the default bound of 4.
    let json = serde_json::json!({"concurrency": 10, "buffer_size": 10});
    let schedule: AsyncSpec = serde_json::from_value(json).unwrap();
    assert_eq!((schedule.max_staleness, schedule.staleness_exponent), (4, 0.5));
}

/// A slot is held for ⌈C / K⌉ versions, never longer than the staleness
/// bound: the versions that pass while a client of typical speed trains.
#[test]
fn the_slot_lag_is_the_versions_a_typical_client_sees_pass() {
    let lag = |concurrency, buffer_size, max_staleness| {
        AsyncSpec { concurrency, buffer_size, max_staleness, staleness_exponent: 0.5 }.slot_lag()
    };
    assert_eq!(lag(10, 10, 4), 1);
    assert_eq!(lag(13, 10, 4), 2);
    assert_eq!(lag(30, 10, 4), 3);
    assert_eq!(lag(100, 10, 4), 4, "at most the bound");
    assert_eq!(lag(100, 10, 20), 10);
    let spec = AsyncSpec { concurrency: 10, buffer_size: 10, max_staleness: 4, staleness_exponent: 0.5 };
    assert!(spec.holds_slot(3, 4) && !spec.holds_slot(2, 4) && !spec.holds_slot(5, 4));
    assert!(spec.fresh(0, 4) && !spec.fresh(0, 5));
}

#[test]
fn a_plan_reads_mode_and_async_as_one_cadence() {
    let plan = TaskPlan::new(async_spec(6, 1)).unwrap();
    assert_eq!(plan.cadence(), Cadence::Async(async_spec(6, 1).asynchronous.unwrap()));
    assert_eq!(TaskPlan::new(small_spec()).unwrap().cadence(), Cadence::Sync);
    // The pairings a cadence cannot say make no plan.
    let mut unpaired = async_spec(6, 1);
    unpaired.asynchronous = None;
    assert!(TaskPlan::new(unpaired).is_err());
    let mut unpaired = small_spec();
    unpaired.asynchronous = async_spec(6, 1).asynchronous;
    assert!(TaskPlan::new(unpaired).is_err());
}

#[test]
fn group_numbers_grow_across_a_restart_and_within_one_millisecond() {
    let spec = async_spec(6, 1);
    let mut first = engine(spec.clone());
    let mut clients: Vec<AsyncClient> = (0..6).map(AsyncClient::new).collect();
    let now = 1_700_000_000_000;
    for client in &mut clients {
        client.ask(&mut first, now);
    }
    let numbers: Vec<u64> =
        clients.iter_mut().filter_map(|c| selected_round(&c.ready(&mut first, now))).collect();
    // Two groups in the same millisecond: the time, then one more.
    assert_eq!(numbers, [now as u64, now as u64 + 1]);
    // A restarted coordinator (a new engine from the stored model) numbers
    // its groups by the time, above every number it gave before.
    let mut second = engine(spec);
    let later = now + 5;
    for client in &mut clients[..3] {
        client.ask(&mut second, later);
    }
    let renumbered: Vec<u64> =
        clients[..3].iter_mut().filter_map(|c| selected_round(&c.ready(&mut second, later))).collect();
    assert_eq!(renumbered, [later as u64]);
}

/// An async group forms from the oldest ready updates, but seats at most
/// half of a pool of suspects (see `suspects`): a later member waits for
/// the next group. When the pools leave too few to fill a group, the
/// oldest go together all the same.
#[test]
fn an_async_group_seats_at_most_half_of_a_pool_and_never_waits_for_the_search() {
    let groups_of = |engine: &TaskEngine| -> Vec<Vec<String>> {
        engine
            .fedbuff()
            .unwrap()
            .groups
            .values()
            .map(|f| {
                let mut members: Vec<String> = f.round.members.keys().cloned().collect();
                members.sort();
                members
            })
            .collect()
    };
    let named = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let mut engine = engine(async_spec(6, 4));
    engine.suspects.failed(&named(&["a0", "a1", "a2", "a9"]));
    let mut clients: Vec<AsyncClient> = (0..6).map(AsyncClient::new).collect();
    for client in &mut clients {
        assert!(matches!(client.ask(&mut engine, 0), CheckIn::Train { version: 0 }));
    }
    // Ready in order a0, a1, a2, …: two of the pool of four go first, with
    // a3; a2 waits and goes with a4 and a5 (all within the seating wait).
    for client in &mut clients {
        client.ready(&mut engine, 1);
    }
    assert_eq!(groups_of(&engine), [named(&["a0", "a1", "a3"]), named(&["a2", "a4", "a5"])]);

    // Three ready clients, all of one pool of three: they wait for others,
    // then go together.
    let mut engine = self::engine(async_spec(3, 4));
    engine.suspects.failed(&named(&["a0", "a1", "a2"]));
    let mut clients: Vec<AsyncClient> = (0..3).map(AsyncClient::new).collect();
    for client in &mut clients {
        client.ask(&mut engine, 0);
    }
    for client in &mut clients {
        client.ready(&mut engine, 1);
    }
    assert!(groups_of(&engine).is_empty());
    for client in &mut clients {
        client.ready(&mut engine, 4_000);
    }
    assert!(groups_of(&engine).is_empty(), "not before the seating wait");
    clients[0].ready(&mut engine, 5_001);
    assert_eq!(groups_of(&engine), [named(&["a0", "a1", "a2"])]);
}
