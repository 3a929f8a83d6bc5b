-- Groups of a round that its leader handed to other replicas (owners).
-- The leader writes the assignment (roster, identity keys, public seeds);
-- the owner claims it (state 'assigned' -> 'running'), renews expires_at
-- with its task leases, reports its stage and settles it ('done' with the
-- group's decoded sum in mean, or 'failed'). A group whose owner's lease
-- lapsed is marked 'lost' by the leader. The leader deletes a task's rows
-- when its round is stored or given up, and when it takes the task over.
CREATE TABLE round_groups (
    task_id TEXT NOT NULL REFERENCES tasks (id),
    round INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    group_index INTEGER NOT NULL,
    leader_id TEXT NOT NULL,
    owner_id TEXT NOT NULL,
    owner_url TEXT NOT NULL,
    assignment TEXT NOT NULL,
    state TEXT NOT NULL,
    stage TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    report TEXT,
    mean BLOB,
    PRIMARY KEY (task_id, round, attempt, group_index)
);
CREATE INDEX round_groups_owner ON round_groups (owner_id, state);
CREATE INDEX round_groups_leader ON round_groups (leader_id);
