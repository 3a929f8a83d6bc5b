-- The admin event streams a project's keys hold open, on which replica:
-- with replicas sharing this database, a project's `connections` quota
-- counts its streams on every live replica (a replica's rows count while
-- its heartbeat is fresh, and go once it is not). A row is written when
-- a stream opens and deleted when it closes.
CREATE TABLE admin_streams (
    id TEXT PRIMARY KEY,
    project_id TEXT NOT NULL,
    replica_id TEXT NOT NULL,
    opened_at INTEGER NOT NULL
);
CREATE INDEX admin_streams_by_project ON admin_streams (project_id);
