CREATE TABLE conversations (
    id              UUID PRIMARY KEY,
    organization_id TEXT NOT NULL,
    title           TEXT NOT NULL,
    model           TEXT NOT NULL,
    metadata        JSONB NOT NULL,           -- object of strings
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL,
    message_count   INTEGER NOT NULL DEFAULT 0
);
-- Listing walks this index newest first; page tokens are keyset cursors on (updated_at_ms, id).
CREATE INDEX conversations_by_recency ON conversations (organization_id, updated_at_ms DESC, id DESC);

CREATE TABLE conversation_messages (
    conversation_id UUID NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq             INTEGER NOT NULL CHECK (seq >= 0),
    id              UUID NOT NULL UNIQUE,
    role            TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant', 'tool')),
    content         TEXT NOT NULL,
    partial         BOOLEAN NOT NULL,
    model           TEXT NOT NULL,
    created_at_ms   BIGINT NOT NULL,
    PRIMARY KEY (conversation_id, seq)
);

-- One row per stored AppendMessages call: a retry with the same key finds what the first stored.
CREATE TABLE conversation_appends (
    conversation_id UUID NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    idempotency_key TEXT NOT NULL,
    first_seq       INTEGER NOT NULL,
    count           INTEGER NOT NULL CHECK (count > 0),
    PRIMARY KEY (conversation_id, idempotency_key)
);
