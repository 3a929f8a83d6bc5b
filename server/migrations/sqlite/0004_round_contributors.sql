-- The participants each attempt of a round asked for their masked input,
-- recorded before they are asked (a JSON array of participant ids). A
-- client sends one masked input per round number, so these refuse every
-- re-run of the round (after a failed unmasking or a crash of the
-- coordinator) and are not selected for it again. Deleted when the round
-- completes.
CREATE TABLE round_contributors (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round INTEGER NOT NULL,
    participants TEXT NOT NULL,
    recorded_at INTEGER NOT NULL
);
CREATE INDEX round_contributors_by_round ON round_contributors (task_id, round);
