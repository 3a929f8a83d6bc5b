//! The `Store` contract, run against SQLite (a temporary file) and against
//! the real PostgreSQL server (a fresh database per test, dropped after).
//!
//! PostgreSQL is reached at `COHORT_TEST_POSTGRES_URL`, default
//! `postgres://postgres@127.0.0.1:5432/postgres` (`.ci/run` starts the
//! server when none is running).

#![allow(clippy::unwrap_used)]

use std::sync::atomic::{AtomicU32, Ordering};

use cohort_crypto::Stage;
use cohort_server::api::auth::token_hash;
use cohort_server::round::{AttemptOutcome, FailedAttempt};
use cohort_server::store::Backend;
use cohort_server::store::{
    ApiKeyRecord, AuditRecord, CheckpointRecord, ClientMetricsRecord, EnrollmentTokenRecord, Fence, GroupKey,
    GroupRecord, GroupRowState, ParticipantRecord, ProjectRecord, ReplicaRecord, Role, RoundRecord, SqlStore,
    StoreError, TaskRecord, TaskStatus,
};
use sqlx::Connection;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A store on a fresh database, and what to do to remove it afterwards.
struct Fixture {
    store: SqlStore,
    cleanup: Cleanup,
}

enum Cleanup {
    File(std::path::PathBuf),
    Database { admin_url: String, name: String },
}

