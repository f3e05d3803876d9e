"""Opaque page tokens: a keyset cursor, versioned and base64url-encoded.

Clients must treat a token as opaque; decoding checks every part so a forged or truncated token
is a clear INVALID_ARGUMENT, never a database error.
"""

from __future__ import annotations

import base64
import binascii
import uuid

from .store import Cursor

_VERSION = "v1"


def encode_page_token(cursor: Cursor) -> str:
    raw = f"{_VERSION}:{cursor.updated_at_ms}:{cursor.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> Cursor:
    """Raises ValueError for anything encode_page_token did not make."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        version, updated_at_ms, conversation_id = raw.split(":")
        if version != _VERSION or not updated_at_ms.isdigit():
            raise ValueError
        return Cursor(int(updated_at_ms), str(uuid.UUID(conversation_id)))
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise ValueError("page_token is malformed: pass next_page_token from the previous page unchanged") from None
