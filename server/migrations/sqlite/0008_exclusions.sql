-- Participants a validated task excluded: every group they were in failed
-- its sum check (the unmasked sum did not open the members' commitments)
-- until each was the one suspect left (server/src/round/suspects.rs).
-- They are never selected again, also after a restart; their check-ins
-- are refused with `excluded`.
CREATE TABLE participant_exclusions (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    participant_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    excluded_at INTEGER NOT NULL,
    PRIMARY KEY (task_id, participant_id)
);
