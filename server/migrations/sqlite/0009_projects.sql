-- Projects: the tenants of a shared coordinator. Every task belongs to
-- one; the tasks that existed before go to the project `default`, which
-- the deployment's admin token (COHORT_ADMIN_TOKEN) holds as it holds
-- every project. `quotas` is the project's limits as JSON (absent
-- fields: no limit beyond the server's own).
CREATE TABLE projects (
    id TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    quotas TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
INSERT INTO projects (id, name, quotas, created_at) VALUES ('default', 'default', '{}', 0);

-- SQLite cannot add a column that REFERENCES another table with a default
-- to a table that has rows: triggers keep the reference instead.
ALTER TABLE tasks ADD COLUMN project_id TEXT NOT NULL DEFAULT 'default';
CREATE INDEX tasks_by_project ON tasks (project_id);
CREATE TRIGGER tasks_project_exists BEFORE INSERT ON tasks
WHEN NOT EXISTS (SELECT 1 FROM projects WHERE id = NEW.project_id)
BEGIN
    SELECT RAISE(ABORT, 'FOREIGN KEY constraint failed: tasks.project_id');
END;
CREATE TRIGGER tasks_project_stays BEFORE UPDATE OF project_id ON tasks
WHEN NOT EXISTS (SELECT 1 FROM projects WHERE id = NEW.project_id)
BEGIN
    SELECT RAISE(ABORT, 'FOREIGN KEY constraint failed: tasks.project_id');
END;
CREATE TRIGGER projects_keep_their_tasks BEFORE DELETE ON projects
WHEN EXISTS (SELECT 1 FROM tasks WHERE project_id = OLD.id)
BEGIN
    SELECT RAISE(ABORT, 'FOREIGN KEY constraint failed: tasks.project_id');
END;

-- A project's API keys: 256-bit secrets shown once and stored only as
-- SHA-256 hashes, each with a role (owner, operator, viewer), an
-- optional expiry and its revocation.
CREATE TABLE api_keys (
    id TEXT PRIMARY KEY NOT NULL,
    project_id TEXT NOT NULL REFERENCES projects (id),
    name TEXT NOT NULL,
    role TEXT NOT NULL,
    key_hash BLOB NOT NULL UNIQUE,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    revoked_at INTEGER,
    created_by TEXT NOT NULL,
    UNIQUE (project_id, name)
);

-- Every admin action: who (the admin token, or a key and its role), what,
-- on which resource, from which address, when, and how it ended. A
-- change and its entry are written in one transaction; a refusal is
-- written on its own. `project_id` is NULL for an action on no project
-- (one the admin token took on the deployment). Pruned after the
-- configured retention.
CREATE TABLE audit_log (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    at INTEGER NOT NULL,
    project_id TEXT,
    actor TEXT NOT NULL,
    role TEXT NOT NULL,
    action TEXT NOT NULL,
    resource TEXT NOT NULL,
    address TEXT,
    outcome TEXT NOT NULL,
    status INTEGER NOT NULL,
    message TEXT NOT NULL
);
CREATE INDEX audit_log_by_project ON audit_log (project_id, seq);
CREATE INDEX audit_log_by_time ON audit_log (at);

-- The enrollments_per_minute quota counts a project's recent enrollments.
CREATE INDEX participants_by_enrollment ON participants (task_id, enrolled_at);
