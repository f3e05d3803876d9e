"""A huge prompt is tokenized off the worker's event loop: while a 2 MB prompt is rendered and
tokenized (about a second or more here), another stream on the same worker keeps receiving tokens,
and the huge prompt is still refused by the context check (INVALID_ARGUMENT, nothing queued).

Before the fix the tokenizer ran in the gRPC handler, on the event loop that carries every stream:
the other stream's largest gap between tokens was the whole tokenization time.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from llmserve.v1 import worker_pb2_grpc
from tests.reliability.clients import chat_request, wait_idle

HUGE_PROMPT = "lorem ipsum dolor sit amet " * 80_000      # 2.2 MB: under the worker's 4 M character bound
MESSAGE_LIMIT = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


async def test_a_huge_prompt_does_not_stall_other_streams(platform):
    address = platform.workers[0].address
    async with grpc.aio.insecure_channel(address, options=MESSAGE_LIMIT) as channel:
        stub = worker_pb2_grpc.GenerationStub(channel)
        steady = stub.Generate(chat_request("Count from 1 to 1000, one number per line.", 600, ignore_eos=True),
                               timeout=180)
        arrivals: list[float] = []

        async def read_tokens():
            while await steady.read() is not grpc.aio.EOF:
                arrivals.append(time.monotonic())

        reader = asyncio.create_task(read_tokens())
        try:
            while len(arrivals) < 5:                            # the stream is decoding steadily
                assert not reader.done(), "the steady stream ended early"
                await asyncio.sleep(0.05)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(chat_request(HUGE_PROMPT, 8), timeout=120).read()
            ended = time.monotonic()
            await asyncio.sleep(0.3)                            # one more token after the window
        finally:
            steady.cancel()
            reader.cancel()
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert "context" in refused.value.details()            # the bad-input limit still applies
        stall = ended - started
        window = [t for t in arrivals if t >= started]
        gaps = [b - a for a, b in zip([max(t for t in arrivals if t < started)] + window, window)]
        largest = max(gaps)
        print(f"huge prompt refused after {stall:.2f}s; {len(window)} tokens meanwhile, largest gap {largest:.3f}s")
        assert stall > 0.4, f"the huge prompt took only {stall:.2f}s: too short to show a stall"
        assert len([t for t in window if t <= ended]) >= 3, "the other stream did not move during tokenization"
        assert largest < min(0.5, stall / 2), f"the other stream stalled {largest:.2f}s (tokenization {stall:.2f}s)"
    wait_idle(address)