impl Fixture {
    async fn sqlite() -> Self {
        let n = NEXT.fetch_add(1, Ordering::SeqCst);
        let path = std::env::temp_dir().join(format!("cohort-store-{}-{n}.db", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let store = SqlStore::connect(&format!("sqlite://{}", path.display())).await.unwrap();
        Fixture { store, cleanup: Cleanup::File(path) }
    }

    async fn postgres() -> Self {
        let admin_url = std::env::var("COHORT_TEST_POSTGRES_URL")
            .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".to_string());
        let name = format!("cohort_test_{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::SeqCst));
        let mut admin = sqlx::PgConnection::connect(&admin_url)
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL is not reachable at {admin_url}: {e}"));
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut admin)
            .await
            .unwrap();
        admin.close().await.unwrap();
        let (base, _) = admin_url.rsplit_once('/').unwrap();
        let store = SqlStore::connect(&format!("{base}/{name}")).await.unwrap();
        Fixture { store, cleanup: Cleanup::Database { admin_url, name } }
    }

    async fn finish(self) {
        self.store.close().await;
        match self.cleanup {
            Cleanup::File(path) => {
                let _ = std::fs::remove_file(path);
            }
            Cleanup::Database { admin_url, name } => {
                let mut admin = sqlx::PgConnection::connect(&admin_url).await.unwrap();
                sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}")))
                    .execute(&mut admin)
                    .await
                    .unwrap();
            }
        }
    }
}

fn task(id: &str, created_at: i64) -> TaskRecord {
    TaskRecord {
        id: id.to_string(),
        name: format!("task {id}"),
        spec: r#"{"rounds":3}"#.to_string(),
        status: TaskStatus::Active,
        enrollment_token_hash: token_hash(id),
        created_at,
        updated_at: created_at,
        project_id: "default".to_string(),
    }
}

fn checkpoint(task_id: &str, round: i64) -> CheckpointRecord {
    CheckpointRecord {
        task_id: task_id.to_string(),
        round,
        model: vec![round as u8; 64],
        optimizer_state: format!(r#"{{"step":{round}}}"#).into_bytes(),
        created_at: 1_000 + round,
    }
}

fn round(task_id: &str, round: i64) -> RoundRecord {
    RoundRecord {
        task_id: task_id.to_string(),
        round,
        started_at: 10 * round,
        finished_at: 10 * round + 5,
        selected: 12,
        survivors: 10,
        metrics: r#"{"dropouts":2}"#.to_string(),
    }
}

fn participant(id: &str, task_id: &str, credential: u8) -> ParticipantRecord {
    ParticipantRecord {
        id: id.to_string(),
        task_id: task_id.to_string(),
        credential_hash: [credential; 32],
        enrolled_at: 100,
        last_seen_at: 100,
        expires_at: 10_000,
        identity_key: Some([credential; 32]),
        token_id: Some(task_id.to_string()),
    }
}

async fn tasks_and_status(store: &SqlStore) {
    store.create_task(&task("b", 2), &checkpoint("b", 0), None).await.unwrap();
    store.create_task(&task("a", 1), &checkpoint("a", 0), None).await.unwrap();
    assert!(matches!(
        store.create_task(&task("a", 3), &checkpoint("a", 0), None).await,
        Err(StoreError::Conflict(_))
    ));
    let ids: Vec<String> = store.tasks().await.unwrap().into_iter().map(|t| t.id).collect();
    assert_eq!(ids, ["a", "b"]);
    assert_eq!(store.task("a").await.unwrap(), task("a", 1));
    assert!(matches!(store.task("missing").await, Err(StoreError::NotFound("task"))));
    store.set_task_status("a", TaskStatus::Paused, 50, None, None).await.unwrap();
    let paused = store.task("a").await.unwrap();
    assert_eq!((paused.status, paused.updated_at), (TaskStatus::Paused, 50));
    store.set_task_status("a", TaskStatus::Stopped, 60, None, None).await.unwrap();
    assert!(matches!(
        store.set_task_status("a", TaskStatus::Active, 70, None, None).await,
        Err(StoreError::Conflict(_))
    ));
    assert_eq!(store.task("a").await.unwrap().status, TaskStatus::Stopped);
    assert!(matches!(
        store.set_task_status("zz", TaskStatus::Paused, 1, None, None).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn participants_and_credentials(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.add_participant(&participant("p1", "t", 1)).await.unwrap();
    store.add_participant(&participant("p2", "t", 2)).await.unwrap();
    assert!(matches!(store.add_participant(&participant("p3", "t", 1)).await, Err(StoreError::Conflict(_))));
    assert!(matches!(
        store.add_participant(&participant("p4", "nope", 4)).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.participant_by_credential(&[2; 32]).await.unwrap(), participant("p2", "t", 2));
    // One identity key per task; participants from before identities have none.
    let same_identity = ParticipantRecord { credential_hash: [5; 32], ..participant("p5", "t", 2) };
    assert!(matches!(store.add_participant(&same_identity).await, Err(StoreError::Conflict(_))));
    let keyless = ParticipantRecord { identity_key: None, ..participant("p6", "t", 6) };
    store.add_participant(&keyless).await.unwrap();
    let other_keyless = ParticipantRecord { identity_key: None, ..participant("p7", "t", 7) };
    store.add_participant(&other_keyless).await.unwrap();
    assert_eq!(store.participant_by_credential(&[6; 32]).await.unwrap(), keyless);
    assert!(matches!(store.participant_by_credential(&[9; 32]).await, Err(StoreError::NotFound(_))));
    store.touch_participant("p1", 500).await.unwrap();
    assert_eq!(store.participant_by_credential(&[1; 32]).await.unwrap().last_seen_at, 500);
    assert!(matches!(store.touch_participant("ghost", 1).await, Err(StoreError::NotFound(_))));
    assert_eq!(store.participants("t").await.unwrap().len(), 4);
}

/// Tokens per application: the task's first is `default`; names are
/// unique per task; a token is found by its hash; revoking it stamps it
/// once and ends the credentials it issued, and nothing else.
async fn enrollment_tokens_per_application(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.create_task(&task("u", 2), &checkpoint("u", 0), None).await.unwrap();
    let tokens = store.enrollment_tokens("t").await.unwrap();
    assert_eq!(tokens.len(), 1);
    assert_eq!((tokens[0].0.id.as_str(), tokens[0].0.name.as_str(), tokens[0].1), ("t", "default", 0));
    assert_eq!(tokens[0].0.token_hash, token_hash("t"));
    let app = EnrollmentTokenRecord {
        id: "app".into(),
        task_id: "t".into(),
        name: "android".into(),
        token_hash: [42; 32],
        rate: Some((30, 5)),
        created_at: 10,
        revoked_at: None,
    };
    store.add_enrollment_token(&app, None).await.unwrap();
    let same_name = EnrollmentTokenRecord { id: "app2".into(), token_hash: [43; 32], ..app.clone() };
    assert!(matches!(store.add_enrollment_token(&same_name, None).await, Err(StoreError::Conflict(_))));
    // The same name in another task is another token.
    store
        .add_enrollment_token(&EnrollmentTokenRecord { task_id: "u".into(), ..same_name }, None)
        .await
        .unwrap();
    let orphan =
        EnrollmentTokenRecord { id: "x".into(), task_id: "nope".into(), token_hash: [44; 32], ..app.clone() };
    assert!(store.add_enrollment_token(&orphan, None).await.is_err());
    assert_eq!(store.enrollment_token_by_hash(&[42; 32]).await.unwrap(), app);
    assert!(matches!(store.enrollment_token_by_hash(&[99; 32]).await, Err(StoreError::NotFound(_))));

    let by_app = ParticipantRecord { token_id: Some("app".into()), ..participant("p1", "t", 1) };
    store.add_participant(&by_app).await.unwrap();
    store.add_participant(&participant("p2", "t", 2)).await.unwrap();
    let counts: Vec<(String, i64)> =
        store.enrollment_tokens("t").await.unwrap().into_iter().map(|(t, n)| (t.id, n)).collect();
    assert_eq!(counts, [("t".to_string(), 1), ("app".to_string(), 1)]);

    let revoked = store.revoke_enrollment_token("t", "app", 500, None).await.unwrap();
    assert_eq!(revoked.revoked_at, Some(500));
    assert_eq!(store.revoke_enrollment_token("t", "app", 900, None).await.unwrap().revoked_at, Some(500));
    assert_eq!(store.participant_by_credential(&[1; 32]).await.unwrap().expires_at, 500);
    assert_eq!(store.participant_by_credential(&[2; 32]).await.unwrap().expires_at, 10_000);
    // An enrollment checked before the revocation and stored after it is
    // refused, and leaves no credential.
    let late = ParticipantRecord { token_id: Some("app".into()), ..participant("p9", "t", 9) };
    assert!(matches!(store.add_participant(&late).await, Err(StoreError::Revoked)));
    assert!(matches!(store.participant_by_credential(&[9; 32]).await, Err(StoreError::NotFound(_))));
    assert!(matches!(store.revoke_enrollment_token("u", "app", 1, None).await, Err(StoreError::NotFound(_))));
    assert!(matches!(
        store.revoke_enrollment_token("t", "ghost", 1, None).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn rounds_are_atomic_ordered_and_pruned(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    assert_eq!(store.latest_checkpoint("t").await.unwrap(), checkpoint("t", 0));
    // Out of order: refused, nothing written.
    assert!(matches!(
        store.complete_round(&round("t", 2), &checkpoint("t", 2), 2, None).await,
        Err(StoreError::Conflict(_))
    ));
    // A mismatched checkpoint: refused before anything is written.
    assert!(store.complete_round(&round("t", 1), &checkpoint("t", 2), 2, None).await.is_err());
    assert!(store.rounds("t").await.unwrap().is_empty());
    for r in 1..=4 {
        store.complete_round(&round("t", r), &checkpoint("t", r), 2, None).await.unwrap();
    }
    // Replaying a completed round is refused and changes nothing.
    assert!(matches!(
        store.complete_round(&round("t", 4), &checkpoint("t", 4), 2, None).await,
        Err(StoreError::Conflict(_))
    ));
    let rounds: Vec<i64> = store.rounds("t").await.unwrap().into_iter().map(|r| r.round).collect();
    assert_eq!(rounds, [1, 2, 3, 4]);
    assert_eq!(store.rounds("t").await.unwrap()[2], round("t", 3));
    // Retention 2 keeps the two newest and the initial model.
    assert_eq!(store.checkpoint_rounds("t").await.unwrap(), [0, 3, 4]);
    assert_eq!(store.latest_checkpoint("t").await.unwrap(), checkpoint("t", 4));
    assert_eq!(store.checkpoint("t", 3).await.unwrap(), checkpoint("t", 3));
    assert!(matches!(store.checkpoint("t", 1).await, Err(StoreError::NotFound(_))));
}

async fn client_metrics_once_per_round(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.add_participant(&participant("p", "t", 3)).await.unwrap();
    let metrics = ClientMetricsRecord {
        task_id: "t".into(),
        round: 1,
        participant_id: "p".into(),
        kind: "train".into(),
        metrics: r#"{"loss":0.5}"#.into(),
        reported_at: 9,
    };
    store.add_client_metrics(&metrics).await.unwrap();
    assert!(matches!(store.add_client_metrics(&metrics).await, Err(StoreError::Conflict(_))));
    let eval = ClientMetricsRecord { kind: "eval".into(), ..metrics.clone() };
    store.add_client_metrics(&eval).await.unwrap();
    assert_eq!(store.client_metrics("t", 1).await.unwrap(), vec![eval, metrics]);
    let stranger =
        ClientMetricsRecord { participant_id: "nobody".into(), kind: "x".into(), ..Default::default() };
    assert!(
        store.add_client_metrics(&ClientMetricsRecord { task_id: "t".into(), ..stranger }).await.is_err()
    );
}

async fn round_contributors_last_until_their_round_completes(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.create_task(&task("u", 1), &checkpoint("u", 0), None).await.unwrap();
    let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(store.contributors("t", 1).await.unwrap().is_empty());
    // Two attempts of round 1 (the second after a restart), one of round 2
    // written ahead, and another task's.
    store.record_contributors("t", 1, &names(&["p3", "p1"]), 10, None).await.unwrap();
    store.record_contributors("t", 1, &names(&["p2", "p1"]), 20, None).await.unwrap();
    store.record_contributors("t", 2, &names(&["p9"]), 30, None).await.unwrap();
    store.record_contributors("u", 1, &names(&["q1"]), 30, None).await.unwrap();
    assert_eq!(store.contributors("t", 1).await.unwrap(), names(&["p1", "p2", "p3"]));
    assert_eq!(store.contributors("u", 1).await.unwrap(), names(&["q1"]));
    // An unknown task is refused.
    assert!(matches!(
        store.record_contributors("nope", 1, &names(&["p1"]), 30, None).await,
        Err(StoreError::NotFound(_))
    ));
    // Completing round 1 drops its records (and only the task's own).
    store.complete_round(&round("t", 1), &checkpoint("t", 1), 2, None).await.unwrap();
    assert!(store.contributors("t", 1).await.unwrap().is_empty());
    assert_eq!(store.contributors("t", 2).await.unwrap(), names(&["p9"]));
    assert_eq!(store.contributors("u", 1).await.unwrap(), names(&["q1"]));
}

fn replica(id: &str, now: i64) -> ReplicaRecord {
    ReplicaRecord {
        id: id.into(),
        url: format!("http://{id}.example:8080"),
        started_at: 0,
        heartbeat_at: now,
    }
}

async fn replicas_and_task_leases(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.create_task(&task("u", 1), &checkpoint("u", 0), None).await.unwrap();
    for (id, now) in [("a", 100), ("b", 100), ("c", 50)] {
        store.heartbeat(&replica(id, now)).await.unwrap();
    }
    store.heartbeat(&replica("a", 120)).await.unwrap();
    let live: Vec<String> = store.replicas(100).await.unwrap().into_iter().map(|r| r.id).collect();
    assert_eq!(live, ["a", "b"], "c's heartbeat is too old");
    assert_eq!(store.replicas(0).await.unwrap()[0].heartbeat_at, 120);
    // a takes t; b cannot while a's lease holds; a renews at the same generation.
    assert_eq!(store.acquire_lease("t", "a", 100, 200).await.unwrap(), Some(1));
    assert_eq!(store.acquire_lease("t", "b", 150, 250).await.unwrap(), None);
    assert_eq!(store.acquire_lease("t", "a", 150, 250).await.unwrap(), Some(1));
    assert_eq!(store.acquire_lease("u", "b", 150, 250).await.unwrap(), Some(1));
    let leases = |now| async move {
        store.leases(now).await.unwrap().into_iter().map(|(t, r)| (t, r.id)).collect::<Vec<_>>()
    };
    assert_eq!(leases(200).await, [("t".to_string(), "a".to_string()), ("u".into(), "b".into())]);
    // Once a's lease ran out, b takes t over and the generation rises.
    assert_eq!(leases(260).await, []);
    assert_eq!(store.acquire_lease("t", "b", 260, 360).await.unwrap(), Some(2));
    assert_eq!(store.acquire_lease("t", "a", 270, 370).await.unwrap(), None);
    // A released lease is free at once; a removed replica's leases go with it.
    store.release_lease("t", "a").await.unwrap();
    assert_eq!(leases(300).await, [("t".to_string(), "b".to_string())], "a cannot release b's lease");
    store.release_lease("t", "b").await.unwrap();
    assert_eq!(store.acquire_lease("t", "a", 300, 400).await.unwrap(), Some(1));
    store.remove_replica("b").await.unwrap();
    assert_eq!(leases(300).await, [("t".to_string(), "a".to_string())]);
    assert!(store.replicas(0).await.unwrap().iter().all(|r| r.id != "b"));
    assert!(matches!(store.acquire_lease("nope", "a", 300, 400).await, Err(StoreError::NotFound(_))));
    // A replica started at a's address replaces it, leases and all, at
    // once; on SQLite (one process at a time) it replaces every other.
    store.heartbeat(&replica("b", 300)).await.unwrap();
    assert_eq!(store.acquire_lease("u", "b", 300, 400).await.unwrap(), Some(1), "b's lease went with it");
    let a2 = ReplicaRecord { id: "a2".into(), ..replica("a", 310) };
    store.register_replica(&a2).await.unwrap();
    let mut live: Vec<String> = store.replicas(0).await.unwrap().into_iter().map(|r| r.id).collect();
    live.sort();
    match store.backend() {
        Backend::Sqlite => {
            assert_eq!(live, ["a2"]);
            assert_eq!(leases(310).await, []);
        }
        Backend::Postgres => {
            assert_eq!(live, ["a2", "b", "c"]);
            assert_eq!(leases(310).await, [("u".to_string(), "b".to_string())]);
        }
    }
    assert_eq!(store.acquire_lease("t", "a2", 310, 410).await.unwrap(), Some(1), "free at once");
}

fn attempt(round: u64, ended_at: i64) -> FailedAttempt {
    FailedAttempt {
        round,
        attempt: 1,
        outcome: AttemptOutcome::Aborted,
        stage: Stage::MaskedInputCollection,
        reason: "too few clients".into(),
        selected: 4,
        started_at: ended_at - 10,
        ended_at,
        stages: Vec::new(),
    }
}

/// A leader whose lease another replica took over (it was paused past the
/// lease) writes nothing for the task: not a round, not an attempt, not a
/// round's contributors. Its successor's writes go through.
/// Exclusions (claim 68): kept per task, once per participant whatever
/// the round that repeats it, fenced like every write of a task's leader.
async fn exclusions_are_kept_once_per_task_and_fenced(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.create_task(&task("u", 1), &checkpoint("u", 0), None).await.unwrap();
    let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert!(store.exclusions("t").await.unwrap().is_empty());
    store.record_exclusions("t", 3, &names(&["p7", "p2"]), 10, None).await.unwrap();
    store.record_exclusions("t", 5, &names(&["p2"]), 20, None).await.unwrap();
    store.record_exclusions("u", 1, &names(&["q1"]), 20, None).await.unwrap();
    assert_eq!(store.exclusions("t").await.unwrap(), names(&["p2", "p7"]));
    assert_eq!(store.exclusions("u").await.unwrap(), names(&["q1"]));
    assert!(matches!(
        store.record_exclusions("nope", 1, &names(&["p1"]), 30, None).await,
        Err(StoreError::NotFound(_))
    ));
    // A leader whose lease lapsed writes nothing.
    store.heartbeat(&replica("a", 100)).await.unwrap();
    store.heartbeat(&replica("b", 100)).await.unwrap();
    assert_eq!(store.acquire_lease("t", "a", 100, 200).await.unwrap(), Some(1));
    assert_eq!(store.acquire_lease("t", "b", 300, 400).await.unwrap(), Some(2));
    let stale = Fence { replica: "a".into(), generation: 1 };
    assert!(matches!(
        store.record_exclusions("t", 6, &names(&["p9"]), 310, Some(&stale)).await,
        Err(StoreError::Fenced)
    ));
    assert_eq!(store.exclusions("t").await.unwrap(), names(&["p2", "p7"]));
    // Deleting the task deletes them.
    store.set_task_status("t", TaskStatus::Stopped, 320, None, None).await.unwrap();
    store.release_lease("t", "b").await.unwrap();
    store.delete_task("t", None).await.unwrap();
    assert!(store.exclusions("t").await.unwrap().is_empty());
    assert_eq!(store.exclusions("u").await.unwrap(), names(&["q1"]));
}

async fn writes_are_fenced_by_the_lease_generation(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    for id in ["a", "b"] {
        store.heartbeat(&replica(id, 100)).await.unwrap();
    }
    let fence = |replica: &str, generation| Fence { replica: replica.into(), generation };
    assert_eq!(store.acquire_lease("t", "a", 100, 200).await.unwrap(), Some(1));
    let stale = fence("a", 1);
    store.record_contributors("t", 1, &["p1".to_string()], 110, Some(&stale)).await.unwrap();
    // a stalls; its lease lapses and b takes the task over.
    assert_eq!(store.acquire_lease("t", "b", 300, 400).await.unwrap(), Some(2));
    let fenced = |result: Result<(), StoreError>| matches!(result, Err(StoreError::Fenced));
    assert!(fenced(store.complete_round(&round("t", 1), &checkpoint("t", 1), 5, Some(&stale)).await));
    assert!(fenced(store.record_attempt("t", &attempt(1, 310), Some(&stale)).await));
    assert!(fenced(store.record_contributors("t", 1, &["p2".to_string()], 310, Some(&stale)).await));
    // A guessed generation is no better, nor is b's generation under a's name.
    assert!(fenced(store.record_attempt("t", &attempt(1, 311), Some(&fence("b", 1))).await));
    assert!(fenced(store.record_attempt("t", &attempt(1, 312), Some(&fence("a", 2))).await));
    assert!(store.rounds("t").await.unwrap().is_empty());
    assert!(store.attempts("t", 10).await.unwrap().is_empty());
    assert_eq!(store.contributors("t", 1).await.unwrap(), ["p1"]);
    // Nor can it change the task's status or its successor's groups.
    let current = fence("b", 2);
    store.assign_groups(&[group("t", 1, 1, 0, "owner", 1_000)], Some(&current)).await.unwrap();
    assert!(fenced(store.set_task_status("t", TaskStatus::Paused, 305, Some(&stale), None).await));
    assert!(fenced(store.assign_groups(&[group("t", 1, 2, 0, "owner", 1_000)], Some(&stale)).await));
    assert!(fenced(store.delete_groups("t", Some(&stale)).await));
    assert_eq!(store.task("t").await.unwrap().status, TaskStatus::Active);
    let groups = store.group_routes(300).await.unwrap();
    assert_eq!(groups.iter().map(|g| g.key.attempt).collect::<Vec<_>>(), [1], "b's group stands");
    // The lease's holder writes.
    store.set_task_status("t", TaskStatus::Paused, 315, Some(&current), None).await.unwrap();
    store.delete_groups("t", Some(&current)).await.unwrap();
    assert!(store.group_routes(300).await.unwrap().is_empty());
    store.record_contributors("t", 1, &["p3".to_string()], 320, Some(&current)).await.unwrap();
    store.record_attempt("t", &attempt(1, 330), Some(&current)).await.unwrap();
    store.complete_round(&round("t", 1), &checkpoint("t", 1), 5, Some(&current)).await.unwrap();
    assert_eq!(store.rounds("t").await.unwrap().len(), 1);
    assert_eq!(store.attempts("t", 10).await.unwrap(), [attempt(1, 330)], "read back as written");
    // A released lease fences every write (nobody holds the task).
    store.release_lease("t", "b").await.unwrap();
    assert!(fenced(store.record_attempt("t", &attempt(2, 340), Some(&current)).await));
}

/// Deleting a task removes everything stored for it, and nothing of
/// another task.
async fn a_deleted_task_leaves_nothing_behind(store: &SqlStore) {
    for id in ["t", "u"] {
        store.create_task(&task(id, 1), &checkpoint(id, 0), None).await.unwrap();
        store.add_participant(&participant(&format!("{id}-p"), id, id.as_bytes()[0])).await.unwrap();
        store.record_contributors(id, 1, &[format!("{id}-p")], 10, None).await.unwrap();
        store.complete_round(&round(id, 1), &checkpoint(id, 1), 5, None).await.unwrap();
        store.record_attempt(id, &attempt(2, 20), None).await.unwrap();
        store.heartbeat(&replica("a", 100)).await.unwrap();
        store.acquire_lease(id, "a", 100, 200).await.unwrap();
    }
    store.delete_task("t", None).await.unwrap();
    assert!(matches!(store.task("t").await, Err(StoreError::NotFound(_))));
    assert!(matches!(store.participant_by_credential(&[b't'; 32]).await, Err(StoreError::NotFound(_))));
    assert!(store.rounds("t").await.unwrap().is_empty());
    assert!(store.attempts("t", 10).await.unwrap().is_empty());
    assert!(matches!(store.latest_checkpoint("t").await, Err(StoreError::NotFound(_))));
    assert!(store.enrollment_tokens("t").await.unwrap().is_empty());
    let leased: Vec<String> = store.leases(150).await.unwrap().into_iter().map(|(task, _)| task).collect();
    assert_eq!(leased, ["u"]);
    // The other task is whole.
    assert_eq!(store.task("u").await.unwrap().id, "u");
    assert_eq!(store.rounds("u").await.unwrap().len(), 1);
    assert_eq!(store.attempts("u", 10).await.unwrap().len(), 1);
    assert_eq!(store.latest_checkpoint("u").await.unwrap().round, 1);
    assert!(matches!(store.delete_task("t", None).await, Err(StoreError::NotFound(_))));
}

fn group(task: &str, round: u64, attempt: u32, group: u32, owner: &str, expires_at: i64) -> GroupRecord {
    GroupRecord {
        key: GroupKey { task: task.into(), round, attempt, group },
        leader_id: "lead".into(),
        owner_id: owner.into(),
        owner_url: format!("http://{owner}:8080"),
        assignment: format!("{{\"roster\": [\"{owner}-{group}\"]}}"),
        state: GroupRowState::Assigned,
        stage: "advertise-keys".into(),
        expires_at,
        report: None,
    }
}

/// The leader hands groups out; each owner claims, renews, reports and
/// settles its own; a lapsed one is marked lost once, and an owner cannot
/// settle a group that is no longer its.
async fn round_groups_between_leader_and_owners(store: &SqlStore) {
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    let key = |g: u32| GroupKey { task: "t".into(), round: 1, attempt: 1, group: g };
    // An earlier round's rows are replaced by the next assignment.
    store.assign_groups(&[group("t", 1, 1, 0, "old", 50)], None).await.unwrap();
    let handed =
        [group("t", 1, 2, 0, "a", 200), group("t", 1, 2, 1, "b", 200), group("t", 1, 2, 2, "c", 200)];
    store.assign_groups(&handed, None).await.unwrap();
    let key = |g: u32| GroupKey { attempt: 2, ..key(g) };
    let routes = store.group_routes(100).await.unwrap();
    assert_eq!(routes.iter().map(|r| r.key.clone()).collect::<Vec<_>>(), [key(0), key(1), key(2)]);
    assert_eq!((routes[1].owner_id.as_str(), routes[1].owner_url.as_str()), ("b", "http://b:8080"));
    assert_eq!(store.group_assignment(&key(1)).await.unwrap(), handed[1].assignment);
    assert!(matches!(store.group_assignment(&key(7)).await, Err(StoreError::NotFound(_))));
    // Each owner claims its own, once, while it holds.
    let claimed = store.claim_groups("a", 100, 300).await.unwrap();
    assert_eq!(
        claimed.iter().map(|r| (r.key.clone(), r.state, r.expires_at)).collect::<Vec<_>>(),
        [(key(0), GroupRowState::Running, 300)]
    );
    assert!(store.claim_groups("a", 110, 310).await.unwrap().is_empty());
    assert_eq!(store.claim_groups("b", 120, 320).await.unwrap().len(), 1);
    assert!(store.claim_groups("c", 250, 350).await.unwrap().is_empty(), "c's assignment lapsed at 200");
    // a renews and reports its stage; b does not renew.
    assert_eq!(store.renew_groups("a", 290, 400).await.unwrap(), [key(0)]);
    store.group_stage(&key(0), "a", "share-keys").await.unwrap();
    store.group_stage(&key(0), "b", "unmasking").await.unwrap();
    // At 350 the leader finds b's and c's lapsed: lost, and no longer routed.
    let led = store.led_groups("lead", 350).await.unwrap();
    let states: Vec<(u32, GroupRowState, &str)> =
        led.iter().map(|r| (r.key.group, r.state, r.stage.as_str())).collect();
    assert_eq!(
        states,
        [
            (0, GroupRowState::Running, "share-keys"),
            (1, GroupRowState::Lost, "advertise-keys"),
            (2, GroupRowState::Lost, "advertise-keys")
        ]
    );
    assert!(store.led_groups("another", 350).await.unwrap().is_empty());
    assert_eq!(store.group_routes(350).await.unwrap().len(), 1);
    // b cannot renew or settle a lost group; a settles its own once.
    assert!(store.renew_groups("b", 360, 460).await.unwrap().is_empty());
    assert!(!store.settle_group(&key(1), "b", 360, "{}", None).await.unwrap());
    assert!(!store.settle_group(&key(0), "b", 360, "{}", Some(&[1, 2])).await.unwrap(), "not b's");
    assert!(store.settle_group(&key(0), "a", 360, "{\"survivors\": 4}", Some(&[1, 2, 3, 4])).await.unwrap());
    assert!(!store.settle_group(&key(0), "a", 370, "{}", None).await.unwrap(), "settled once");
    let led = store.led_groups("lead", 380).await.unwrap();
    assert_eq!((led[0].state, led[0].report.as_deref()), (GroupRowState::Done, Some("{\"survivors\": 4}")));
    assert_eq!(store.group_mean(&key(0)).await.unwrap(), [1, 2, 3, 4]);
    assert!(matches!(store.group_mean(&key(1)).await, Err(StoreError::NotFound(_))));
    // A replica that stops gives its groups up at once.
    store.assign_groups(&[group("t", 2, 1, 0, "d", 1000)], None).await.unwrap();
    assert_eq!(store.claim_groups("d", 500, 1000).await.unwrap().len(), 1);
    store.heartbeat(&replica("d", 500)).await.unwrap();
    store.remove_replica("d").await.unwrap();
    assert!(store.renew_groups("d", 510, 1000).await.unwrap().is_empty());
    assert_eq!(store.led_groups("lead", 510).await.unwrap()[0].state, GroupRowState::Lost);
    // The leader forgets a task's groups.
    store.delete_groups("t", None).await.unwrap();
    assert!(store.led_groups("lead", 520).await.unwrap().is_empty());
    assert!(matches!(
        store.assign_groups(&[group("nope", 1, 1, 0, "a", 100)], None).await,
        Err(StoreError::NotFound(_))
    ));
}

async fn data_survives_reconnection(url: &str) {
    let store = SqlStore::connect(url).await.unwrap();
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    store.complete_round(&round("t", 1), &checkpoint("t", 1), 5, None).await.unwrap();
    store.close().await;
    // Reconnecting re-runs migrations (a no-op) and finds everything.
    let again = SqlStore::connect(url).await.unwrap();
    assert_eq!(again.rounds("t").await.unwrap(), vec![round("t", 1)]);
    assert_eq!(again.latest_checkpoint("t").await.unwrap(), checkpoint("t", 1));
    again.close().await;
}

fn entry(project: Option<&str>, action: &str, at: i64) -> AuditRecord {
    AuditRecord {
        seq: 0,
        at,
        project_id: project.map(str::to_string),
        actor: "admin".into(),
        role: "admin".into(),
        action: action.into(),
        resource: format!("{action}/{at}"),
        address: Some("127.0.0.1".into()),
        outcome: "ok".into(),
        status: 200,
        message: String::new(),
    }
}

fn key(id: &str, project: &str, role: Role, hash: u8) -> ApiKeyRecord {
    ApiKeyRecord {
        id: id.into(),
        project_id: project.into(),
        name: format!("key {id}"),
        role,
        key_hash: [hash; 32],
        created_at: 10,
        expires_at: Some(1_000),
        revoked_at: None,
        created_by: "admin".into(),
    }
}

/// Projects, their keys and the audit log: the `default` project exists
/// from the migration on; names are unique; a task belongs to a project
/// that exists; a change and its audit entry commit together, and a
/// change refused leaves no entry of its own; the log pages newest first
/// per project and is pruned by age.
async fn projects_keys_and_the_audit_log(store: &SqlStore) {
    let projects = store.projects().await.unwrap();
    assert_eq!(projects.len(), 1);
    assert_eq!((projects[0].id.as_str(), projects[0].name.as_str()), ("default", "default"));
    let acme = ProjectRecord {
        id: "p1".into(),
        name: "acme".into(),
        quotas: "{}".into(),
        owner_quotas: "{}".into(),
        created_at: 5,
    };
    store.create_project(&acme, &entry(Some("p1"), "project.create", 5)).await.unwrap();
    assert_eq!(store.project("p1").await.unwrap(), acme);
    let same_name = ProjectRecord { id: "p2".into(), ..acme.clone() };
    assert!(matches!(
        store.create_project(&same_name, &entry(Some("p2"), "project.create", 6)).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(matches!(store.project("p2").await, Err(StoreError::NotFound(_))));
    store
        .set_quotas("p1", r#"{"unfinished_tasks":2}"#, &entry(Some("p1"), "project.quotas", 7))
        .await
        .unwrap();
    assert_eq!(store.project("p1").await.unwrap().quotas, r#"{"unfinished_tasks":2}"#);
    assert!(matches!(
        store.set_quotas("nope", "{}", &entry(None, "project.quotas", 8)).await,
        Err(StoreError::NotFound(_))
    ));
    // The owners' limits are a column of their own: the operator's stay.
    store
        .set_owner_quotas("p1", r#"{"parameters":100}"#, &entry(Some("p1"), "project.owner_quotas", 8))
        .await
        .unwrap();
    let stored = store.project("p1").await.unwrap();
    assert_eq!(
        (stored.quotas.as_str(), stored.owner_quotas.as_str()),
        (r#"{"unfinished_tasks":2}"#, r#"{"parameters":100}"#)
    );
    assert!(matches!(
        store.set_owner_quotas("nope", "{}", &entry(None, "project.owner_quotas", 8)).await,
        Err(StoreError::NotFound(_))
    ));

    // Tasks: in a project that exists; the task's entry commits with it.
    let ours = TaskRecord { project_id: "p1".into(), ..task("t", 1) };
    store.create_task(&ours, &checkpoint("t", 0), Some(&entry(Some("p1"), "task.create", 9))).await.unwrap();
    assert_eq!(store.task("t").await.unwrap().project_id, "p1");
    let orphan = TaskRecord { project_id: "nope".into(), ..task("u", 2) };
    assert!(
        store.create_task(&orphan, &checkpoint("u", 0), Some(&entry(None, "task.create", 10))).await.is_err()
    );
    assert!(matches!(store.task("u").await, Err(StoreError::NotFound(_))));
    store
        .set_task_status("t", TaskStatus::Stopped, 20, None, Some(&entry(Some("p1"), "task.stop", 11)))
        .await
        .unwrap();
    // Refused (the task is over): neither the change nor its entry.
    assert!(
        store
            .set_task_status("t", TaskStatus::Active, 21, None, Some(&entry(Some("p1"), "task.resume", 12)))
            .await
            .is_err()
    );

    // Keys: unique names per project, found by hash, revoked once.
    store.add_key(&key("k1", "p1", Role::Owner, 1), &entry(Some("p1"), "key.create", 13)).await.unwrap();
    store.add_key(&key("k2", "p1", Role::Viewer, 2), &entry(Some("p1"), "key.create", 14)).await.unwrap();
    store
        .add_key(&key("k3", "default", Role::Operator, 3), &entry(Some("default"), "key.create", 15))
        .await
        .unwrap();
    let clash = ApiKeyRecord { id: "k4".into(), key_hash: [4; 32], ..key("k1", "p1", Role::Viewer, 1) };
    assert!(matches!(
        store.add_key(&clash, &entry(Some("p1"), "key.create", 16)).await,
        Err(StoreError::Conflict(_))
    ));
    assert!(store.add_key(&key("k5", "nope", Role::Owner, 5), &entry(None, "key.create", 17)).await.is_err());
    assert_eq!(store.key_by_hash(&[2; 32]).await.unwrap(), key("k2", "p1", Role::Viewer, 2));
    assert!(matches!(store.key_by_hash(&[9; 32]).await, Err(StoreError::NotFound(_))));
    let ids: Vec<String> = store.keys("p1").await.unwrap().into_iter().map(|k| k.id).collect();
    assert_eq!(ids, ["k1", "k2"]);
    let revoked = store.revoke_key("p1", "k2", 50, &entry(Some("p1"), "key.revoke", 18)).await.unwrap();
    assert_eq!(revoked.revoked_at, Some(50));
    assert_eq!(
        store.revoke_key("p1", "k2", 60, &entry(Some("p1"), "key.revoke", 19)).await.unwrap().revoked_at,
        Some(50)
    );
    // Another project's key is not found through this one.
    assert!(matches!(
        store.revoke_key("p1", "k3", 70, &entry(Some("p1"), "key.revoke", 20)).await,
        Err(StoreError::NotFound(_))
    ));
    assert_eq!(store.key_by_hash(&[3; 32]).await.unwrap().revoked_at, None);
    store
        .audit(&AuditRecord {
            outcome: "forbidden".into(),
            status: 403,
            ..entry(Some("p1"), "task.pause", 21)
        })
        .await
        .unwrap();

    // The log: exactly the entries whose changes committed, and the
    // refusal written on its own, newest first.
    let actions = |entries: &[AuditRecord]| -> Vec<(String, i64)> {
        entries.iter().map(|e| (e.action.clone(), e.at)).collect()
    };
    let all = store.audit_log(None, None, 100).await.unwrap();
    let expected: Vec<(String, i64)> = [
        ("task.pause", 21),
        ("key.revoke", 19),
        ("key.revoke", 18),
        ("key.create", 15),
        ("key.create", 14),
        ("key.create", 13),
        ("task.stop", 11),
        ("task.create", 9),
        ("project.owner_quotas", 8),
        ("project.quotas", 7),
        ("project.create", 5),
    ]
    .into_iter()
    .map(|(a, t)| (a.to_string(), t))
    .collect();
    assert_eq!(actions(&all), expected);
    assert!(all.windows(2).all(|w| w[0].seq > w[1].seq), "seq ascends with time");
    assert_eq!(all[0].outcome, "forbidden");
    assert_eq!(all[1].address.as_deref(), Some("127.0.0.1"));
    let defaults = store.audit_log(Some("default"), None, 100).await.unwrap();
    assert_eq!(actions(&defaults), [("key.create".to_string(), 15)]);
    // Pages: three at a time, the next before the last seq.
    let first = store.audit_log(Some("p1"), None, 3).await.unwrap();
    let second = store.audit_log(Some("p1"), Some(first[2].seq), 3).await.unwrap();
    let named = |list: &[(&str, i64)]| -> Vec<(String, i64)> {
        list.iter().map(|(a, t)| (a.to_string(), *t)).collect()
    };
    assert_eq!(actions(&first), named(&[("task.pause", 21), ("key.revoke", 19), ("key.revoke", 18)]));
    assert_eq!(actions(&second), named(&[("key.create", 14), ("key.create", 13), ("task.stop", 11)]));
    // Pruned by age.
    assert_eq!(store.prune_audit(10).await.unwrap(), 4);
    assert_eq!(store.audit_log(None, None, 100).await.unwrap().len(), expected.len() - 4);
}

/// A database migrated before projects existed, with a task in it: the
/// migration puts the task in the project `default` (which the admin token
/// holds) and everything else about it stays.
async fn a_database_from_before_projects_keeps_its_tasks(url: &str, backend: &str) {
    let old = tempfile::tempdir().unwrap();
    let migrations = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations").join(backend);
    for entry in std::fs::read_dir(&migrations).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if name.as_str() < "0009" {
            std::fs::copy(&path, old.path().join(&name)).unwrap();
        }
    }
    sqlx::any::install_default_drivers();
    let pool = sqlx::AnyPool::connect(url).await.unwrap();
    sqlx::migrate::Migrator::new(old.path()).await.unwrap().run(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO tasks (id, name, spec, status, enrollment_token_hash, created_at, updated_at) \
         VALUES ('t', 'task t', '{\"rounds\":3}', 'paused', $1, 1, 2)",
    )
    .bind(token_hash("t").to_vec())
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    let store = SqlStore::connect(url).await.unwrap();
    let stored = store.task("t").await.unwrap();
    assert_eq!(stored, TaskRecord { status: TaskStatus::Paused, updated_at: 2, ..task("t", 1) });
    assert_eq!(stored.project_id, "default");
    assert_eq!(store.project("default").await.unwrap().name, "default");
    store.close().await;
}

#[tokio::test]
async fn a_sqlite_database_from_before_projects_keeps_its_tasks() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}?mode=rwc", dir.path().join("old.db").display());
    a_database_from_before_projects_keeps_its_tasks(&url, "sqlite").await;
}

#[tokio::test]
async fn a_postgres_database_from_before_projects_keeps_its_tasks() {
    let fixture = Fixture::postgres().await;
    // A fresh, empty database of its own.
    let Cleanup::Database { admin_url, name } = &fixture.cleanup else { unreachable!() };
    let mut admin = sqlx::PgConnection::connect(admin_url).await.unwrap();
    let old = format!("{name}_old");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {old}")))
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {old}"))).execute(&mut admin).await.unwrap();
    let (base, _) = admin_url.rsplit_once('/').unwrap();
    a_database_from_before_projects_keeps_its_tasks(&format!("{base}/{old}"), "postgres").await;
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {old}")))
        .execute(&mut admin)
        .await
        .unwrap();
    fixture.finish().await;
}

/// The admin event streams a project's keys hold, counted over the live
/// replicas: a dead replica's rows go, projects count apart, a closed
/// stream frees its place, and concurrent openings never pass the quota.
async fn admin_streams_count_across_live_replicas(store: &SqlStore) {
    for (id, now) in [("a", 100), ("b", 100), ("c", 50)] {
        store.heartbeat(&replica(id, now)).await.unwrap();
    }
    let open = |id: &'static str, project: &'static str, replica: &'static str, most: u32| {
        let store = store.clone();
        async move { store.open_admin_stream(id, project, replica, 90, most, 100).await.unwrap() }
    };
    // c was live when it opened s0; at 90 it is not, and s0 goes.
    assert_eq!(store.open_admin_stream("s0", "default", "c", 0, 10, 50).await.unwrap(), Ok(()));
    assert_eq!(open("s1", "default", "a", 2).await, Ok(()));
    assert_eq!(open("s2", "default", "b", 2).await, Ok(()));
    assert_eq!(open("s3", "default", "a", 2).await, Err(2), "a's and b's streams count together");
    assert_eq!(open("s4", "other", "a", 1).await, Ok(()), "another project counts apart");
    store.close_admin_stream("s1").await.unwrap();
    assert_eq!(open("s3", "default", "a", 2).await, Ok(()), "a closed stream frees its place");
    store.close_admin_stream("s2").await.unwrap();
    store.close_admin_stream("s3").await.unwrap();
    // Eight at once for three places: exactly three.
    let racing: Vec<_> = (0..8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                store.open_admin_stream(&format!("r{i}"), "default", "a", 90, 3, 100).await.unwrap()
            })
        })
        .collect();
    let mut admitted = 0;
    for race in racing {
        match race.await.unwrap() {
            Ok(()) => admitted += 1,
            Err(open) => assert_eq!(open, 3),
        }
    }
    assert_eq!(admitted, 3);
}

/// Opens `store`'s credential cache as the service does: at once on
/// SQLite; on PostgreSQL with a listener (returned, to abort), once it
/// listens.
async fn remembering(store: &SqlStore, url: &str) -> Option<tokio::task::JoinHandle<()>> {
    let listener = store.keep_credentials(url).unwrap().map(tokio::spawn);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !store.credentials().is_open() {
        assert!(std::time::Instant::now() < deadline, "the credential cache did not open");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    listener
}

/// A store's lookups answered from memory and from the database.
fn counted(
    store: &SqlStore,
) -> (prometheus_client::metrics::counter::Counter, prometheus_client::metrics::counter::Counter) {
    let (memory, database) = Default::default();
    store.credentials().count_into(Clone::clone(&memory), Clone::clone(&database));
    (memory, database)
}

/// With its cache open, a store answers a credential's second lookup from
/// memory, writes a check-in once per `TOUCH_EVERY`, and forgets a task's
/// credentials the moment it revokes one of its tokens or deletes it.
async fn a_remembered_credential_follows_the_store_s_own_changes(store: &SqlStore, url: &str) {
    let listener = remembering(store, url).await;
    let (memory, database) = counted(store);
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    let app = EnrollmentTokenRecord {
        id: "app".into(),
        task_id: "t".into(),
        name: "android".into(),
        token_hash: [42; 32],
        rate: None,
        created_at: 10,
        revoked_at: None,
    };
    store.add_enrollment_token(&app, None).await.unwrap();
    store
        .add_participant(&ParticipantRecord { token_id: Some("app".into()), ..participant("p1", "t", 1) })
        .await
        .unwrap();
    store.add_participant(&participant("p2", "t", 2)).await.unwrap();
    for _ in 0..3 {
        assert_eq!(store.participant_by_credential(&[1; 32]).await.unwrap().expires_at, 10_000);
    }
    assert_eq!((memory.get(), database.get()), (2, 1));
    // An unknown credential is never remembered.
    for _ in 0..2 {
        assert!(matches!(store.participant_by_credential(&[9; 32]).await, Err(StoreError::NotFound(_))));
    }
    assert_eq!((memory.get(), database.get()), (2, 3));
    // The first check-in is written, the next within TOUCH_EVERY is not.
    store.touch_participant("p2", 500).await.unwrap();
    store.touch_participant("p2", 600).await.unwrap();
    let seen: Vec<i64> = store
        .participants("t")
        .await
        .unwrap()
        .iter()
        .filter(|p| p.id == "p2")
        .map(|p| p.last_seen_at)
        .collect();
    assert_eq!(seen, [500]);
    assert!(matches!(store.touch_participant("ghost", 1).await, Err(StoreError::NotFound(_))));
    store.revoke_enrollment_token("t", "app", 700, None).await.unwrap();
    assert_eq!(store.participant_by_credential(&[1; 32]).await.unwrap().expires_at, 700);
    assert_eq!(store.participant_by_credential(&[2; 32]).await.unwrap().task_id, "t");
    store.delete_task("t", None).await.unwrap();
    assert!(matches!(store.participant_by_credential(&[2; 32]).await, Err(StoreError::NotFound(_))));
    // Its check-ins are written (and refused) again.
    assert!(matches!(store.touch_participant("p2", 800).await, Err(StoreError::NotFound(_))));
    if let Some(listener) = listener {
        listener.abort();
    }
}

/// Waits up to 5 s for `check` to hold of `store`'s lookup of `credential`.
async fn soon(
    store: &SqlStore,
    credential: u8,
    check: impl Fn(&Result<ParticipantRecord, StoreError>) -> bool,
) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let found = store.participant_by_credential(&[credential; 32]).await;
        if check(&found) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "replica B still answers {found:?}");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Two replicas on one PostgreSQL database: what one revokes or deletes,
/// the other stops answering from memory as soon as the notification
/// arrives (well within its cache's one-minute bound), and a replica whose
/// listening connection was cut forgets everything it remembered before.
#[tokio::test]
async fn postgres_replicas_forget_what_another_revoked_or_deleted() {
    let fixture = Fixture::postgres().await;
    let Cleanup::Database { admin_url, name } = &fixture.cleanup else { unreachable!() };
    let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
    let a = &fixture.store;
    let b = SqlStore::connect(&url).await.unwrap();
    let listeners = [remembering(a, &url).await, remembering(&b, &url).await];
    let (memory, _) = counted(&b);
    a.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    for (id, token) in [("app", [42; 32]), ("web", [43; 32])] {
        let record = EnrollmentTokenRecord {
            id: id.into(),
            task_id: "t".into(),
            name: id.into(),
            token_hash: token,
            rate: None,
            created_at: 10,
            revoked_at: None,
        };
        a.add_enrollment_token(&record, None).await.unwrap();
    }
    for (p, credential, token) in [("p1", 1, "app"), ("p2", 2, "t"), ("p3", 3, "web")] {
        a.add_participant(&ParticipantRecord {
            token_id: Some(token.into()),
            ..participant(p, "t", credential)
        })
        .await
        .unwrap();
    }
    for credential in [1, 2, 3, 1, 2, 3] {
        assert_eq!(b.participant_by_credential(&[credential; 32]).await.unwrap().expires_at, 10_000);
    }
    assert_eq!(memory.get(), 3, "B answers each second lookup from memory");
    // A revokes: B's next lookups see it.
    a.revoke_enrollment_token("t", "app", 700, None).await.unwrap();
    soon(&b, 1, |found| found.as_ref().is_ok_and(|p| p.expires_at == 700)).await;
    assert_eq!(b.participant_by_credential(&[2; 32]).await.unwrap().expires_at, 10_000);
    // B's listening connection is cut; A revokes while B may not hear it.
    // Whatever B heard, it does not answer from before the cut.
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    let cut = sqlx::query_scalar::<_, bool>(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND application_name = 'cohort-credentials'",
    )
    .fetch_all(&mut admin)
    .await
    .unwrap();
    assert_eq!(cut.len(), 2, "each replica listens on a connection of its own");
    a.revoke_enrollment_token("t", "web", 800, None).await.unwrap();
    soon(&b, 3, |found| found.as_ref().is_ok_and(|p| p.expires_at == 800)).await;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !(a.credentials().is_open() && b.credentials().is_open()) {
        assert!(std::time::Instant::now() < deadline, "the listeners did not listen again");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // Listening again, B remembers again, and hears A's deletion.
    for _ in 0..2 {
        b.participant_by_credential(&[2; 32]).await.unwrap();
    }
    a.delete_task("t", None).await.unwrap();
    soon(&b, 2, |found| matches!(found, Err(StoreError::NotFound(_)))).await;
    admin.close().await.unwrap();
    for listener in listeners.into_iter().flatten() {
        listener.abort();
        let _ = listener.await;
    }
    b.close().await;
    // The listeners' connections end with their tasks; the database is
    // dropped once the server has seen them go.
    let mut admin = sqlx::PgConnection::connect(&url).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
         AND application_name = 'cohort-credentials'",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap()
        > 0
        && std::time::Instant::now() < deadline
    {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    admin.close().await.unwrap();
    fixture.finish().await;
}

/// An enrollment stored while a revocation of its token is in progress
/// waits for it, and is refused: no credential of a revoked token
/// survives the revocation.
#[tokio::test]
async fn postgres_an_enrollment_racing_a_revocation_waits_and_is_refused() {
    let fixture = Fixture::postgres().await;
    let Cleanup::Database { admin_url, name } = &fixture.cleanup else { unreachable!() };
    let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
    let store = fixture.store.clone();
    store.create_task(&task("t", 1), &checkpoint("t", 0), None).await.unwrap();
    let app = EnrollmentTokenRecord {
        id: "app".into(),
        task_id: "t".into(),
        name: "android".into(),
        token_hash: [42; 32],
        rate: None,
        created_at: 10,
        revoked_at: None,
    };
    store.add_enrollment_token(&app, None).await.unwrap();
    // A revocation's first statement, not yet committed.
    let mut revoking = sqlx::PgConnection::connect(&url).await.unwrap();
    sqlx::raw_sql("BEGIN; UPDATE enrollment_tokens SET revoked_at = 700 WHERE id = 'app'")
        .execute(&mut revoking)
        .await
        .unwrap();
    let enrolling = tokio::spawn(async move {
        let p = ParticipantRecord { token_id: Some("app".into()), ..participant("p1", "t", 1) };
        store.add_participant(&p).await
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!enrolling.is_finished(), "the enrollment waits for the revocation");
    sqlx::raw_sql(
        "UPDATE participants SET expires_at = 700 WHERE token_id = 'app' AND expires_at > 700; COMMIT",
    )
    .execute(&mut revoking)
    .await
    .unwrap();
    assert!(matches!(enrolling.await.unwrap(), Err(StoreError::Revoked)));
    assert!(matches!(fixture.store.participant_by_credential(&[1; 32]).await, Err(StoreError::NotFound(_))));
    revoking.close().await.unwrap();
    fixture.finish().await;
}

#[tokio::test]
async fn sqlite_remembered_credentials_follow_the_store_s_own_changes() {
    let fixture = Fixture::sqlite().await;
    let Cleanup::File(path) = &fixture.cleanup else { unreachable!() };
    a_remembered_credential_follows_the_store_s_own_changes(
        &fixture.store,
        &format!("sqlite://{}", path.display()),
    )
    .await;
    fixture.finish().await;
}

#[tokio::test]
async fn postgres_remembered_credentials_follow_the_store_s_own_changes() {
    let fixture = Fixture::postgres().await;
    let Cleanup::Database { admin_url, name } = &fixture.cleanup else { unreachable!() };
    let url = format!("{}/{name}", admin_url.rsplit_once('/').unwrap().0);
    a_remembered_credential_follows_the_store_s_own_changes(&fixture.store, &url).await;
    fixture.finish().await;
}

macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test]
            async fn $name() {
                let fixture = super::Fixture::sqlite().await;
                super::$name(&fixture.store).await;
                fixture.finish().await;
            })*
        }
        mod postgres {
            $(#[tokio::test]
            async fn $name() {
                let fixture = super::Fixture::postgres().await;
                super::$name(&fixture.store).await;
                fixture.finish().await;
            })*
        }
    };
}

on_both_backends!(
    tasks_and_status,
    participants_and_credentials,
    enrollment_tokens_per_application,
    rounds_are_atomic_ordered_and_pruned,
    client_metrics_once_per_round,
    round_contributors_last_until_their_round_completes,
    exclusions_are_kept_once_per_task_and_fenced,
    replicas_and_task_leases,
    writes_are_fenced_by_the_lease_generation,
    a_deleted_task_leaves_nothing_behind,
    round_groups_between_leader_and_owners,
    projects_keys_and_the_audit_log,
    admin_streams_count_across_live_replicas,
);

#[tokio::test]
async fn sqlite_file_is_created_and_persists() {
    let path = std::env::temp_dir().join(format!("cohort-persist-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    data_survives_reconnection(&format!("sqlite://{}", path.display())).await;
    assert!(path.exists());
    std::fs::remove_file(path).unwrap();
}

#[tokio::test]
async fn postgres_data_persists_across_connections() {
    let fixture = Fixture::postgres().await;
    fixture.store.close().await;
    let Cleanup::Database { admin_url, name } = &fixture.cleanup else { unreachable!() };
    let (base, _) = admin_url.rsplit_once('/').unwrap();
    data_survives_reconnection(&format!("{base}/{name}")).await;
    fixture.finish().await;
}

#[tokio::test]
async fn unknown_database_urls_are_refused() {
    match SqlStore::connect("mysql://localhost/x").await {
        Err(StoreError::Config(why)) => assert!(why.contains("sqlite: or postgres://"), "{why}"),
        other => panic!("a MySQL URL was not refused as configuration: {other:?}"),
    }
}
