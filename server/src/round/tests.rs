//! The engine's rules, driven by protocol test clients with no sockets
//! or timers.

use super::*;
use crate::checkpoint;
use crate::spec::VariantChoice;
use crate::spec::tests::small_spec;
use crate::spec::{TaskPlan, TaskSpec};
use crate::store::TaskStatus;
use cohort_crypto::ServerMessage;
use cohort_crypto::testing::ProtocolClient;
use cohort_crypto::{ClientMessage, ProtocolError, Stage, Variant};

/// A named participant that answers the engine with the protocol
/// client shared with the integration tests.
struct NamedClient {
    name: String,
    protocol: ProtocolClient,
    /// Lies about a noise edge: changes the digest of its first own edge's
    /// commitment (private, validated rounds).
    lies: bool,
    /// Leaves the round when the protocol refuses a message, as a real
    /// client does (instead of failing the test).
    leaves: bool,
}

impl NamedClient {
    fn new(i: usize, update: Vec<f32>, weight: u32) -> Self {
        let protocol = ProtocolClient::new(i as u64, update, weight);
        Self { name: format!("p{i}"), protocol, lies: false, leaves: false }
    }

    /// Polls once and answers; returns whether it sent something.
    fn step(&mut self, engine: &mut TaskEngine) -> bool {
        let Some(mut reply) = self.answer(engine) else { return false };
        if self.lies
            && let Ok(ClientMessage::ShareKeys { context, envelopes, proof, mut noise }) =
                ClientMessage::decode(&reply)
        {
            // The sender is the one end of every edge in its list.
            let me = noise[0].owner;
            let me =
                if noise.iter().all(|a| a.owner == me || a.verifier == me) { me } else { noise[0].verifier };
            let own = noise.iter().position(|a| a.owner == me).unwrap();
            noise[own].commitment[0] ^= 1;
            reply = ClientMessage::ShareKeys { context, envelopes, proof, noise }.encode();
        }
        engine.receive(&self.name, &reply).unwrap();
        true
    }

    /// Polls once and makes its answer, without sending it.
    fn answer(&mut self, engine: &mut TaskEngine) -> Option<Vec<u8>> {
        let identity = Some(self.protocol.identity.public_key());
        let CheckIn::Selected { client_id, .. } = engine.check_in(&self.name, identity, 0) else {
            return None;
        };
        let Ok(Poll::Message(bytes)) = engine.poll(&self.name) else { return None };
        if self.leaves {
            return self.protocol.try_respond(client_id, &bytes).ok();
        }
        Some(self.protocol.respond(client_id, &bytes))
    }
}

fn engine(spec: TaskSpec) -> TaskEngine {
    let initial = TaskEngine::initial_checkpoint("t", &spec, 0).unwrap();
    TaskEngine::new("t".into(), TaskPlan::new(spec).unwrap(), TaskStatus::Active, &initial, []).unwrap()
}

fn participants(n: usize) -> Vec<NamedClient> {
    (0..n).map(|i| NamedClient::new(i, vec![0.1 * i as f32, -0.2, 0.3, 0.05], 10 * (i as u32 + 1))).collect()
}

/// Runs stages until the engine hands out the unmasking job; clients in
/// `vanish_after_shares` stop answering after ShareKeys.
fn run_round(
    engine: &mut TaskEngine,
    clients: &mut [NamedClient],
    vanish: &[usize],
    now: &mut i64,
) -> Option<PendingUnmask> {
    let mut stage = 0;
    loop {
        for (i, client) in clients.iter_mut().enumerate() {
            if stage >= 2 && vanish.contains(&i) {
                continue;
            }
            client.step(engine);
        }
        *now += 10;
        let mut outcome = engine.tick(*now);
        if !matches!(outcome, TickOutcome::Unmask(_) | TickOutcome::Aborted { .. })
            && engine.current_round().map(|r| r.1) == Some(Stage::MaskedInputCollection)
            && stage >= 2
        {
            // Somebody is missing: let the deadline pass.
            *now += 400_000;
            outcome = engine.tick(*now);
        }
        match outcome {
            TickOutcome::Unmask(job) => return Some(*job),
            TickOutcome::Aborted { .. } => return None,
            _ => {}
        }
        stage += 1;
        assert!(stage < 10, "the round does not progress");
    }
}

/// Round `round` from the check-ins to its completion, every client
/// answering: the completion and its metrics.
fn whole_round(
    engine: &mut TaskEngine,
    clients: &mut [NamedClient],
    round: u64,
    now: &mut i64,
) -> (Completion, serde_json::Value) {
    for c in clients.iter() {
        engine.check_in(&c.name, None, *now);
    }
    assert!(matches!(tick_until_not_idle(engine, clients, now), TickOutcome::Started(r) if r == round));
    let job = run_round(engine, clients, &[], now).unwrap();
    let completion = complete(engine, round, job, *now);
    let metrics = serde_json::from_str(&completion.round.metrics).unwrap();
    (completion, metrics)
}

/// Unmasks the round's only group and takes the completion the engine
/// hands out.
fn complete(engine: &mut TaskEngine, round: u64, job: PendingUnmask, now: i64) -> Completion {
    assert_eq!((job.round, job.group), (round, 0));
    engine.unmasked(round, job.group, job.session, job.run(), now).unwrap();
    match engine.tick(now) {
        TickOutcome::Persist(Persist::Model(completion)) => *completion,
        other => panic!("no completion: {other:?}"),
    }
}

/// The weighted mean update of the `included` clients.
fn weighted_mean(clients: &[NamedClient], included: &[usize]) -> Vec<f32> {
    cohort_crypto::testing::weighted_mean(&included.iter().map(|&i| &clients[i].protocol).collect::<Vec<_>>())
}

