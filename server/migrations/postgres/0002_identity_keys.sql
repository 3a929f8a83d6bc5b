-- Each participant's Ed25519 identity public key (32 bytes), registered at
-- enrollment; it signs the participant's round keys and survivor lists in
-- the active variant. NULL for participants enrolled before identities.
ALTER TABLE participants ADD COLUMN identity_key BYTEA;
CREATE UNIQUE INDEX participants_by_identity ON participants (task_id, identity_key);
