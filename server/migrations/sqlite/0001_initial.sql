-- Tasks, their participants, completed rounds, checkpoints and client metrics.
-- Times are Unix milliseconds. Secrets are stored only as SHA-256 hashes.
CREATE TABLE tasks (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    spec TEXT NOT NULL,
    status TEXT NOT NULL,
    enrollment_token_hash BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);

CREATE TABLE participants (
    id TEXT PRIMARY KEY NOT NULL,
    task_id TEXT NOT NULL REFERENCES tasks (id),
    credential_hash BLOB NOT NULL UNIQUE,
    enrolled_at INTEGER NOT NULL,
    last_seen_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
CREATE INDEX participants_by_task ON participants (task_id);

CREATE TABLE rounds (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round INTEGER NOT NULL,
    started_at INTEGER NOT NULL,
    finished_at INTEGER NOT NULL,
    selected INTEGER NOT NULL,
    survivors INTEGER NOT NULL,
    metrics TEXT NOT NULL,
    PRIMARY KEY (task_id, round)
);

CREATE TABLE checkpoints (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round INTEGER NOT NULL,
    model BLOB NOT NULL,
    optimizer_state BLOB NOT NULL,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (task_id, round)
);

CREATE TABLE client_metrics (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round INTEGER NOT NULL,
    participant_id TEXT NOT NULL REFERENCES participants (id),
    kind TEXT NOT NULL,
    metrics TEXT NOT NULL,
    reported_at INTEGER NOT NULL,
    PRIMARY KEY (task_id, round, participant_id, kind)
);
