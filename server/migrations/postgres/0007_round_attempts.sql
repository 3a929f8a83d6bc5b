-- Attempts of a round that ended without a new model (aborted: too few
-- clients; abandoned: the model could not be computed), with the stage
-- they stopped in and why: counts and times only, nothing about any one
-- client. The newest 500 of a task are kept.
CREATE TABLE round_attempts (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round BIGINT NOT NULL,
    attempt BIGINT NOT NULL,
    outcome TEXT NOT NULL,
    stage TEXT NOT NULL,
    reason TEXT NOT NULL,
    selected BIGINT NOT NULL,
    started_at BIGINT NOT NULL,
    ended_at BIGINT NOT NULL,
    stages TEXT NOT NULL
);
CREATE INDEX round_attempts_by_task ON round_attempts (task_id, ended_at);
