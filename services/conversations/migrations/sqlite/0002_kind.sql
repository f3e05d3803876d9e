-- What a row stores: '' a chat conversation, 'response' a stored /v1/responses response.
ALTER TABLE conversations ADD COLUMN kind TEXT NOT NULL DEFAULT '';
DROP INDEX conversations_by_recency;
CREATE INDEX conversations_by_recency ON conversations (organization_id, kind, updated_at_ms DESC, id DESC);
