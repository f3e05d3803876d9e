"""Key hints in logs, listings and 401 messages never give a key away."""

from services.gateway.auth import hint_of


def test_long_keys_show_only_their_ends():
    assert hint_of("sk-llm-abcdefghijklmnop") == "sk-...mnop"


def test_short_tokens_reveal_nothing():
    for secret in ("abc", "sk-1234", "sk-123456789"):
        assert hint_of(secret) == "***"