/// An unmasking result is applied only to the attempt it was computed
/// for: one that names another session (an attempt that ended while its
/// job ran) finds nothing, and the group still waits for its own.
#[test]
fn an_unmasking_result_of_another_attempt_is_refused() {
    let mut engine = engine(small_spec());
    let mut clients = participants(6);
    let mut now = 0;
    for c in &clients {
        engine.check_in(&c.name, None, now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
    let mut other = job.session;
    other[0] ^= 1;
    let (group, session) = (job.group, job.session);
    let result = job.run();
    assert!(matches!(engine.unmasked(1, group, other, result.clone(), now), Err(TaskError::NoSuchRound(1))));
    assert!(matches!(engine.tick(now), TickOutcome::Idle), "nothing was settled");
    engine.unmasked(1, group, session, result, now).unwrap();
    assert!(matches!(engine.tick(now), TickOutcome::Persist(Persist::Model(_))));
}

#[test]
fn a_round_updates_the_model_with_the_weighted_mean() {
    let mut engine = engine(small_spec());
    let mut clients = participants(6);
    let mut now = 0;
    for c in &clients {
        assert_eq!(engine.check_in(&c.name, None, now), CheckIn::Wait { retry_after_ms: 1_000 });
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
    assert_eq!(job.round, 1);
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!(completion.round.survivors, 6);
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["stages"].as_array().unwrap().len(), 4);
    assert_eq!(metrics["total_examples"], 210);
    assert!(metrics["bytes_up_per_client"].as_f64().unwrap() > 0.0);
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_eq!(engine.completed_rounds(), 1);
    let expected = weighted_mean(&clients, &[0, 1, 2, 3, 4, 5]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
    }
    let checkpoint = checkpoint::decode(engine.model()).unwrap();
    assert_eq!(checkpoint.weights, engine.weights());
    assert_eq!(checkpoint.metadata["cohort.round"], "1");
}

/// An active task selects only participants with an identity key, binds
/// their keys in the roster, and its round (signed keys, the consistency
/// check) gives the same mean.
#[test]
fn an_active_round_binds_the_selected_identity_keys() {
    let mut spec = small_spec();
    spec.secure_aggregation.variant = Some(VariantChoice::Active);
    spec.secure_aggregation.threshold = Some(4);
    let mut engine = engine(spec);
    let mut clients = participants(6);
    let mut now = 0;
    // Without an identity key a participant of an active task is never selected.
    engine.check_in("keyless", None, now);
    assert_eq!(engine.available(now), 0);
    for c in &clients {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let Ok(Poll::Message(setup)) = engine.poll(&clients[0].name) else { panic!("no setup") };
    let Ok(ServerMessage::Setup(config)) = ServerMessage::decode(&setup) else { panic!("not a setup") };
    assert_eq!(config.variant, Variant::Active);
    let mut expected: Vec<[u8; 32]> = clients.iter().map(|c| c.protocol.identity.public_key()).collect();
    let mut roster = config.identities.clone();
    expected.sort_unstable();
    roster.sort_unstable();
    assert_eq!(roster, expected);
    // The round names the model it trains (THREAT_MODEL claim 56): the
    // digest of the checkpoint a client downloads.
    let served = cohort_client::checkpoint::decode(engine.model()).unwrap();
    assert_eq!(config.model, Some(served.digest()));
    assert!(engine.security().model_bound);
    assert_eq!(engine.check_in("keyless", None, now), CheckIn::Wait { retry_after_ms: 2_000 });
    let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!(completion.round.survivors, 6);
    let stages: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    // The consistency check is the active variant's fifth stage.
    assert_eq!(stages["stages"].as_array().unwrap().len(), 5);
    engine.advance(Persist::Model(Box::new(completion)), true);
    let expected = weighted_mean(&clients, &[0, 1, 2, 3, 4, 5]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
    }
}

#[test]
fn a_client_that_vanishes_is_recovered_after_the_deadline() {
    let mut engine = engine(small_spec());
    let mut clients = participants(6);
    let mut now = 0;
    for c in &clients {
        engine.check_in(&c.name, None, now);
    }
    engine.tick(now);
    let job = run_round(&mut engine, &mut clients, &[2], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!(completion.round.survivors, 5);
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["stages"][2]["dropouts"], 1);
    engine.advance(Persist::Model(Box::new(completion)), true);
    let expected = weighted_mean(&clients, &[0, 1, 3, 4, 5]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4);
    }
}

/// The demo's shape: three clients, threshold 2. One that vanishes after
/// sharing its keys is recovered, and the round completes with the other
/// two (each survivor's seed from its one surviving neighbour and itself).
#[test]
fn three_clients_with_threshold_two_complete_a_round_without_one() {
    let (mut engine, mut clients) = started_with_threshold_two(3);
    let mut now = 0;
    let job = run_round(&mut engine, &mut clients, &[2], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!((completion.round.selected, completion.round.survivors), (3, 2));
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_model_is_the_mean_of(&engine, &clients, &[0, 1]);
}

#[test]
fn a_round_below_threshold_is_aborted_and_retried_without_changing_the_model() {
    let mut spec = small_spec();
    spec.secure_aggregation.threshold = Some(5);
    let mut engine = engine(spec);
    let mut clients = participants(6);
    let mut now = 0;
    for c in &clients {
        engine.check_in(&c.name, None, now);
    }
    engine.tick(now);
    assert!(run_round(&mut engine, &mut clients, &[0, 1], &mut now).is_none());
    assert_eq!(engine.current_round(), None);
    assert_eq!(engine.completed_rounds(), 0);
    assert!(engine.weights().iter().all(|w| *w == 0.0));
    // Fresh clients check in; the round is attempted again. (The first
    // six were asked for their masked input, so they are not selected for
    // round 1 again: each would refuse it.)
    let mut fresh = participants(6);
    for c in fresh.iter_mut() {
        c.name = format!("q{}", &c.name[1..]);
        engine.check_in(&c.name, None, now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let job = run_round(&mut engine, &mut fresh, &[], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["attempt"], 2);
}

#[test]
fn strangers_garbage_and_inactive_tasks_are_refused() {
    let mut engine = engine(small_spec());
    let clients = participants(7);
    for c in &clients[..6] {
        engine.check_in(&c.name, None, 0);
    }
    assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
    assert_eq!(engine.check_in("p6", None, 0), CheckIn::Wait { retry_after_ms: 2_000 });
    assert_eq!(engine.poll("p6"), Err(EngineError::NotSelected));
    assert!(matches!(engine.receive("p0", b"junk"), Err(EngineError::Protocol(ProtocolError::Decode(_)))));
    engine.set_status(TaskStatus::Paused);
    assert_eq!(engine.poll("p0"), Err(EngineError::Inactive(TaskStatus::Paused)));
    assert_eq!(engine.current_round(), None);
    assert!(!matches!(engine.tick(1), TickOutcome::Started(_)));
    engine.set_status(TaskStatus::Stopped);
    assert_eq!(engine.check_in("p0", None, 2), CheckIn::Finished);
}

#[test]
fn the_task_completes_after_its_rounds() {
    let mut spec = small_spec();
    spec.rounds = 2;
    let mut engine = engine(spec);
    let mut now = 0;
    for round in 1..=2 {
        let mut clients = participants(6);
        for c in &clients {
            engine.check_in(&c.name, None, now);
        }
        assert!(matches!(engine.tick(now), TickOutcome::Started(r) if r == round));
        let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
        let completion = complete(&mut engine, round, job, now);
        engine.advance(Persist::Model(Box::new(completion)), true);
    }
    assert_eq!(engine.status(), TaskStatus::Completed);
    assert_eq!(engine.check_in("p0", None, now), CheckIn::Finished);
}

/// Rounds that wait for five of six selected clients, the first started
/// with all six checked in.
fn over_selected() -> (TaskEngine, Vec<NamedClient>) {
    let mut spec = small_spec();
    spec.clients_per_round = 5;
    spec.over_selection = 0.2;
    assert_eq!(spec.selected_per_round(), 6);
    let mut engine = engine(spec);
    let clients = participants(6);
    for c in &clients {
        engine.check_in(&c.name, None, 0);
    }
    assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
    (engine, clients)
}

#[test]
fn over_selection_closes_the_masked_input_stage_without_waiting_for_stragglers() {
    let (mut engine, mut clients) = over_selected();
    let mut now = 0;
    // Keys and shares from everybody.
    for _ in 0..2 {
        for c in clients.iter_mut() {
            c.step(&mut engine);
        }
        now += 10;
        engine.tick(now);
    }
    assert_eq!(engine.current_round(), Some((1, Stage::MaskedInputCollection)));
    // Five of six masked inputs: enough, long before the deadline.
    for c in clients.iter_mut().skip(1) {
        c.step(&mut engine);
    }
    now += 10;
    engine.tick(now);
    assert_eq!(engine.current_round(), Some((1, Stage::Unmasking)));
    for c in clients.iter_mut().skip(1) {
        c.step(&mut engine);
    }
    now += 10;
    let TickOutcome::Unmask(job) = engine.tick(now) else { panic!("no unmasking job") };
    let completion = complete(&mut engine, 1, *job, now);
    assert_eq!(completion.round.survivors, 5);
    assert_eq!(completion.round.selected, 6);
    engine.advance(Persist::Model(Box::new(completion)), true);
    let expected = weighted_mean(&clients, &[1, 2, 3, 4, 5]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4);
    }
}

/// A client trains before it advertises its keys: with over-selection the
/// advertise-keys stage closes once the target advertised, and the slowest
/// trainer is not in the round (it costs no recovery and holds no one up).
#[test]
fn over_selection_closes_the_advertise_keys_stage_without_waiting_for_slow_trainers() {
    let (mut engine, mut clients) = over_selected();
    let mut now = 0;
    // Four advertise: the stage waits for a fifth.
    for c in clients.iter_mut().skip(2) {
        assert!(c.step(&mut engine));
    }
    now += 10;
    engine.tick(now);
    assert_eq!(engine.current_round(), Some((1, Stage::AdvertiseKeys)));
    // The fifth closes it, long before the deadline; client 0 still trains.
    assert!(clients[1].step(&mut engine));
    now += 10;
    engine.tick(now);
    assert_eq!(engine.current_round(), Some((1, Stage::ShareKeys)));
    // The five in the round polled since their selection; the slow trainer
    // has not checked in since, and is not selectable while it trains.
    assert_eq!(engine.available(now), 5);
    assert!(clients[0].answer(&mut engine).is_none(), "the slow trainer is out of the round");
    let job = run_round(&mut engine, &mut clients[1..], &[], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!((completion.round.survivors, completion.round.selected), (5, 6));
    engine.advance(Persist::Model(Box::new(completion)), true);
    let expected = weighted_mean(&clients, &[1, 2, 3, 4, 5]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4);
    }
    // Client 0 checked in again (above, after its training): selectable.
    assert_eq!(engine.available(now), 6);
    assert!(matches!(engine.tick(now), TickOutcome::Started(2)));
}

#[test]
fn stage_messages_are_admitted_only_from_eligible_senders_within_the_round_size() {
    let mut engine = engine(small_spec());
    let mut clients = participants(7);
    for c in &clients[..6] {
        engine.check_in(&c.name, None, 0);
    }
    assert_eq!(engine.admit("p0"), Err(EngineError::NotSelected), "no round yet");
    engine.tick(0);
    assert_eq!(engine.admit("p6"), Err(EngineError::NotSelected));
    let (round, _) = engine.round().map(|r| (r.number, ())).unwrap();
    assert_eq!(round, 1);
    let keys = engine.admit("p0").unwrap();
    let config = match engine.round().unwrap().groups[0].state() {
        super::active::GroupState::Collecting(server) => server.config().clone(),
        _ => panic!("the round is not collecting"),
    };
    assert_eq!(keys, ClientMessage::max_encoded_len(&config, Stage::AdvertiseKeys));
    assert!(clients[0].step(&mut engine));
    assert!(matches!(engine.admit("p0"), Err(EngineError::Protocol(ProtocolError::Duplicate(_)))));
    // p5 never advertises keys: it is not eligible for the next stage.
    for c in clients[1..5].iter_mut() {
        c.step(&mut engine);
    }
    engine.tick(400_000);
    assert_eq!(engine.current_round(), Some((1, Stage::ShareKeys)));
    assert!(matches!(engine.admit("p5"), Err(EngineError::Protocol(ProtocolError::NotEligible { .. }))));
    // The share stage's limit also takes a late key advertisement.
    let shares = engine.admit("p0").unwrap();
    assert_eq!(shares, ClientMessage::max_encoded_len(&config, Stage::ShareKeys).max(keys));
    engine.set_status(TaskStatus::Paused);
    assert_eq!(engine.admit("p0"), Err(EngineError::Inactive(TaskStatus::Paused)));
}

#[test]
fn only_members_of_a_recent_round_may_report() {
    let mut spec = small_spec();
    spec.rounds = 4;
    // Plaintext reports: a semi-honest task that asks for them only.
    assert_eq!(engine(spec.clone()).may_report("p0", 1), Err(EngineError::PlaintextMetricsOff));
    spec.client_metrics.plaintext = true;
    spec.secure_aggregation.variant = Some(crate::spec::VariantChoice::SemiHonest);
    let mut engine = engine(spec);
    let mut now = 0;
    assert_eq!(engine.may_report("p0", 1), Err(EngineError::NotInRound(1)));
    for round in 1..=4u64 {
        // Members p0..p5 in odd rounds, q0..q5 in even ones.
        let prefix = if round % 2 == 1 { "p" } else { "q" };
        // The last round's clients are no longer available.
        now += CHECK_IN_TTL_MS + 1;
        let mut clients = participants(6);
        for c in clients.iter_mut() {
            c.name = format!("{prefix}{}", &c.name[1..]);
            engine.check_in(&c.name, None, now);
        }
        engine.tick(now);
        assert_eq!(engine.may_report(&format!("{prefix}0"), round), Ok(()), "the round in progress");
        let other = if prefix == "p" { "q0" } else { "p0" };
        assert_eq!(engine.may_report(other, round), Err(EngineError::NotInRound(round)));
        let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
        let completion = complete(&mut engine, round, job, now);
        engine.advance(Persist::Model(Box::new(completion)), true);
        assert_eq!(engine.may_report(&format!("{prefix}3"), round), Ok(()), "just finished");
        assert_eq!(
            engine.may_report(&format!("{prefix}3"), round + 1),
            Err(EngineError::NotInRound(round + 1))
        );
    }
    // The last two rounds are remembered; older ones are not.
    assert_eq!(engine.may_report("q1", 4), Ok(()));
    assert_eq!(engine.may_report("p1", 3), Ok(()));
    assert_eq!(engine.may_report("q1", 2), Err(EngineError::NotInRound(2)));
    assert_eq!(engine.may_report("p1", 1), Err(EngineError::NotInRound(1)));
}

#[test]
fn stale_check_ins_do_not_count() {
    let mut stale = engine(small_spec());
    for i in 0..6 {
        stale.check_in(&format!("p{i}"), None, 0);
    }
    assert!(!matches!(stale.tick(CHECK_IN_TTL_MS + 1), TickOutcome::Started(_)));
    // The control: the same check-ins at the edge of their lifetime start a
    // round, so only their age kept the first engine idle.
    let mut fresh = engine(small_spec());
    for i in 0..6 {
        fresh.check_in(&format!("p{i}"), None, 0);
    }
    assert!(matches!(fresh.tick(CHECK_IN_TTL_MS), TickOutcome::Started(_)));
}

/// The engine reports when its next tick has something to do that no
/// request brings about: its collecting stage's deadline, and nothing
/// before or after.
#[test]
fn the_next_deadline_is_when_the_collecting_stage_closes() {
    let mut running = engine(small_spec());
    assert_eq!(running.next_deadline(), None, "an idle engine starts rounds on check-ins");
    for i in 0..6 {
        running.check_in(&format!("p{i}"), None, 0);
    }
    assert!(matches!(running.tick(0), TickOutcome::Started(_)));
    let deadline = running.next_deadline().expect("a collecting stage has a deadline");
    assert!(deadline > 0);
    assert!(matches!(running.tick(deadline - 1), TickOutcome::Idle), "closed before its deadline");
    assert_eq!(running.next_deadline(), Some(deadline));
    // Nobody answered: the stage closes at its deadline, without a quorum.
    assert!(matches!(running.tick(deadline), TickOutcome::Aborted { .. }));
    assert_eq!(running.next_deadline(), None);
    let mut paused = engine(small_spec());
    for i in 0..6 {
        paused.check_in(&format!("p{i}"), None, 0);
    }
    assert!(matches!(paused.tick(0), TickOutcome::Started(_)));
    paused.set_status(TaskStatus::Paused);
    assert_eq!(paused.next_deadline(), None, "a paused task has no deadline");
}

/// Checks in `names` and ticks until the engine hands out something other
/// than `Idle`, stepping the round's members once per tick.
fn tick_until_not_idle(engine: &mut TaskEngine, clients: &mut [NamedClient], now: &mut i64) -> TickOutcome {
    for _ in 0..10 {
        for c in clients.iter_mut() {
            c.step(engine);
        }
        *now += 10;
        let outcome = engine.tick(*now);
        if !matches!(outcome, TickOutcome::Idle) {
            return outcome;
        }
    }
    panic!("the round does not progress");
}

#[test]
fn a_rerun_of_a_round_selects_none_that_an_earlier_attempt_asked_for_a_masked_input() {
    let mut engine = engine(small_spec());
    // Updates inside the quantizer's clipping range.
    let mut clients: Vec<NamedClient> = (0..12)
        .map(|i| NamedClient::new(i, vec![0.05 * i as f32, -0.2, 0.3, 0.05], 10 * (i as u32 + 1)))
        .collect();
    let mut now = 0;
    for c in &clients[..6] {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    // Keys, then shares: the masked-input stage opens and names who it asks.
    let (first, rest) = clients.split_at_mut(6);
    let TickOutcome::Persist(Persist::Contributors { round, participants }) =
        tick_until_not_idle(&mut engine, first, &mut now)
    else {
        panic!("the masked-input stage did not open")
    };
    assert_eq!(round, 1);
    let mut asked = participants.clone();
    asked.sort();
    assert_eq!(asked, ["p0", "p1", "p2", "p3", "p4", "p5"]);
    // Nobody answers: the round is aborted at its deadline.
    now += 400_000;
    assert!(matches!(engine.tick(now), TickOutcome::Aborted { round: 1, .. }));
    // Those six check in again, but none of them can be in a re-run of
    // round 1 (each would refuse it): no round starts.
    for c in first.iter() {
        assert_eq!(
            engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now),
            CheckIn::Wait { retry_after_ms: 1_000 }
        );
    }
    assert_eq!(engine.available(now), 0);
    assert!(matches!(engine.tick(now), TickOutcome::Idle));
    // Six others make the re-run, which completes with them alone.
    for c in rest.iter() {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
    }
    assert_eq!(engine.available(now), 6);
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let mut roster: Vec<String> = engine.round().unwrap().members.keys().cloned().collect();
    roster.sort();
    assert_eq!(roster, ["p10", "p11", "p6", "p7", "p8", "p9"]);
    let job = run_round(&mut engine, rest, &[], &mut now).unwrap();
    let completion = complete(&mut engine, 1, job, now);
    engine.advance(Persist::Model(Box::new(completion)), true);
    let expected = weighted_mean(&clients, &[6, 7, 8, 9, 10, 11]);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
    }
    // Round 2 is a new round number: the first six may take part again.
    for c in &clients {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
    }
    assert_eq!(engine.available(now), 12);
}

#[test]
fn a_restored_engine_excludes_the_recorded_contributors_of_the_next_round() {
    let spec = small_spec();
    let initial = TaskEngine::initial_checkpoint("t", &spec, 0).unwrap();
    let mut engine = TaskEngine::new(
        "t".into(),
        TaskPlan::new(spec).unwrap(),
        TaskStatus::Active,
        &initial,
        ["p0".to_string()],
    )
    .unwrap();
    let clients = participants(7);
    for c in &clients[..6] {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), 0);
    }
    assert_eq!(engine.available(0), 5);
    assert!(matches!(engine.tick(0), TickOutcome::Idle));
    // The task view says why it waits, and that p0 cannot help.
    assert_eq!(
        engine.stalled(0).as_deref(),
        Some(
            "waiting for clients: 5 available, round 1 selects 6; 1 more checked in but were asked for \
             their masked input by an earlier attempt of this round and may not take part in it again (a \
             second sum of their updates could be unmasked beside the first): new clients must enroll"
        )
    );
    engine.check_in("p6", Some(clients[6].protocol.identity.public_key()), 0);
    assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
    assert!(!engine.round().unwrap().members.contains_key("p0"));
    assert_eq!(engine.stalled(0), None, "a round runs");
}

#[test]
fn an_unrecorded_masked_input_request_is_withdrawn_and_its_participants_stay_selectable() {
    let mut engine = engine(small_spec());
    let mut clients = participants(6);
    let mut now = 0;
    for c in &clients {
        engine.check_in(&c.name, Some(c.protocol.identity.public_key()), now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let TickOutcome::Persist(Persist::Contributors { round, participants }) =
        tick_until_not_idle(&mut engine, &mut clients, &mut now)
    else {
        panic!("the masked-input stage did not open")
    };
    engine.advance(Persist::Contributors { round, participants }, false);
    assert_eq!(engine.current_round(), None);
    assert_eq!(engine.available(now), 6);
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
}

/// A spec whose rounds select 12 clients in 3 groups of 4 (complete graph,
/// t = 3 in each).
fn grouped_spec() -> TaskSpec {
    let mut spec = small_spec();
    spec.clients_per_round = 12;
    spec.secure_aggregation.group_size = Some(5);
    spec
}

/// Twelve participants whose updates lie within the clip.
fn twelve() -> Vec<NamedClient> {
    (0..12)
        .map(|i| NamedClient::new(i, vec![0.08 * i as f32 - 0.4, -0.2, 0.3, 0.05], 10 * (i as u32 + 1)))
        .collect()
}

/// An engine of [`grouped_spec`] whose round 1 started with [`twelve`]
/// clients checked in, and the time.
fn grouped_round() -> (TaskEngine, Vec<NamedClient>, i64) {
    let mut engine = engine(grouped_spec());
    let clients = twelve();
    for c in &clients {
        engine.check_in(&c.name, None, 0);
    }
    assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
    (engine, clients, 0)
}

/// The model (from zeros, FedAvg) moved by the weighted mean of `included`.
#[track_caller]
fn assert_model_is_the_mean_of(engine: &TaskEngine, clients: &[NamedClient], included: &[usize]) {
    let expected = weighted_mean(clients, included);
    for (w, e) in engine.weights().iter().zip(&expected) {
        assert!((w - e).abs() < 1e-4, "{:?} vs {expected:?}", engine.weights());
    }
}

/// What a round of several groups came to.
#[derive(Default)]
struct GroupedRun {
    jobs: Vec<PendingUnmask>,
    given_up: Vec<(usize, Stage)>,
    aborted: Option<Stage>,
}

/// Runs every group of the round in progress until each is ready to
/// unmask or given up; the clients in `vanish` stop answering after
/// ShareKeys.
fn run_groups(
    engine: &mut TaskEngine,
    clients: &mut [NamedClient],
    vanish: &[usize],
    now: &mut i64,
) -> GroupedRun {
    // Groups run by other replicas settle from their reports.
    let groups = engine
        .round()
        .unwrap()
        .groups
        .iter()
        .filter(|g| !matches!(g.state(), active::GroupState::Remote(_)))
        .count();
    let mut run = GroupedRun::default();
    for step in 0..10 {
        for (i, client) in clients.iter_mut().enumerate() {
            if !(step >= 2 && vanish.contains(&i)) {
                client.step(engine);
            }
        }
        *now += 10;
        let mut drain = |engine: &mut TaskEngine, now: i64| loop {
            match engine.tick(now) {
                TickOutcome::Idle => break,
                TickOutcome::Unmask(job) => run.jobs.push(*job),
                TickOutcome::GroupAborted { group, stage, .. } => run.given_up.push((group, stage)),
                TickOutcome::Aborted { stage, .. } => run.aborted = Some(stage),
                TickOutcome::Persist(Persist::Contributors { .. }) => {}
                other => panic!("unexpected {other:?}"),
            }
        };
        drain(engine, *now);
        if step >= 3 {
            // Somebody is missing: let the deadlines pass.
            *now += 400_000;
            drain(engine, *now);
        }
        if run.aborted.is_some() || run.jobs.len() + run.given_up.len() == groups {
            return run;
        }
    }
    panic!("the groups do not progress");
}

/// The clients of group `group` of the round in progress, by index.
fn group_members(engine: &TaskEngine, clients: &[NamedClient], group: usize) -> Vec<usize> {
    let members = &engine.round().unwrap().members;
    (0..clients.len()).filter(|&i| members.get(&clients[i].name).is_some_and(|(g, _)| *g == group)).collect()
}

/// A round of 12 in groups of at most 5 runs three protocol instances of
/// four, each with its own session and client ids 1 to 4, and applies
/// the sum of all three: the same mean as one group of twelve.
#[test]
fn a_round_of_several_groups_applies_the_sum_of_their_sums() {
    let spec = grouped_spec();
    assert_eq!((spec.groups().count, spec.groups().size), (3, 4));
    let (mut engine, mut clients, mut now) = grouped_round();
    let mut sessions = std::collections::HashSet::new();
    for group in 0..3 {
        let members = group_members(&engine, &clients, group);
        assert_eq!(members.len(), 4, "group {group}");
        let mut ids = Vec::new();
        for &i in &members {
            let CheckIn::Selected { client_id, session, .. } = engine.check_in(&clients[i].name, None, now)
            else {
                panic!("not selected")
            };
            ids.push(client_id);
            sessions.insert(session.unwrap());
        }
        ids.sort_unstable();
        assert_eq!(ids, [1, 2, 3, 4]);
    }
    assert_eq!(sessions.len(), 3, "one session per group");
    let progress = engine.progress().unwrap();
    assert_eq!((progress.groups, progress.selected, progress.eligible), (3, 12, 12));
    let run = run_groups(&mut engine, &mut clients, &[], &mut now);
    assert!(run.given_up.is_empty() && run.aborted.is_none());
    let mut groups: Vec<usize> = run.jobs.iter().map(|j| j.group).collect();
    groups.sort_unstable();
    assert_eq!(groups, [0, 1, 2]);
    for job in run.jobs {
        // Nothing is handed out before the last group is in.
        assert!(matches!(engine.tick(now), TickOutcome::Idle));
        engine.unmasked(1, job.group, job.session, job.run(), now).unwrap();
    }
    let TickOutcome::Persist(Persist::Model(completion)) = engine.tick(now) else { panic!("no completion") };
    assert!(matches!(engine.tick(now), TickOutcome::Idle), "one completion per round");
    assert_eq!((completion.round.selected, completion.round.survivors), (12, 12));
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    let groups = metrics["groups"].as_array().unwrap();
    assert_eq!(groups.len(), 3);
    assert!(groups.iter().all(|g| g["selected"] == 4 && g["survivors"] == 4 && g.get("failed_at").is_none()));
    // Stages add up over the groups.
    assert_eq!(metrics["stages"][0]["eligible"], 12);
    assert_eq!(metrics["total_examples"], (1..=12).map(|k| 10 * k).sum::<u64>());
    engine.advance(Persist::Model(completion), true);
    assert_model_is_the_mean_of(&engine, &clients, &(0..12).collect::<Vec<_>>());
}

/// A group that falls below its threshold is given up: its clients are
/// told they dropped, nothing of it is unmasked, and the round completes
/// from the other groups alone.
#[test]
fn a_group_below_its_threshold_is_given_up_and_the_others_complete_the_round() {
    let (mut engine, mut clients, mut now) = grouped_round();
    let failing = group_members(&engine, &clients, 1);
    // Two of its four vanish after sharing keys: two inputs, below t = 3.
    let run = run_groups(&mut engine, &mut clients, &failing[..2], &mut now);
    assert_eq!(run.given_up, [(1, Stage::MaskedInputCollection)]);
    assert_eq!(run.jobs.len(), 2);
    assert_eq!(engine.poll(&clients[failing[2]].name), Ok(Poll::Dropped));
    for job in run.jobs {
        engine.unmasked(1, job.group, job.session, job.run(), now).unwrap();
    }
    let TickOutcome::Persist(Persist::Model(completion)) = engine.tick(now) else { panic!("no completion") };
    assert_eq!((completion.round.selected, completion.round.survivors), (12, 8));
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["groups"][1]["failed_at"], "masked-input-collection");
    assert_eq!(metrics["groups"][1]["survivors"], 0);
    engine.advance(Persist::Model(completion), true);
    let included: Vec<usize> = (0..12).filter(|i| !failing.contains(i)).collect();
    assert_model_is_the_mean_of(&engine, &clients, &included);
}

/// A round whose every group fails is aborted, and the model stays.
#[test]
fn a_round_whose_groups_all_fail_is_aborted() {
    let (mut engine, mut clients, mut now) = grouped_round();
    let vanish: Vec<usize> = (0..3).flat_map(|g| group_members(&engine, &clients, g)[..2].to_vec()).collect();
    let run = run_groups(&mut engine, &mut clients, &vanish, &mut now);
    assert_eq!(run.given_up.len(), 3);
    assert_eq!(run.aborted, Some(Stage::MaskedInputCollection));
    assert!(run.jobs.is_empty());
    assert_eq!(engine.current_round(), None);
    assert_eq!(engine.completed_rounds(), 0);
    assert!(engine.weights().iter().all(|w| *w == 0.0));
}

/// Runs group `key` as its owner would, with the `clients` of its roster,
/// to its unmasking, and returns the report and sum it stores (through
/// their stored forms).
fn run_owned(
    owned: &mut owned::OwnedGroup,
    clients: &mut [NamedClient],
    now: &mut i64,
) -> (owned::GroupReport, Option<Vec<f32>>) {
    let roster = owned.roster().to_vec();
    for _ in 0..10 {
        for (position, name) in roster.iter().enumerate() {
            let client = clients.iter_mut().find(|c| c.name == *name).unwrap();
            if let Ok(Poll::Message(bytes)) = owned.poll(name) {
                let reply = client.protocol.respond(position as u32 + 1, &bytes);
                owned.receive(name, &reply).unwrap();
            }
        }
        *now += 10;
        while let Some(step) = owned.tick(*now) {
            let (report, mean) = match step {
                GroupStep::Unmask(job) => owned.unmasked(job.run()),
                GroupStep::Failed(_) => (owned.failure(), None),
                GroupStep::Next(_) | GroupStep::MaskedInputRequested(_) => continue,
            };
            let stored: owned::GroupReport =
                serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
            let mean =
                mean.map(|m| owned::GroupReport::decode_mean(&owned::GroupReport::encode_mean(&m)).unwrap());
            return (stored, mean);
        }
    }
    panic!("the owned group does not progress");
}

/// A group handed to another replica is built there from its assignment
/// alone (the same session and client ids), its clients are told they are
/// selected once the owner took it up and are sent there meanwhile, and
/// the owner's report completes the round: the same mean as if the leader
/// had run every group.
#[test]
fn a_group_run_by_another_replica_completes_the_round_from_its_report() {
    let (mut engine, mut clients, mut now) = grouped_round();
    let (key, assignment) = engine.assignment(2).unwrap();
    assert_eq!((key.task.as_str(), key.round, key.attempt, key.group), ("t", 1, 1, 2));
    let sent: owned::GroupAssignment =
        serde_json::from_str(&serde_json::to_string(&assignment).unwrap()).unwrap();
    assert_eq!(sent, assignment);
    assert!(engine.hand_off(&key, "http://owner:1"));
    assert!(!engine.hand_off(&key, "http://owner:1"), "a group is handed off once");
    let remote = group_members(&engine, &clients, 2);
    let name = clients[remote[0]].name.clone();
    assert_eq!(engine.check_in(&name, None, now), CheckIn::Wait { retry_after_ms: 250 });
    assert_eq!(engine.poll(&name), Err(EngineError::Elsewhere("http://owner:1".into())));
    assert_eq!(engine.remote_members().len(), 4);
    let mut owned =
        owned::OwnedGroup::open(key.clone(), sent, TaskPlan::new(grouped_spec()).unwrap(), now).unwrap();
    engine.remote_adopted(&key, Stage::AdvertiseKeys);
    let CheckIn::Selected { session, .. } = engine.check_in(&name, None, now) else { panic!("not selected") };
    assert_eq!(session, Some(hex::encode(assignment.seeds.session)));
    // Clients of the leader's groups answer it; the owner's, the owner.
    let run = run_groups(&mut engine, &mut clients, &[], &mut now);
    assert_eq!(run.jobs.len(), 2);
    // A group that has begun is not handed off.
    assert!(engine.assignment(0).is_none());
    for job in run.jobs {
        engine.unmasked(1, job.group, job.session, job.run(), now).unwrap();
    }
    assert!(matches!(engine.tick(now), TickOutcome::Idle), "the remote group is still out");
    let (report, mean) = run_owned(&mut owned, &mut clients, &mut now);
    assert_eq!((report.survivors, report.failed_at, report.stages.len()), (4, None, 4));
    engine.remote_settled(&key, &report, mean, now);
    let TickOutcome::Persist(Persist::Model(completion)) = engine.tick(now) else { panic!("no completion") };
    assert_eq!((completion.round.selected, completion.round.survivors), (12, 12));
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["groups"][2]["survivors"], 4);
    assert_eq!(metrics["groups"][2]["owner"], "http://owner:1");
    assert!(metrics["groups"][0].get("owner").is_none(), "run by the leader");
    assert_eq!(metrics["stages"][0]["eligible"], 12, "the owner's stages add in");
    assert_eq!(metrics["total_examples"], (1..=12).map(|k| 10 * k).sum::<u64>());
    engine.advance(Persist::Model(completion), true);
    assert_model_is_the_mean_of(&engine, &clients, &(0..12).collect::<Vec<_>>());
}

/// A group whose owner's lease lapsed, or whose report does not fit the
/// round, is given up: its clients count as dropouts and the round
/// completes from the other groups.
#[test]
fn a_group_lost_with_its_owner_or_misreported_is_given_up() {
    let (mut engine, mut clients, mut now) = grouped_round();
    let kept = group_members(&engine, &clients, 0);
    let (lost, _) = engine.assignment(1).unwrap();
    let (bad, _) = engine.assignment(2).unwrap();
    assert!(engine.hand_off(&lost, "http://owner:1") && engine.hand_off(&bad, "http://owner:2"));
    engine.remote_adopted(&lost, Stage::ShareKeys);
    engine.remote_adopted(&bad, Stage::Unmasking);
    let run = run_groups(&mut engine, &mut clients, &[], &mut now);
    for job in run.jobs {
        engine.unmasked(1, job.group, job.session, job.run(), now).unwrap();
    }
    engine.remote_lost(&lost, now);
    assert!(matches!(engine.tick(now), TickOutcome::GroupAborted { group: 1, stage: Stage::ShareKeys, .. }));
    // A completed group's report whose sum has the wrong length.
    let report = owned::GroupReport { failed_at: None, survivors: 4, ..owned::GroupReport::unbuilt() };
    engine.remote_settled(&bad, &report, Some(vec![0.5; 3]), now);
    assert!(matches!(engine.tick(now), TickOutcome::GroupAborted { group: 2, stage: Stage::Unmasking, .. }));
    let TickOutcome::Persist(Persist::Model(completion)) = engine.tick(now) else { panic!("no completion") };
    assert_eq!((completion.round.selected, completion.round.survivors), (12, 4));
    let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
    assert_eq!(metrics["groups"][1]["failed_at"], "share-keys");
    assert_eq!(metrics["groups"][2]["failed_at"], "unmasking");
    engine.advance(Persist::Model(completion), true);
    assert_model_is_the_mean_of(&engine, &clients, &kept);
}

/// A task under differential privacy: each round's noisy mean moves the
/// model, its record carries ε spent so far, and the task stops with
/// `budget_spent` when the next round would exceed the budget.
#[test]
fn a_private_task_accounts_each_round_and_stops_at_its_budget() {
    use crate::privacy::PrivacySpec;
    use cohort_crypto::dp::Mechanism;
    let mut spec = small_spec();
    spec.rounds = 10;
    let privacy = PrivacySpec {
        mechanism: Mechanism::Skellam,
        epsilon: Some(100.0),
        delta: 1e-5,
        clip_norm: 1.0,
        noise_multiplier: Some(2.0),
        sample_rate: None,
        bits: 16,
    };
    spec.privacy = Some(privacy);
    let plan = *TaskPlan::new(spec.clone()).unwrap().privacy().unwrap();
    // A budget that fits two rounds and not three.
    let budget = (plan.epsilon_after(2) + plan.epsilon_after(3)) / 2.0;
    spec.privacy = Some(PrivacySpec { epsilon: Some(budget), ..privacy });
    let security = TaskPlan::new(spec.clone()).unwrap().security();
    assert_eq!(security.privacy, Some(plan.params));
    assert_eq!((security.max_weight, security.modulus_bits), (1, 16));
    let mut engine = engine(spec);
    let mut clients = participants(6);
    let mut now = 0;
    for round in 1..=2u64 {
        let before = engine.weights().to_vec();
        let (completion, metrics) = whole_round(&mut engine, &mut clients, round, &mut now);
        let epsilon = metrics["epsilon"].as_f64().unwrap();
        assert!((epsilon - plan.epsilon_after(round)).abs() < 1e-12, "round {round}: {epsilon}");
        // Every client counts once; no metrics travel.
        assert_eq!(metrics["total_examples"], 6);
        assert!(metrics.get("client_means").is_none());
        engine.advance(Persist::Model(Box::new(completion)), true);
        assert_ne!(engine.weights(), before.as_slice());
        assert!(engine.weights().iter().all(|w| w.is_finite()));
        assert_eq!(engine.epsilon_spent(), Some(plan.epsilon_after(round)));
    }
    for c in &clients {
        engine.check_in(&c.name, None, now);
    }
    assert!(matches!(engine.tick(now), TickOutcome::Idle));
    assert_eq!(engine.status(), TaskStatus::BudgetSpent);
    assert_eq!(engine.current_round(), None);
    assert!(engine.privacy().unwrap().epsilon_spent <= budget);
}

/// The small task under privacy (Skellam, z = 1, a 20-bit ring) with
/// validation, for rounds of `clients`.
fn private_validated_spec(clients: u32) -> TaskSpec {
    use crate::privacy::PrivacySpec;
    use crate::spec::{NormChoice, ValidationSpec};
    let mut spec = small_spec();
    spec.clients_per_round = clients;
    spec.privacy = Some(PrivacySpec {
        mechanism: cohort_crypto::dp::Mechanism::Skellam,
        epsilon: None,
        delta: 1e-5,
        clip_norm: 1.0,
        noise_multiplier: Some(1.0),
        sample_rate: None,
        bits: 20,
    });
    spec.validation = Some(ValidationSpec { norm: NormChoice::L2, l2_clip: None, group_rule: None });
    spec
}

/// A private task that validates its inputs: each client proves its
/// rounded update before its noise and adds the noise of two verified
/// edges; the rounds' sums pass their checks (the ring leaves nine
/// standard deviations, so no honest sum wraps) and move the model.
#[test]
fn a_private_validated_task_checks_every_sum_and_moves_the_model() {
    let spec = private_validated_spec(6);
    let plan = TaskPlan::new(spec.clone()).unwrap();
    assert_eq!(plan.spec().validation_clip(), Some(1.0), "the privacy clip");
    let mut engine = engine(spec);
    let mut clients = participants(6);
    let mut now = 0;
    for round in 1..=2u64 {
        let before = engine.weights().to_vec();
        let (completion, metrics) = whole_round(&mut engine, &mut clients, round, &mut now);
        assert_eq!(metrics["total_examples"], 6, "every client counted: {metrics}");
        assert!(metrics["suspects"].as_array().is_none_or(|s| s.is_empty()), "{metrics}");
        assert!(metrics["refused_inputs"].as_array().is_none_or(|s| s.is_empty()), "{metrics}");
        engine.advance(Persist::Model(Box::new(completion)), true);
        assert_ne!(engine.weights(), before.as_slice());
        assert!(engine.weights().iter().all(|w| w.is_finite()));
    }
}

/// A client that lies about a noise edge (its commitment differs from the
/// other end's) takes itself and that end out of the round: both are named
/// in the round's `refused_inputs` and as suspects, a failed test of two
/// for the cheater search, and the round completes with the others.
#[test]
fn a_disputed_noise_edge_names_both_ends_as_suspects() {
    let mut engine = engine(private_validated_spec(8));
    let mut clients = participants(8);
    clients[5].lies = true;
    // A client whose verifiers were both ends cannot mask, and leaves.
    clients.iter_mut().for_each(|c| c.leaves = true);
    let mut now = 0;
    let (completion, metrics) = whole_round(&mut engine, &mut clients, 1, &mut now);
    let names = |key: &str| -> Vec<String> {
        metrics[key].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    let mut refused = names("refused_inputs");
    refused.sort();
    assert_eq!(refused.len(), 2, "{metrics}");
    assert!(refused.contains(&"p5".to_string()), "{metrics}");
    assert_eq!(names("suspects"), refused, "both ends are suspects");
    assert!(completion.round.survivors <= 6 && completion.round.survivors >= 4, "{metrics}");
}

/// Round 1 of `n` clients with threshold 2, started at time 0.
fn started_with_threshold_two(n: usize) -> (TaskEngine, Vec<NamedClient>) {
    let mut spec = small_spec();
    spec.clients_per_round = n as u32;
    spec.secure_aggregation.threshold = Some(2);
    let mut engine = engine(spec);
    let clients = participants(n);
    for c in &clients {
        engine.check_in(&c.name, None, 0);
    }
    assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
    (engine, clients)
}

/// A three-client round (t = 2) as the public demo runs it.
fn demo_shaped_engine() -> (TaskEngine, Vec<NamedClient>) {
    started_with_threshold_two(3)
}

/// A client that leaves after sharing its keys is waited for no longer:
/// the masked-input stage closes as soon as the other two sent theirs,
/// long before its deadline, and the round completes with them (each
/// survivor's seed from its own share and its one surviving neighbour's).
/// The leaver is not selectable until it checks in again.
#[test]
fn a_client_that_leaves_is_not_waited_for_and_not_selected_again() {
    let (mut engine, mut clients) = demo_shaped_engine();
    let mut now = 0;
    for _ in 0..2 {
        for client in clients.iter_mut() {
            assert!(client.step(&mut engine));
        }
        now += 10;
        engine.tick(now);
    }
    assert_eq!(engine.current_round().map(|r| r.1), Some(Stage::MaskedInputCollection));
    engine.leave(&clients[2].name);
    let progress = engine.progress().unwrap();
    assert_eq!((progress.eligible, progress.awaited, progress.left, progress.threshold), (3, 2, 1, 2));
    for client in clients.iter_mut().take(2) {
        assert!(client.step(&mut engine));
    }
    now += 10;
    assert!(matches!(
        engine.tick(now),
        TickOutcome::Persist(Persist::Contributors { .. }) | TickOutcome::Idle
    ));
    assert_eq!(engine.current_round().map(|r| r.1), Some(Stage::Unmasking), "closed without its deadline");
    let job = run_round(&mut engine, &mut clients[..2], &[], &mut now).unwrap();
    assert!(now < 1_000, "no deadline passed: {now} ms");
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!((completion.round.selected, completion.round.survivors), (3, 2));
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_model_is_the_mean_of(&engine, &clients, &[0, 1]);
    // Round 2 needs three: the leaver is not available until it checks in.
    engine.check_in(&clients[0].name, None, now);
    engine.check_in(&clients[1].name, None, now);
    assert_eq!(engine.available(now), 2);
    assert!(matches!(engine.tick(now), TickOutcome::Idle));
    engine.check_in(&clients[2].name, None, now);
    assert!(matches!(engine.tick(now), TickOutcome::Started(2)));
}

/// One of three leaving before it advertised its keys leaves each other
/// client one neighbour to share its mask key with, fewer than t = 2: the
/// round ends as soon as the others answered, and says so.
#[test]
fn a_round_left_before_its_keys_ends_at_once_with_its_reason() {
    let (mut engine, mut clients) = demo_shaped_engine();
    engine.leave(&clients[2].name);
    for client in clients.iter_mut().take(2) {
        assert!(client.step(&mut engine));
    }
    let TickOutcome::Aborted { round: 1, attempt, .. } = engine.tick(10) else {
        panic!("not aborted at once")
    };
    assert!(
        attempt.reason.starts_with("advertise-keys: 2 of 3 clients answered (1 left), which"),
        "{}",
        attempt.reason
    );
    assert!(attempt.reason.contains("leaves 0 with the 2 neighbours"), "{}", attempt.reason);
}

/// When too few clients are left to reach the threshold, the round is
/// given up at once, not at the deadline, and says why: in the round
/// record handed out, in the engine's last failure, and to the client
/// that stayed when it next asks for its stage.
#[test]
fn a_round_that_can_no_longer_reach_its_threshold_ends_at_once_with_its_reason() {
    let (mut engine, mut clients) = demo_shaped_engine();
    let mut now = 0;
    for _ in 0..2 {
        for client in clients.iter_mut() {
            client.step(&mut engine);
        }
        now += 10;
        engine.tick(now);
    }
    assert_eq!(engine.current_round().map(|r| r.1), Some(Stage::MaskedInputCollection));
    engine.leave(&clients[1].name);
    assert!(matches!(engine.tick(now), TickOutcome::Idle), "one left: two can still answer");
    engine.leave(&clients[2].name);
    let TickOutcome::Aborted { round: 1, stage: Stage::MaskedInputCollection, attempt } = engine.tick(now)
    else {
        panic!("not aborted at once");
    };
    assert_eq!((attempt.attempt, attempt.outcome, attempt.selected), (1, AttemptOutcome::Aborted, 3));
    assert_eq!(attempt.ended_at, now);
    assert!(
        attempt.reason.contains("0 of 3 clients answered") && attempt.reason.contains("(2 left)"),
        "{}",
        attempt.reason
    );
    assert!(attempt.reason.contains("the threshold is 2"), "{}", attempt.reason);
    assert_eq!(attempt.stages.len(), 3, "advertise, share and the masked-input stage it stopped in");
    assert_eq!(engine.last_failure(), Some(&*attempt));
    let told = engine.poll(&clients[0].name).err();
    assert!(
        matches!(&told, Some(EngineError::Failed(reason)) if reason.starts_with("round 1 (attempt 1) was aborted")),
        "{told:?}"
    );
    assert!(matches!(engine.poll("someone else"), Err(EngineError::NotSelected)));
}

/// The task's availability window decides how long a silent client stays
/// selectable.
#[test]
fn availability_follows_the_task_window() {
    let mut spec = small_spec();
    spec.deadlines.availability_ms = 5_000;
    let mut engine = engine(spec);
    engine.check_in("p", None, 0);
    assert_eq!(engine.available(5_000), 1);
    assert_eq!(engine.available(5_001), 0);
}

/// Begins `bytes` as a masked input arriving in pieces and hands over its
/// bytes up to `until`, 7 at a time; returns the upload's number.
fn stream_until(engine: &mut TaskEngine, name: &str, bytes: &[u8], until: usize) -> u64 {
    use cohort_crypto::messages::MASKED_INPUT_HEADER_LEN as HEADER;
    let upload = engine.input(name, InputStep::Begin(bytes[..HEADER].to_vec())).unwrap();
    for piece in bytes[HEADER..until].chunks(7) {
        engine.input(name, InputStep::Piece(upload, piece.to_vec())).unwrap();
    }
    upload
}

#[test]
fn masked_inputs_in_pieces_count_only_whole_and_broken_ones_are_taken_back_out() {
    let (mut engine, mut clients) = started_with_threshold_two(4);
    let mut now = 0;
    for _ in 0..2 {
        for client in clients.iter_mut() {
            assert!(client.step(&mut engine));
        }
        now += 10;
        engine.tick(now);
    }
    assert_eq!(engine.current_round().map(|r| r.1), Some(Stage::MaskedInputCollection));
    let inputs: Vec<Vec<u8>> = clients.iter_mut().map(|c| c.answer(&mut engine).unwrap()).collect();
    let names: Vec<String> = clients.iter().map(|c| c.name.clone()).collect();
    let half = |i: usize| inputs[i].len() / 2;

    // p0: whole, in pieces.
    let upload = stream_until(&mut engine, &names[0], &inputs[0], inputs[0].len());
    engine.input(&names[0], InputStep::Finish(upload)).unwrap();
    // p1: breaks off half way, and its retry replaces it; the first try's
    // late steps find nothing and take nothing out.
    let first = stream_until(&mut engine, &names[1], &inputs[1], half(1));
    let retry = stream_until(&mut engine, &names[1], &inputs[1], inputs[1].len());
    assert_ne!(first, retry);
    let late = engine.input(&names[1], InputStep::Piece(first, inputs[1][half(1)..].to_vec()));
    assert!(matches!(late, Err(EngineError::Protocol(ProtocolError::InvalidMessage { .. }))), "{late:?}");
    engine.input(&names[1], InputStep::Abort(first)).unwrap();
    engine.input(&names[1], InputStep::Finish(retry)).unwrap();
    engine.input(&names[1], InputStep::Abort(retry)).unwrap();
    // p2: breaks off and is abandoned; a finish of a short input is
    // refused (and takes it back out).
    let upload = stream_until(&mut engine, &names[2], &inputs[2], half(2));
    engine.input(&names[2], InputStep::Abort(upload)).unwrap();
    let upload = stream_until(&mut engine, &names[2], &inputs[2], half(2));
    let short = engine.input(&names[2], InputStep::Finish(upload));
    assert!(matches!(short, Err(EngineError::Protocol(ProtocolError::Decode(_)))), "{short:?}");
    // p3: still arriving when the deadline passes: taken out at the close.
    stream_until(&mut engine, &names[3], &inputs[3], half(3));
    now += 400_000;
    let job = match engine.tick(now) {
        TickOutcome::Unmask(job) => *job,
        _ => run_round(&mut engine, &mut clients, &[2, 3], &mut now).unwrap(),
    };
    let completion = complete(&mut engine, 1, job, now);
    assert_eq!((completion.round.selected, completion.round.survivors), (4, 2));
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_model_is_the_mean_of(&engine, &clients, &[0, 1]);
}

/// Every number a task spec carries, at the edges of what JSON and the
/// schema allow: a spec that validates must load from what creation stores
/// (its JSON, its initial checkpoint), and its optimizer's first step on
/// an update at the clip must leave finite weights. A τ of 10²⁰ once
/// validated (finite and positive) but squared to an infinity that the
/// stored optimizer state could not carry.
#[test]
fn a_spec_that_validates_loads_and_steps_at_every_edge_of_its_numbers() {
    use serde_json::{Value, json};
    let extremes = [
        json!(-3.4e38),
        json!(-1.0),
        json!(0.0),
        json!(1e-45),
        json!(1e-30),
        json!(0.5),
        json!(0.999_999),
        json!(1.0),
        json!(1000.0),
        json!(1000.001),
        json!(1e19),
        json!(2e19),
        json!(3.4e38),
    ];
    let optimizers = [
        json!({ "kind": "fedavg", "learning_rate": 1.0 }),
        json!({ "kind": "fedavgm", "learning_rate": 1.0, "momentum": 0.9 }),
        json!({ "kind": "fedadam", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 0.001 }),
        json!({ "kind": "fedyogi", "learning_rate": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 0.001 }),
    ];
    let mut checked = 0;
    for optimizer in optimizers {
        let mut base = serde_json::to_value(small_spec()).unwrap();
        base["optimizer"] = optimizer.clone();
        base["model"]["init"] = json!({ "kind": "uniform", "scale": 0.1, "seed": 1 });
        let fields: Vec<String> = optimizer
            .as_object()
            .unwrap()
            .keys()
            .filter(|k| *k != "kind")
            .map(|k| format!("/optimizer/{k}"))
            .chain(["/model/init/scale", "/quantization/clip", "/over_selection"].map(String::from))
            .chain(["/secure_aggregation/target_dropout", "/secure_aggregation/corruption"].map(String::from))
            .collect();
        for field in &fields {
            for value in &extremes {
                let mut spec = base.clone();
                *spec.pointer_mut(field).unwrap() = value.clone();
                let Ok(spec) = serde_json::from_value::<TaskSpec>(spec) else { continue };
                if spec.validate().is_err() {
                    continue;
                }
                checked += 1;
                let context = format!("{field} = {value}");
                let initial = TaskEngine::initial_checkpoint("t", &spec, 0).expect(&context);
                let stored: TaskSpec = serde_json::from_value::<Value>(serde_json::to_value(&spec).unwrap())
                    .and_then(serde_json::from_value)
                    .expect(&context);
                let plan = TaskPlan::new(stored).expect(&context);
                TaskEngine::new("t".into(), plan, TaskStatus::Active, &initial, []).expect(&context);
                let mut weights = spec.initial_weights();
                let clip = spec.quantization.clip;
                let update = vec![clip; weights.len()];
                let mut state = spec.optimizer.initial_state(weights.len());
                spec.optimizer.step(&mut weights, &update, &mut state).expect(&context);
                assert!(weights.iter().all(|w| w.is_finite()), "{context}: {weights:?}");
            }
        }
    }
    assert!(checked > 50, "only {checked} specs validated: the edges are not exercised");
}

/// A task's group rule (`validation.group_rule`, THREAT_MODEL claim 67): a
/// group whose mean is longer than the rule's `max` is left out of the
/// round's sum and counted; the median takes the coordinate-wise median of
/// the groups' means. Here one client sends a large update with a large
/// example count, which dominates its group's mean.
#[test]
fn a_group_rule_leaves_out_or_outvotes_a_poisoned_group() {
    use crate::spec::{GroupRule, NormChoice, ValidationSpec};
    for rule in [GroupRule::Norm { max: 1.0 }, GroupRule::Median] {
        let mut spec = grouped_spec();
        spec.validation =
            Some(ValidationSpec { norm: NormChoice::None, l2_clip: None, group_rule: Some(rule) });
        let mut engine = engine(spec);
        let mut clients = twelve();
        clients[0] = NamedClient::new(0, vec![1.0; 4], 5000);
        for c in &clients {
            engine.check_in(&c.name, None, 0);
        }
        assert!(matches!(engine.tick(0), TickOutcome::Started(1)));
        let groups: Vec<Vec<usize>> = (0..3).map(|g| group_members(&engine, &clients, g)).collect();
        let mut now = 0;
        let run = run_groups(&mut engine, &mut clients, &[], &mut now);
        for job in run.jobs {
            engine.unmasked(1, job.group, job.session, job.run(), now).unwrap();
        }
        let TickOutcome::Persist(Persist::Model(completion)) = engine.tick(now) else {
            panic!("no completion")
        };
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        engine.advance(Persist::Model(completion), true);
        let means: Vec<Vec<f32>> = groups.iter().map(|members| weighted_mean(&clients, members)).collect();
        let poisoned = groups.iter().position(|members| members.contains(&0)).unwrap();
        assert!(robust::norm(&means[poisoned]) > 1.0, "{:?}", means[poisoned]);
        let expected = match rule {
            GroupRule::Norm { .. } => {
                assert_eq!(metrics["rejected_groups"], 1, "{metrics}");
                let kept: Vec<usize> = (0..12).filter(|i| !groups[poisoned].contains(i)).collect();
                weighted_mean(&clients, &kept)
            }
            _ => {
                assert!(metrics.get("rejected_groups").is_none(), "{metrics}");
                robust::coordinate_median(&means.iter().map(Vec::as_slice).collect::<Vec<_>>())
            }
        };
        for (w, e) in engine.weights().iter().zip(&expected) {
            assert!((w - e).abs() < 1e-3, "{rule:?}: {:?} vs {expected:?}", engine.weights());
        }
        assert!(robust::norm(engine.weights()) < 0.7, "{rule:?}: the poisoned group moved the model");
    }
}

/// Parameters of the fitted-ring tests' model.
const D: usize = 256;

/// [`small_spec`] with a model of [`D`] parameters in a fitted ring of 9
/// bits, weights up to 64.
fn fitted_spec() -> TaskSpec {
    use crate::spec::{QuantizationConfig, RingSizing};
    let mut spec = small_spec();
    spec.model.layout.tensors[0].shape = vec![D];
    spec.quantization = QuantizationConfig {
        bits: Some(9),
        ring: RingSizing::Fitted,
        rotate: true,
        max_weight: 64,
        ..QuantizationConfig::default()
    };
    spec
}

/// A fitted ring: the first round runs at the safe scale, the next at the
/// scale fitted to the first's sum,
/// each announced to the clients and recorded with the round, and both
/// rounds' means come back within the ring's rounding.
#[test]
fn a_fitted_ring_runs_each_round_at_the_scale_of_the_last_sum() {
    use cohort_crypto::quantize::{SumSpread, fitted_scale, safe_scale};
    let spec = fitted_spec();
    let max_weight = spec.quantization.max_weight;
    let mut engine = engine(spec);
    let safe = safe_scale(9, 6, 1.0).unwrap();
    let mut next_scale = safe;
    for round in 1..=3u64 {
        let expected_scale = next_scale;
        // Updates of one direction and their own parts, weights 10 to 60.
        let mut clients: Vec<NamedClient> = (0..6)
            .map(|i| {
                let update = (0..D)
                    .map(|j| 0.02 * ((j as f32 * 0.7).sin() + 0.3 * ((i * D + j) as f32).cos()))
                    .collect();
                NamedClient::new(i, update, 10 * (i as u32 + 1))
            })
            .collect();
        let mut now = round as i64 * 1_000_000;
        for c in &clients {
            engine.check_in(&c.name, None, now);
        }
        assert!(matches!(engine.tick(now), TickOutcome::Started(r) if r == round));
        let Ok(Poll::Message(setup)) = engine.poll(&clients[0].name) else { panic!("no setup") };
        let Ok(ServerMessage::Setup(config)) = ServerMessage::decode(&setup) else { panic!("not a setup") };
        assert_eq!(config.modulus_bits, 9, "the ring is the bits, whatever the clients");
        // The engine fits to the decoded sum, this test to the weights'
        // change: the same up to f32 rounding.
        let scale = config.quantization.scale.unwrap();
        assert!(
            (scale / expected_scale - 1.0).abs() < 1e-3,
            "round {round}: {scale} against {expected_scale}"
        );
        let expected_scale = scale;
        let before = engine.weights().to_vec();
        let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
        let completion = complete(&mut engine, round, job, now);
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        assert_eq!(metrics["ring_scale"].as_f64(), Some(expected_scale));
        engine.advance(Persist::Model(Box::new(completion)), true);
        let mean = weighted_mean(&clients, &[0, 1, 2, 3, 4, 5]);
        // Rounding: about √6/2 steps of the sum, over s·Σw/W.
        let tolerance = 4.0 * 6f64.sqrt() / 2.0 * f64::from(max_weight) / (expected_scale * 210.0);
        for ((w, b), e) in engine.weights().iter().zip(&before).zip(&mean) {
            assert!(f64::from((w - b) - e).abs() < tolerance, "round {round}: {w} − {b} against {e}");
        }
        // The next scale: fitted to this round's decoded sum.
        let sum: Vec<f32> = engine
            .weights()
            .iter()
            .zip(&before)
            .map(|(w, b)| ((w - b) as f64 * 210.0 / f64::from(max_weight)) as f32)
            .collect();
        let spread = SumSpread::of(&sum, crate::spec::ROTATION_BLOCK, 6).unwrap();
        next_scale = fitted_scale(Some(&spread.measured_at(Some(expected_scale))), 9, 6, 1.0).unwrap();
        if round == 1 {
            assert_eq!(next_scale, 8.0 * safe, "the second round climbs by the largest step");
        }
    }
    assert!(next_scale > 20.0 * safe, "the fitted scale uses the ring: {next_scale} against {safe}");
}

/// A fitted ring's scale that overshot (here a spread measured far too
/// small): the round's sum wraps throughout and the coordinator does not
/// use it. The round completes with the model as it was (its clients
/// contributed, so they could not run it again), records the overflowed
/// group, and the next round runs at the safe scale and moves the model.
#[test]
fn a_fitted_sum_that_wrapped_is_not_used_and_the_next_round_is_safe() {
    use cohort_crypto::quantize::{SumSpread, safe_scale};
    let mut engine = engine(fitted_spec());
    let clients = || -> Vec<NamedClient> {
        (0..6)
            .map(|i| {
                let update = (0..D).map(|j| 0.3 * ((i * D + j) as f32 * 0.37).sin()).collect();
                NamedClient::new(i, update, 10 * (i as u32 + 1))
            })
            .collect()
    };
    // As if the last sum had all but vanished at a high scale.
    engine.spread =
        Some(SumSpread::of(&[1e-6; D], crate::spec::ROTATION_BLOCK, 6).unwrap().measured_at(Some(1e4)));
    let before = engine.weights().to_vec();
    let mut now = 0;
    for round in 1..=2u64 {
        let mut members = clients();
        for c in &members {
            engine.check_in(&c.name, None, now);
        }
        assert!(matches!(engine.tick(now), TickOutcome::Started(r) if r == round));
        let Ok(Poll::Message(setup)) = engine.poll(&members[0].name) else { panic!("no setup") };
        let Ok(ServerMessage::Setup(config)) = ServerMessage::decode(&setup) else { panic!("not a setup") };
        let job = run_round(&mut engine, &mut members, &[], &mut now).unwrap();
        let completion = complete(&mut engine, round, job, now);
        let metrics: serde_json::Value = serde_json::from_str(&completion.round.metrics).unwrap();
        engine.advance(Persist::Model(Box::new(completion)), true);
        assert_eq!(engine.completed_rounds(), round);
        if round == 1 {
            assert_eq!(config.quantization.scale, Some(8e4), "8 times the last scale");
            assert_eq!(metrics["overflowed_groups"], 1, "{metrics}");
            assert_eq!(engine.weights(), &before[..], "a wrapped sum moved the model");
            assert!(engine.spread.is_none(), "the next round is not at the safe scale");
        } else {
            assert_eq!(config.quantization.scale, safe_scale(9, 6, 1.0));
            assert!(metrics.get("overflowed_groups").is_none(), "{metrics}");
            assert_ne!(engine.weights(), &before[..]);
            assert!(engine.spread.is_some());
        }
        now += 10_000;
    }
}

/// The stage mark, which wakes the client requests held until their
/// answer may change, moves when a round starts and when a stage closes,
/// and not with each message: a thousand held clients wake once a stage.
#[test]
fn the_stage_mark_moves_with_a_stage_and_not_with_a_message() {
    let mut engine = engine(small_spec());
    let mut clients = participants(6);
    let mut now = 0;
    let idle = engine.stage_mark();
    for c in &clients {
        engine.check_in(&c.name, None, now);
    }
    assert_eq!(engine.stage_mark(), idle, "a check-in starts nothing");
    assert!(matches!(engine.tick(now), TickOutcome::Started(1)));
    let started = engine.stage_mark();
    assert_ne!(started, idle, "a round started");
    for client in clients.iter_mut() {
        assert!(client.step(&mut engine));
        assert_eq!(engine.stage_mark(), started, "one more message of the stage");
    }
    now += 10;
    engine.tick(now);
    assert_eq!(engine.current_round().map(|r| r.1), Some(Stage::ShareKeys));
    assert_ne!(engine.stage_mark(), started, "the stage closed");
    let job = run_round(&mut engine, &mut clients, &[], &mut now).unwrap();
    let unmasking = engine.stage_mark();
    let completion = complete(&mut engine, 1, job, now);
    engine.advance(Persist::Model(Box::new(completion)), true);
    assert_ne!(engine.stage_mark(), unmasking, "the round completed");
    assert_eq!(engine.current_round(), None);
}
