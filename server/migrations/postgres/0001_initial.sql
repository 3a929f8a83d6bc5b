-- Tasks, their participants, completed rounds, checkpoints and client metrics.
-- Times are Unix milliseconds. Secrets are stored only as SHA-256 hashes.
CREATE TABLE tasks (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    enrollment_token_hash BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    updated_at BIGINT NOT NULL
);

CREATE TABLE participants (
    id TEXT PRIMARY KEY NOT NULL,
    task_id TEXT NOT NULL REFERENCES tasks (id),
    credential_hash BYTEA NOT NULL UNIQUE,
    enrolled_at BIGINT NOT NULL,
    last_seen_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE INDEX participants_by_task ON participants (task_id);

CREATE TABLE rounds (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round BIGINT NOT NULL,
    started_at BIGINT NOT NULL,
    finished_at BIGINT NOT NULL,
    selected BIGINT NOT NULL,
    survivors BIGINT NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (task_id, round)
);

CREATE TABLE checkpoints (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round BIGINT NOT NULL,
    model BYTEA NOT NULL,
    optimizer_state BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (task_id, round)
);

CREATE TABLE client_metrics (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round BIGINT NOT NULL,
    participant_id TEXT NOT NULL REFERENCES participants (id),
    kind TEXT NOT NULL,
    metrics TEXT NOT NULL,
    reported_at BIGINT NOT NULL,
    PRIMARY KEY (task_id, round, participant_id, kind)
);
