-- The limits a project's owners set for it, within the operator's
-- (`quotas`): JSON like `quotas`; a project's effective limit of each
-- kind is the lower of the two.
ALTER TABLE projects ADD COLUMN owner_quotas TEXT NOT NULL DEFAULT '{}';
