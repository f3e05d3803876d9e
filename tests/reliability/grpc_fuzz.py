"""Malformed and random GenerateRequests for fuzzing a Generation server (worker or router).

Two generators from one seeded Random: `random_bytes` (whatever the wire carries, decodable or not)
and `random_request` (a well-formed protobuf whose every field takes odd values: empty, huge,
negative, NaN, out of the vocabulary). `send_raw` posts bytes through a generic stream call, bypassing
the stub's serializer, so undecodable messages reach the server.
"""

from __future__ import annotations

import math
import random

import grpc

from llmserve.v1 import worker_pb2 as pb

GENERATE = "/llmserve.v1.Generation/Generate"
ODD_FLOATS = [0.0, -0.0, 1e-45, -1.0, 0.5, 1.0, 2.0, 2.0000002, 3.0, 1e38, -1e38, math.inf, -math.inf, math.nan]
ODD_INTS = [0, 1, -1, 2, 16, 17, 49151, 49152, 2**31 - 1, -2**31]
ODD_UINTS = [0, 1, 2, 16, 17, 20, 21, 1024, 4096, 2**31, 2**32 - 1]
ODD_STRINGS = ["", " ", "\x00", "user", "system", "robot", "é" * 3, "\ud7ff", "a" * 10_000, "<|im_end|>", "\n" * 50]


def random_bytes(rng: random.Random) -> bytes:
    """Random bytes, or a valid message with its bytes flipped, cut or padded."""
    kind = rng.randrange(4)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 256))
    valid = bytearray(random_request(rng).SerializeToString())
    if kind == 1 and valid:
        for _ in range(rng.randrange(1, 8)):
            valid[rng.randrange(len(valid))] = rng.randrange(256)
    elif kind == 2:
        valid = valid[: rng.randrange(len(valid) + 1)]
    else:
        valid += rng.randbytes(rng.randrange(1, 32))
    return bytes(valid)


def random_request(rng: random.Random, oddity: float = 0.12) -> pb.GenerateRequest:
    """Each field odd with probability `oddity`, so a share of requests stays valid (and runs)."""
    def odd() -> bool:
        return rng.random() < oddity

    request = pb.GenerateRequest(request_id=rng.choice(["x" * 300, "\x00id", "r"]) if odd() else "",
                                 model=rng.choice(["nope", "\x00", ""]) if odd() else "smollm2-135m-instruct",
                                 cache_salt=rng.choice(["org_1", "s" * 1000]) if odd() else "")
    prompt = rng.randrange(4) if odd() else 0
    if prompt == 0:
        request.chat.CopyFrom(pb.ChatPrompt(messages=[
            pb.ChatMessage(role=rng.choice(ODD_STRINGS[:7]) if odd() else "user",
                           content=rng.choice(ODD_STRINGS) if odd() else "Say something.")
            for _ in range(rng.choice([0, 2, 5]) if odd() else 1)]))
    elif prompt == 1:
        request.text = rng.choice(ODD_STRINGS)
    elif prompt == 2:
        request.token_ids.CopyFrom(pb.TokenIdsPrompt(ids=[rng.choice(ODD_INTS) for _ in range(rng.choice([0, 1, 3, 40]))]))
    s = request.sampling
    s.max_tokens = rng.choice([1, 2, 4])   # accepted requests stay short: the fuzz is about refusals
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if odd():
            setattr(s, name, rng.choice(ODD_FLOATS))
    if odd():
        s.top_k = rng.choice(ODD_INTS)
    for name in ("max_tokens", "top_logprobs", "n", "num_speculative_tokens", "min_tokens"):
        if odd():
            setattr(s, name, rng.choice([v for v in ODD_UINTS if v <= 8 or v > 16]))
    s.max_tokens = s.max_tokens or 1       # 0 would mean "up to the context": no long valid runs
    if odd():
        s.seed = rng.choice([0, -1, 2**63 - 1, -2**63, 42])
    if odd():
        s.stop.extend(rng.choice(ODD_STRINGS) for _ in range(rng.choice([1, 4, 17])))
    if odd():
        s.stop_token_ids.extend(rng.choice(ODD_INTS) for _ in range(rng.choice([1, 3])))
    s.ignore_eos = odd()
    s.logprobs = odd()
    return request


def send_raw(channel: grpc.aio.Channel, payload: bytes, timeout: float):
    """A Generate call carrying `payload` as its serialized request (no client-side encoding)."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    return call(payload, timeout=timeout)
