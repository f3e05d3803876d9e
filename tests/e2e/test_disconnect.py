"""A client that goes away mid-stream stops its generation: the worker's KV blocks come back within
seconds, long before the request could have decoded to max_tokens."""

from __future__ import annotations

import time

from tests.e2e.platform import MODELS, Platform

MAX_TOKENS = 2000          # minutes of decoding on a CPU: only an abort frees the blocks in time
FREED_WITHIN_S = 15.0


def test_disconnect_mid_stream_frees_the_workers_blocks(platform: Platform):
    model = MODELS[0]
    wait_idle(platform, model, "before the test")   # earlier tests' stopped replies are gone too
    with platform.openai(max_retries=0) as client:
        stream = client.chat.completions.create(
            model=model, stream=True, max_completion_tokens=MAX_TOKENS, temperature=0,
            messages=[{"role": "user", "content": "Write a very long story about a dragon and a knight."}])
        received = 0
        for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 3:
                break
        busy = platform.load(model)
        assert busy.running == 1 and busy.kv_blocks_used > 0
        stream.close()   # drops the HTTP connection, as a closed browser tab does
    wait_idle(platform, model, "after the disconnect")


def wait_idle(platform: Platform, model: str, when: str) -> None:
    deadline = time.monotonic() + FREED_WITHIN_S
    while (load := platform.load(model)).kv_blocks_used or load.running or load.waiting:
        assert time.monotonic() < deadline, f"KV blocks still held {FREED_WITHIN_S}s {when}: {load}"
        time.sleep(0.2)
