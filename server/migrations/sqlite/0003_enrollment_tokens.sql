-- Enrollment tokens per application: several per task, each named,
-- revocable and rate-limited on its own (per_minute and burst; NULL for the
-- server's default). Stored only as SHA-256 hashes. A task's existing token
-- becomes the one named "default", with the task's id as its id.
CREATE TABLE enrollment_tokens (
    id TEXT PRIMARY KEY NOT NULL,
    task_id TEXT NOT NULL REFERENCES tasks (id),
    name TEXT NOT NULL,
    token_hash BLOB NOT NULL UNIQUE,
    per_minute INTEGER,
    burst INTEGER,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER,
    UNIQUE (task_id, name)
);
INSERT INTO enrollment_tokens (id, task_id, name, token_hash, created_at)
    SELECT id, id, 'default', enrollment_token_hash, created_at FROM tasks;

-- The token each participant enrolled with (NULL before tokens had ids).
ALTER TABLE participants ADD COLUMN token_id TEXT REFERENCES enrollment_tokens (id);
UPDATE participants SET token_id = task_id;
CREATE INDEX participants_by_token ON participants (token_id);
