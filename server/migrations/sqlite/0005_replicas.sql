-- The cohort serve processes sharing this database: each registers at
-- start with the URL the others reach it at, and beats every second.
CREATE TABLE replicas (
    id TEXT PRIMARY KEY,
    url TEXT NOT NULL,
    started_at INTEGER NOT NULL,
    heartbeat_at INTEGER NOT NULL
);
-- Which replica leads each task's rounds, until when. A replica renews
-- its leases every second; another takes a lease over once it expired,
-- and the generation counts the owners.
CREATE TABLE task_leases (
    task_id TEXT PRIMARY KEY REFERENCES tasks (id),
    replica_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    expires_at INTEGER NOT NULL
);
