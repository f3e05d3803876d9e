"""make bench-load: admission through `make run` under bursts, open-loop load and competing
organizations, against the peers, in one run.

Starts `make run` (deploy/local/run.py on shifted ports, fresh SQLite files) unless --url is given,
then:
1. Burst: 32 mixed chat requests (prompts of 20-400 tokens cut from real text, answers of 16-160,
   end-of-sequence banned so every answer has its length) sent at once with the openai SDK and its
   default retries, to the default model and to the int8 pool. Served, refused, aggregate tokens/s,
   TTFT p95; the same prompts and lengths through transformers' generate in static batches of 8,
   in each pool's dtype (the default pool's `auto` resolved on this CPU; float32 for int8), and
   through llama-cpp-python's OpenAI server on the same GGUF (bench/engine.py's peers). The VM's
   speed drifts within the run, so the default pool's burst is also measured alternating with
   transformers, round by round (part `alternating`).
2. Open loop: Poisson arrivals of the same mix at 0.5x, 1x, 2x and 4x the pool's capacity (the
   requests/s 64 clients sending back to back complete): admitted TTFT p95 against unloaded,
   per-stream speed against the target,
   goodput (tokens/s that requests which met both streamed while the rate's arrivals came: a first
   token within 2x the unloaded TTFT p95 and the speed target; beside it the same at the gateway's
   own TTFT target), refusals and how fast they came back.
3. Fairness: one organization flooding with 24 concurrent streams while a second sends one short
   chat at a time (its refusals and TTFT p95 against its unloaded TTFT); two organizations of equal
   weight flooding together, then with weights 2:1 (shares of the tokens streamed), each with
   --share-streams streams, by default the gateway's overload.max_in_flight_per_model, the most its
   limit can be: both together ask twice what the pool holds, so the phase contends (12-03 ran 24
   each against a limit of 64, nobody waited and weights 2:1 gave 1.00).
Every chat of 2 and 3 is a new one (`new_chat`): only the system prompt is in the prefix cache.

    python -m bench.load [--url URL --key KEY] [--port-base 47200] [--seconds 30]
                         [--llama-python PATH] [--parts burst,alternating,poisson,fairness,peers]
                         [--share-streams N]

Writes docs/perf/load.md and docs/perf/load.json. The machine is a shared 2-core VM: absolute
figures move with what else runs, the ratios measured in one run are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench.engine import llama_cpp_peer, run_transformers, workload
from bench.timing import percentile
from services.worker.cpu_features import this_machine

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "perf"
MODEL, INT8_MODEL = "smollm2-135m-instruct", "smollm2-135m-instruct-int8"
ADMIN_TOKEN = os.environ.get("LLMSERVE_ADMIN_TOKEN", "admin-local-dev")
EOS_BAN = {"2": -100}   # SmolLM2's <|im_end|>: answers run to their max_tokens, as the peers' do
# The parts that run through `make run`. Each part's figures say when and on which machine they
# were measured ("measured"): a later run of some parts keeps the others, so load.md may mix runs.
PLATFORM_PARTS = frozenset({"burst", "alternating", "poisson", "fairness"})
LLAMA_PORT = 10         # the llama-cpp-python server listens on --port-base + this
CAPACITY_STREAMS = 64   # clients of the capacity loop: the most the gateway admits (max_in_flight_per_model)
# Each open-loop rate runs --seconds or until this many arrivals are expected, whichever is longer:
# on a 2-core VM whose pool served 0.66 requests/s, 60 s at half of it brought 22 requests, and
# their TTFT p95 was the second slowest (12-07, Zen 3 VM). At 64, the same code's p95 over unloaded
# moved by 0.2 at 0.5x and by 0.4 at 1x from one run to the next (12-07, Zen 4 VM): 128 narrows
# a p95's spread by about 1/sqrt(2), for about 70 s more at 0.5x.
MIN_ARRIVALS = 128
CHAT_NUMBERS = itertools.count(1)


# -- the workload --------------------------------------------------------------------------------

def mixed_prompts(tokenizer, n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n (chat message, answer tokens) pairs: messages of 20-400 tokens, answers of 16-160."""
    return [(tokenizer.decode(ids), olen) for ids, olen in workload(tokenizer, n, seed, (20, 400), (16, 160))]


@dataclass
class Result:
    status: int
    ttft_s: float | None = None
    latency_s: float = 0.0         # the whole response; for a refusal, how fast it came
    tokens: int = 0
    decode_s: float = 0.0          # first to last content chunk
    retry_after: bool = False
    retry_after_s: float = 0.0     # what the refusal asked for (retry-after-ms)
    org: str = ""
    chunk_times: list[float] = field(default_factory=list)
    sent_at: float = 0.0           # monotonic, when the request was sent

    @property
    def tokens_per_s(self) -> float | None:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


def new_chat(prompt: str) -> str:
    """The prompt as a chat nobody sent before: a request number ahead of it, so only the chat
    template's system prompt is in the prefix cache. The open loop and the fairness phases cycle
    through 32 prompts; sent as they are, each was a cache hit after its first time: the unloaded
    p95 was 94 ms in bfloat16 (12-03), against 0.83 s in float32 (12-02), whose cache holds half as
    many tokens and had likely evicted them under the capacity loop's 64 streams."""
    return f"({next(CHAT_NUMBERS)}) {prompt}"


async def stream_once(session: aiohttp.ClientSession, url: str, key: str, model: str, prompt: str,
                      max_tokens: int, org: str = "") -> Result:
    """One streamed chat over plain HTTP, as a new chat (no retries: refusals are counted, not hidden)."""
    body = {"model": model, "messages": [{"role": "user", "content": new_chat(prompt)}],
            "max_completion_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "logit_bias": EOS_BAN}
    start = time.monotonic()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"}) as response:
            if response.status != 200:
                await response.read()
                return Result(response.status, latency_s=time.monotonic() - start, org=org, sent_at=start,
                              retry_after="Retry-After" in response.headers,
                              retry_after_s=int(response.headers.get("retry-after-ms", "0")) / 1000)
            result = Result(200, org=org, sent_at=start)
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    result.status = 500
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    now = time.monotonic()
                    result.chunk_times.append(now)
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
            result.latency_s = time.monotonic() - start
            if len(result.chunk_times) > 1:
                result.decode_s = result.chunk_times[-1] - result.chunk_times[0]
            return result
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Result(0, latency_s=time.monotonic() - start, org=org, sent_at=start)


# -- 1. burst --------------------------------------------------------------------------------------

async def burst(url: str, key: str, model: str, prompts: list[tuple[str, int]], again: bool = False) -> dict:
    """All at once through the openai SDK with its default retries (twice, honouring Retry-After).
    `again`: a second burst on a pool that served the first, as new chats (new_chat), so only the
    chat template's system prompt is in the prefix cache (sent as they were, its prompts were all
    cache hits: TTFT p95 0.74-0.81 s)."""
    import openai

    retry_after_s: list[float] = []      # what each 429 asked for, retried or not

    async def record(response):
        if response.status_code == 429 and "retry-after-ms" in response.headers:
            retry_after_s.append(float(response.headers["retry-after-ms"]) / 1000)

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, timeout=600,
                                http_client=openai.DefaultAsyncHttpxClient(event_hooks={"response": [record]}))

    async def one(prompt: str, max_tokens: int):
        t0, ttft = time.perf_counter(), None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_completion_tokens=max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True}, logit_bias=EOS_BAN)
            tokens = 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return "ok", ttft, tokens
        except openai.RateLimitError:
            return "refused", None, 0
        except openai.APIError as e:
            return f"error {type(e).__name__}", None, 0

    async with aiohttp.ClientSession() as session:
        gauges: list[dict] = []
        sampler = asyncio.create_task(gateway_gauges(session, url, float("inf"), gauges, model))
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(new_chat(p) if again else p, m) for p, m in prompts))
        elapsed = time.perf_counter() - t0
        sampler.cancel()
        waits = await queue_waits(session, url, model)
    await client.close()
    ok = [r for r in results if r[0] == "ok"]
    tokens = sum(r[2] for r in ok)
    return dict(model=model, warm=again, requests=len(prompts), served=len(ok),
                refused=sum(r[0] == "refused" for r in results),
                errors=sorted({r[0] for r in results} - {"ok", "refused"}), tokens=tokens, seconds=elapsed,
                tps=tokens / elapsed, requests_per_s=len(ok) / elapsed,
                ttft_p50=percentile([r[1] for r in ok if r[1]], 50), ttft_p95=percentile([r[1] for r in ok if r[1]], 95),
                answered_429=len(retry_after_s), retry_after_p50=percentile(retry_after_s, 50) if retry_after_s else None,
                retry_after_max=max(retry_after_s, default=None), gateway=gauge_summary(gauges), **waits,
                gateway_trace=[{**g, "t": round(g["t"] - gauges[0]["t"])} for g in gauges])


def pool_dtypes() -> dict[str, str]:
    """Each pool's model -> the dtype its `make run` worker computes in ("auto" resolved here, on
    the same CPU): the transformers peer of a pool runs in that dtype."""
    import torch

    from services.worker.config import WorkerConfig
    from services.worker.engine.build import dtype_name, resolve_dtype
    workers = [s.config.model for s in launcher().plan({}) if isinstance(s.config, WorkerConfig)]
    return {m.name: dtype_name(resolve_dtype(m.dtype, torch.device("cpu"), m.quantization)) for m in workers}


def transformers_burst(tokenizer, prompts: list[tuple[str, int]], dtype: str) -> dict:
    return run_transformers(*warm_transformers(tokenizer, prompts, dtype))


def warm_transformers(tokenizer, prompts: list[tuple[str, int]], dtype: str):
    """The transformers model and its requests, after a short pass of a batch: timed warm, as the
    platform's pools are (each worker warms its engine before serving). A cold first pass ran about
    10% slower (68.5 against 76.4 and 72.8 tokens/s, 12-07)."""
    hf, requests = transformers_model(dtype), transformers_requests(tokenizer, prompts)
    run_transformers(hf, [(ids, 4) for ids, _ in requests[:8]])
    return hf, requests


def transformers_model(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM

    from services.worker.model.gguf_loader import smollm2_gguf_path
    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                torch_dtype=getattr(torch, dtype)).eval()


def transformers_requests(tokenizer, prompts: list[tuple[str, int]]) -> list[tuple[list[int], int]]:
    return [(tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])), m)
            for p, m in prompts]


def alternating_burst(url: str, key: str, tokenizer, prompts: list[tuple[str, int]], dtype: str,
                      rounds: int) -> list[dict]:
    """The burst's ratio to transformers, round by round: a burst of new chats through `make run`,
    then transformers on the same prompts in this process (the platform idle meanwhile). The VM's
    speed drifted 10-25% within an hour, and the peers' part runs after the platform's, 20 minutes
    and more later: a ratio of two figures taken that far apart moved with the drift."""
    hf, requests = warm_transformers(tokenizer, prompts, dtype)
    rows = []
    for _ in range(rounds):
        ours = asyncio.run(burst(url, key, MODEL, prompts, again=True))
        theirs = run_transformers(hf, requests)["tps"]
        rows.append(dict(tps=ours["tps"], served=ours["served"], transformers_tps=theirs, ratio=ours["tps"] / theirs))
        print("alternating", json.dumps(rows[-1]), flush=True)
    return rows


# -- 2. open loop ----------------------------------------------------------------------------------

async def poisson(session, url, key, prompts, rate: float, seconds: float, rng: random.Random) -> list[Result]:
    tasks, t = [], 0.0
    start = time.monotonic()
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        prompt, max_tokens = prompts[len(tasks) % len(prompts)]
        tasks.append(asyncio.create_task(stream_once(session, url, key, MODEL, prompt, max_tokens)))
    done, pending = await asyncio.wait(tasks, timeout=300) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    return [t.result() for t in done] + [Result(0) for _ in pending]


def open_loop_row(rate: float, factor: float, results: list[Result], start: float, seconds: float,
                  unloaded_ttft: float, ttft_target: float, speed_target: float) -> dict:
    """Goodput counts the tokens the good requests streamed within the rate's own `seconds` from
    `start`: counted whole, the answers still streaming when arrivals stop added their tails to the
    rate with most in flight then (12-07: 4x's 173 tokens/s against a pool that streams ~130)."""
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    refused = [r for r in results if r.status == 429]
    def goodput(ttft_bound: float) -> float:
        good = [r for r in ok if r.ttft_s <= ttft_bound and (r.tokens_per_s or 0) >= speed_target]
        return tokens_between(good, start, start + seconds) / seconds

    ttft_p95 = percentile([r.ttft_s for r in ok], 95) if ok else None
    return dict(factor=factor, rate=rate, seconds=seconds, offered=len(results), ok=len(ok), refused=len(refused),
                errors=len(results) - len(ok) - len(refused),
                ttft_p50=percentile([r.ttft_s for r in ok], 50) if ok else None, ttft_p95=ttft_p95,
                ttft_p95_over_unloaded=ttft_p95 / unloaded_ttft if ttft_p95 and unloaded_ttft else None,
                speed_p5=percentile([r.tokens_per_s for r in ok if r.tokens_per_s], 5) if ok else None,
                speed_p50=percentile([r.tokens_per_s for r in ok if r.tokens_per_s], 50) if ok else None,
                goodput=goodput(2 * unloaded_ttft), goodput_at_target=goodput(ttft_target), ttft_target=ttft_target,
                refusal_p50_ms=1000 * percentile([r.latency_s for r in refused], 50) if refused else None,
                refusal_p95_ms=1000 * percentile([r.latency_s for r in refused], 95) if refused else None,
                refused_within_100ms=sum(r.latency_s < 0.1 for r in refused),
                refusals_with_retry_after=sum(r.retry_after for r in refused))


async def unloaded_first_tokens(session, url: str, key: str, prompts, org: str = "") -> list[float]:
    """The first tokens of the whole mix sent one at a time (2-token answers: the first token does
    not wait for the answer's length). Over the first 6 prompts their p95 had been 0.52-0.72 s on one
    tree, as the longest prompt was among them or not. A reference is the p95 of the first tokens
    before and after the loaded phase together: one pass's p95 of 32 moved 0.44-0.74 s across runs
    of one tree (12-06)."""
    first = [await stream_once(session, url, key, MODEL, p, 2, org) for p, _ in prompts]
    return [r.ttft_s for r in first if r.ttft_s]


async def saturated_capacity(session, url: str, key: str, prompts, seconds: float,
                             streams: int = CAPACITY_STREAMS) -> dict:
    """The requests/s of this mix the pool serves with as many clients as it may admit, each sending
    its next request when its last ends (a refused one after its Retry-After, then the next
    prompt): the tokens/s it streams over the last two thirds, once the first wave's prompts are
    in, over the mix's mean answer. Completions counted instead depend on which answers ended in
    the window and which prompts were refused: 2.75 and 3.4 requests/s in two runs that streamed
    200 and 211 tokens/s. A burst's own rate is lower still: its queue drains to a tail of a few
    long answers (12-02: the float32 pool's burst 0.62 requests/s, this loop 1.2-1.4)."""
    results: list[Result] = []
    start = time.monotonic()
    await flood(session, url, prompts, [(key, "", results)], streams, start + seconds)
    window = (start + seconds / 3, start + seconds)
    tokens_per_s = tokens_between(results, *window) / (window[1] - window[0])
    mean_answer = sum(m for _, m in prompts) / len(prompts)
    return dict(streams=streams, seconds=seconds, tokens_per_s=tokens_per_s, mean_answer_tokens=mean_answer,
                rps=tokens_per_s / mean_answer, refused=sum(r.status == 429 for r in results))


def trace_rows(factor: float, results: list[Result], gauges: list[dict]) -> list[dict]:
    """One row's requests and the gateway's gauges, by seconds since its first request (t None: a
    request still pending when the row gave up on it)."""
    t0 = min((r.sent_at for r in results if r.sent_at), default=0.0)
    requests = [dict(factor=factor, t=round(r.sent_at - t0, 2) if r.sent_at else None, status=r.status,
                     ttft_s=r.ttft_s, tokens=r.tokens, tokens_per_s=r.tokens_per_s, latency_s=round(r.latency_s, 3))
                for r in sorted(results, key=lambda r: r.sent_at)]
    return requests + [dict(factor=factor, gauge=True, **{**g, "t": round(g["t"] - t0, 1)}) for g in gauges]


async def open_loop(url: str, key: str, prompts, capacity: float | None, seconds: float, targets: dict,
                    factors: tuple[float, ...] = (0.5, 1, 2, 4), trace: Path | None = None) -> dict:
    """Poisson arrivals at `factors` x `capacity` (requests/s; None: measured first by
    saturated_capacity), each rate for `seconds` or MIN_ARRIVALS expected arrivals, whichever is
    longer; `trace`: a JSON-lines file of each request and the gateway's gauges."""
    rng = random.Random(1)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        before = await unloaded_first_tokens(session, url, key, prompts)
        unloaded = [await stream_once(session, url, key, MODEL, p, m) for p, m in prompts[:6]]
        measured = None
        if capacity is None:
            measured = await saturated_capacity(session, url, key, prompts, seconds)
            print("capacity", json.dumps(measured), flush=True)
            capacity = measured["rps"]
        loaded: list[tuple[float, list[Result], float, float, float]] = []
        traced: list[dict] = []
        for factor in factors:
            gauges: list[dict] = []   # sampled only for a trace: an untraced run scrapes no /metrics
            sampler = asyncio.create_task(gateway_gauges(session, url, float("inf"), gauges)) if trace else None
            rate_seconds = max(seconds, MIN_ARRIVALS / (capacity * factor))
            rate_start = time.monotonic()
            results = await poisson(session, url, key, prompts, capacity * factor, rate_seconds, rng)
            if sampler is not None:
                sampler.cancel()
                traced += trace_rows(factor, results, gauges)
            # The target admission planned to (one that follows the pool moves with it)
            target = await model_series(session, url, {"llmserve_gateway_admission_ttft_target_seconds": "s"}, MODEL)
            loaded.append((factor, results, rate_start, rate_seconds, target.get("s", targets["ttft_target_s"])))
        after = await unloaded_first_tokens(session, url, key, prompts)
        if trace is not None:
            trace.write_text("".join(json.dumps(row) + "\n" for row in traced))
    unloaded_ttft = percentile(before + after, 95)
    rows = [open_loop_row(capacity * factor, factor, results, rate_start, rate_seconds, unloaded_ttft, target,
                          targets["stream_tokens_per_s"]) for factor, results, rate_start, rate_seconds, target in loaded]
    for row in rows:
        print("open loop", json.dumps(row), flush=True)
    return dict(capacity_rps=capacity, capacity_measured=measured, unloaded_ttft_p95=unloaded_ttft,
                unloaded_ttft_p95_before=percentile(before, 95), unloaded_ttft_p95_after=percentile(after, 95),
                unloaded_speed_p50=percentile([r.tokens_per_s for r in unloaded if r.tokens_per_s], 50), rows=rows)


# -- 3. fairness -----------------------------------------------------------------------------------

class Admin:
    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def call(self, method: str, path: str, body: dict) -> dict:
        async with self.session.request(method, self.url + path, json=body,
                                        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            reply = await r.json()
            if r.status >= 300:
                raise RuntimeError(f"admin {method} {path}: {r.status} {reply}")
            return reply

    async def org_key(self, name: str) -> tuple[str, str]:
        org = await self.call("POST", "/admin/v1/organizations", {"name": name})
        key = await self.call("POST", f"/admin/v1/organizations/{org['id']}/keys", {"name": name})
        return org["id"], key["key"]


async def flood(session, url, prompts, floods: list[tuple[str, str, list[Result]]], streams: int,
                until: float) -> None:
    """`streams` clients per (key, organization, results), each sending its next request when its
    last ends; a refused one waits what Retry-After asked for first, as the SDKs do. The
    organizations' clients start interleaved, so neither's first wave reaches the gateway first."""
    async def loop(key: str, org: str, results: list[Result], i: int):
        while time.monotonic() < until:
            prompt, max_tokens = prompts[i % len(prompts)]
            results.append(result := await stream_once(session, url, key, MODEL, prompt, max_tokens, org))
            if result.status == 429:
                await asyncio.sleep(min(result.retry_after_s or 1.0, max(0.0, until - time.monotonic())))
            i += streams
    await asyncio.gather(*(loop(key, org, results, i) for i in range(streams) for key, org, results in floods))


def tokens_between(results: list[Result], start: float, end: float) -> int:
    return sum(sum(1 for t in r.chunk_times if start <= t <= end) for r in results)


def token_trace(results: dict[str, list[Result]], start: float, end: float, step: float) -> list[dict]:
    """Tokens each organization streamed in consecutive `step`-second buckets: shows how long the
    first wave of admissions dominates."""
    rows, t = [], start
    while t < end:
        rows.append({"t": round(t - start), **{org: tokens_between(res, t, min(end, t + step))
                                               for org, res in results.items()}})
        t += step
    return rows


async def model_series(session: aiohttp.ClientSession, url: str, names: dict[str, str], model: str) -> dict:
    """The gateway's /metrics series `names` (metric name -> key) of one model."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name in names and f'model="{model}"' in rest:
            found[names[name]] = float(rest.rsplit(" ", 1)[1])
    return found


async def gateway_gauges(session: aiohttp.ClientSession, url: str, until: float, samples: list[dict],
                         model: str = MODEL) -> None:
    """Every 2 s: the model's admission limit, streams in flight and waiters."""
    names = {"llmserve_gateway_overload_limit": "limit", "llmserve_gateway_in_flight_requests": "in_flight",
             "llmserve_gateway_queued_requests": "queued"}
    while time.monotonic() < until:
        try:
            samples.append({"t": round(time.monotonic(), 1), **await model_series(session, url, names, model)})
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(2)


async def queue_waits(session: aiohttp.ClientSession, url: str, model: str) -> dict:
    """The admitted waiters' mean queue wait against its estimate when they were queued (cumulative)."""
    wait, estimate = "llmserve_gateway_admission_queue_wait_seconds", "llmserve_gateway_admission_queue_wait_estimate_seconds"
    found = await model_series(session, url, {wait + "_sum": "waited_s", wait + "_count": "queued",
                                              estimate + "_sum": "estimated_s", estimate + "_count": "estimated"}, model)
    return dict(queued=int(found.get("queued", 0)),
                wait_mean_s=found.get("waited_s", 0) / max(1, found.get("queued", 0)),
                estimated=int(found.get("estimated", 0)),   # the waiters queued with an estimate
                estimate_mean_s=found.get("estimated_s", 0) / found["estimated"] if found.get("estimated") else None)


def gauge_summary(samples: list[dict]) -> dict:
    out = {}
    for key in ("limit", "in_flight", "queued"):
        values = sorted(s[key] for s in samples if key in s)
        if values:
            out[key] = dict(min=values[0], median=values[len(values) // 2], max=values[-1])
    return out


async def fairness(url: str, prompts, seconds: float, share_streams: int = 24) -> dict:
    """Each phase runs `seconds`; shares are counted after the first third, once the first wave of
    admissions (which holds its slots for a whole answer, 10-60 s here) has ended. In the shares'
    phases each organization floods with share_streams streams: the pool must hold fewer than both
    together, or nobody waits and the shares are only the demands'."""
    short = [(p[:120], 16) for p, _ in prompts]
    warmup = seconds / 3
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        admin = Admin(session, url)
        (a_id, a_key), (b_id, b_key) = await admin.org_key("flood-a"), await admin.org_key("flood-b")
        report: dict = {}

        # One organization floods, the other sends one short chat at a time.
        before = await unloaded_first_tokens(session, url, b_key, short, "B")
        flood_results: list[Result] = []
        until = time.monotonic() + seconds
        flooding = asyncio.create_task(flood(session, url, prompts, [(a_key, "A", flood_results)], 24, until))
        await asyncio.sleep(min(5.0, seconds / 4))             # the flood fills the pool first
        polite: list[Result] = []
        while time.monotonic() < until:
            polite.append(await stream_once(session, url, b_key, MODEL, *short[len(polite) % len(short)], "B"))
        await flooding
        after = await unloaded_first_tokens(session, url, b_key, short, "B")
        unloaded, loaded = percentile(before + after, 95), percentile([r.ttft_s for r in polite if r.ttft_s], 95)
        report["flood_vs_one_at_a_time"] = dict(
            b_requests=len(polite), b_refused=sum(r.status == 429 for r in polite),
            b_errors=sum(r.status not in (200, 429) for r in polite), b_unloaded_ttft_p95=unloaded,
            b_unloaded_ttft_p95_before=percentile(before, 95), b_unloaded_ttft_p95_after=percentile(after, 95),
            b_ttft_p50=percentile([r.ttft_s for r in polite if r.ttft_s], 50),
            b_ttft_p95=loaded, b_ttft_ratio=loaded / unloaded if unloaded else None,
            a_requests=len(flood_results), a_refused=sum(r.status == 429 for r in flood_results))
        print("fairness", json.dumps(report["flood_vs_one_at_a_time"]), flush=True)

        for label, weight_a in (("equal_weights", 1.0), ("weights_2_to_1", 2.0)):
            await admin.call("PATCH", f"/admin/v1/organizations/{a_id}", {"weight": weight_a})
            await asyncio.sleep(6)                             # auth.cache_ttl_s: keys see the new weight
            a_res, b_res, gauges = [], [], []
            start = time.monotonic()
            until = start + seconds
            await asyncio.gather(flood(session, url, prompts, [(a_key, "A", a_res), (b_key, "B", b_res)],
                                       share_streams, until),
                                 gateway_gauges(session, url, until, gauges))
            window = (start + warmup, until)
            a_tokens, b_tokens = tokens_between(a_res, *window), tokens_between(b_res, *window)
            first = (start, start + warmup)
            report[label] = dict(weight_a=weight_a, streams_each=share_streams, a_tokens=a_tokens, b_tokens=b_tokens,
                                 ratio=a_tokens / b_tokens if b_tokens else None, window_s=seconds - warmup,
                                 first_ratio=tokens_between(a_res, *first) / max(1, tokens_between(b_res, *first)),
                                 refused=sum(r.status == 429 for r in a_res + b_res),
                                 requests=len(a_res) + len(b_res), gateway=gauge_summary(gauges),
                                 trace=token_trace({"A": a_res, "B": b_res}, start, until, seconds / 12))
            print("fairness", label, json.dumps(report[label]), flush=True)
    return report


# -- the platform and the report ------------------------------------------------------------------

def launcher():
    """deploy/local/run.py as a module: the targets and ports `make run` gives the services."""
    sys.path.insert(0, str(REPO / "deploy" / "local"))
    import run
    return run


def start_make_run(tmp: Path, port_base: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(REPO / "deploy" / "local" / "run.py"), "--port-base",
                             str(port_base), "--var-dir", str(tmp / "var"), "--run-dir", str(tmp / "run")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        print("make run:", line.rstrip(), flush=True)
        if "Ctrl-C stops everything" in line:
            return proc, next(s.address for s in launcher().plan({}, port_base=port_base) if s.name == "gateway")
    raise RuntimeError(f"make run exited with {proc.wait()}")


def stop_make_run(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)   # the launcher stops its services
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _f(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _target(t: dict) -> str:
    """The first-token target as the gateway was configured."""
    if t.get("ttft_target_over_unloaded"):
        return (f"{t['ttft_target_over_unloaded']}x the pool's unloaded first token, "
                f"{t.get('ttft_target_s')} s until measured")
    return f"{t.get('ttft_target_s')} s"


def _before_after(row: dict, key: str) -> str:
    """How an unloaded reference was taken, where it was pooled from passes before and after the load."""
    if f"{key}_before" not in row:
        return ""
    return (f" (the mix sent one at a time before and after the loaded phase, pooled; each pass alone "
            f"{_f(row[key + '_before'])} and {_f(row[key + '_after'])} s)")


def _part(d: dict, part: str) -> dict:
    """When, where and in which dtypes `part` was measured ({} in a report from before that was kept)."""
    return d.get("measured", {}).get(part) or {}


def _measured(d: dict, *parts: str) -> list[str]:
    """The line under a section's heading saying on which machine and when each of its parts ran."""
    runs: dict[str, dict[str, list[str]]] = {}
    for part in parts:
        if run := _part(d, part):
            runs.setdefault(run["machine"], {}).setdefault(run["started"], []).append(part)
    said = [f"on {machine}: " + "; ".join(f"{', '.join(named)} at {started}" for started, named in times.items())
            for machine, times in runs.items()]
    return [f"Measured {' / '.join(said)}.", ""] if said else []


def render(d: dict) -> str:
    """docs/perf/load.md from the figures."""
    t = d.get("targets", {})
    lines = ["# Load: admission through `make run`", "",
             f"`make bench-load` (python -m bench.load), "
             + ("each section says on which machine and when its parts ran" if d.get("measured") else
                f"platform parts started {d.get('started', '?')}, peers {d.get('peers_started', 'not run')}")
             + ". `make run` as it ships: the default worker on every core in "
             f"its dtype auto (bfloat16 on a CPU with bfloat16 units, else float32), the "
             f"int8 pool on one thread, the gateway admitting from the workers' reports with the CPU targets "
             f"(first token {_target(t)}, {t.get('stream_tokens_per_s')} tokens/s per stream, queue "
             f"wait at most {t.get('queue_timeout_s')} s). Mixed chat: prompts of 20-400 tokens, answers of 16-160 "
             "(end-of-sequence banned, so each answer has its length), greedy, streamed. A shared 2-core VM: "
             "absolute figures move with what else runs; compare the ratios of one run.", ""]
    if d.get("notes"):
        lines += ["Caveats of this run:", "", *[f"- {note}" for note in d["notes"]], ""]
    burst = d.get("burst") or []
    hf, llama = d.get("transformers") or {}, d.get("llama_cpp")
    if "tps" in hf:   # a report from before the peer ran per dtype: float32 then
        hf = {"float32": hf}
    dtypes = _part(d, "burst").get("dtypes") or d.get("dtypes", {})
    # A ratio across machines says nothing: where the peers ran elsewhere, their rows stay, the ratios go.
    comparable = len({_part(d, p).get("machine") for p in ("burst", "peers")} - {None}) <= 1
    if burst:
        lines += ["## Burst: 32 at once with the openai SDK (default retries)", "",
                  *_measured(d, "burst", "alternating", "peers"),
                  "| model | served | refused | tokens/s | TTFT p50 (s) | TTFT p95 (s) | vs transformers | vs llama.cpp |",
                  "|---|---|---|---|---|---|---|---|"]
        for b in burst:
            peer = hf.get(dtypes.get(b["model"]), {}) if comparable else {}
            vs_hf = _f(b["tps"] / peer["tps"]) + f"x ({dtypes[b['model']]})" if peer.get("tps") else "-"
            vs_ll = _f(b["tps"] / llama["tps"]) + "x" if comparable and llama and llama.get("tps") else "-"
            model = f"{b['model']} (again, warm)" if b.get("warm") else b["model"]
            lines.append(f"| {model} | {b['served']}/{b['requests']} | {b['refused']} | {_f(b['tps'], 1)} | "
                         f"{_f(b['ttft_p50'])} | {_f(b['ttft_p95'])} | {vs_hf} | {vs_ll} |")
        for dtype, run in sorted(hf.items()):
            lines.append(f"| transformers in {dtype}, static batches of 8 | | | {_f(run['tps'], 1)} | | | | |")
        if llama and llama.get("tps"):
            lines.append(f"| llama-cpp-python server (Q4_1 GGUF) | | | {_f(llama['tps'], 1)} | | "
                         f"{_f(llama['ttft_p95'])} | | |")
        elif llama:
            lines.append(f"| llama-cpp-python server | not measured: {llama.get('error')} | | | | | | |")
        lines.append("")
        for b in burst:
            if "answered_429" in b:
                limit = b.get("gateway", {}).get("limit", {})
                model = f"{b['model']} (again, warm)" if b.get("warm") else b["model"]
                lines.append(f"- {model}: {b['answered_429']} answers 429 on the way (Retry-After p50 "
                             f"{_f(b['retry_after_p50'], 1)} s); {b['queued']} requests queued, waiting "
                             f"{_f(b['wait_mean_s'], 1)} s on average; {b.get('estimated', 'those')} with an estimate "
                             f"when queued, {_f(b['estimate_mean_s'], 1)} s on average (none before a stream has ended "
                             f"or been estimated); the limit {limit.get('min', 0):.0f}-{limit.get('max', 0):.0f} streams "
                             f"(median {limit.get('median', 0):.0f}).")
        alternating = d.get("burst_alternating")
        if alternating:
            ratios = [r["ratio"] for r in alternating]
            lines.append(f"- Alternating with transformers in "
                         f"{(_part(d, 'alternating').get('dtypes') or dtypes).get(MODEL)}, round by round (a burst of new "
                         f"chats, then transformers on the same prompts, the platform idle meanwhile): "
                         f"{', '.join(_f(r) + 'x' for r in ratios)}, median **{_f(statistics.median(ratios))}x** "
                         f"({', '.join(_f(r['tps'], 1) for r in alternating)} against "
                         f"{', '.join(_f(r['transformers_tps'], 1) for r in alternating)} tokens/s; "
                         f"{sum(r['served'] for r in alternating)}/{len(alternating) * d.get('requests', 32)} served).")
        lines.append("")
    loop = d.get("open_loop")
    if loop:
        m = loop.get("capacity_measured")
        how = (f"measured: {m['streams']} clients sending back to back for {m['seconds']:.0f} s streamed "
               f"{_f(m['tokens_per_s'], 1)} tokens/s in the last two thirds, over the mix's mean answer of "
               f"{_f(m['mean_answer_tokens'], 1)} tokens ({m['refused']} refusals on the way)") if m else "given (--capacity)"
        lines += ["## Open loop: Poisson arrivals at multiples of the pool's capacity", "",
                  *_measured(d, "poisson"),
                  f"Capacity {_f(loop['capacity_rps'], 3)} requests/s, {how}; unloaded TTFT p95 "
                  f"{_f(loop['unloaded_ttft_p95'])} s{_before_after(loop, 'unloaded_ttft_p95')}, per-stream speed "
                  f"p50 {_f(loop['unloaded_speed_p50'], 1)} tokens/s.", "",
                  "| load | req/s | offered (in s) | ok | 429 | errors | TTFT p95 (s) | TTFT p95 / unloaded | speed p5 | "
                  "goodput (tok/s) | goodput at the TTFT target (tok/s) | 429 p50 / p95 (ms) | 429 within 100 ms | "
                  "429 with Retry-After |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in loop["rows"]:
            lines.append(f"| {r['factor']:g}x | {_f(r['rate'], 3)} | {r['offered']} ({_f(r.get('seconds'), 0)}) | {r['ok']} | {r['refused']} | "
                         f"{r['errors']} | {_f(r['ttft_p95'])} | {_f(r['ttft_p95_over_unloaded'])} | "
                         f"{_f(r['speed_p5'], 1)} | {_f(r['goodput'], 1)} | {_f(r.get('goodput_at_target'), 1)} | "
                         f"{_f(r.get('refusal_p50_ms'), 0)} / "
                         f"{_f(r['refusal_p95_ms'], 0)} | {r.get('refused_within_100ms', '-')} | "
                         f"{r['refusals_with_retry_after']} |")
        lines += ["", f"Goodput: tokens/s streamed while the rate's arrivals came (an answer's tail after "
                      f"them is not counted) by the requests with a first token within 2x the unloaded TTFT p95 "
                      f"(the bound TTFT p95 is held to) and the speed target; at the TTFT target: within "
                      f"the gateway's target at the end of that rate's run instead "
                      f"({', '.join(_f(r.get('ttft_target', t.get('ttft_target_s'))) for r in loop['rows'])} s)."]
        for key, what in (("goodput", "goodput"), ("goodput_at_target", "goodput at the TTFT target")):
            best = max((r.get(key) or 0 for r in loop["rows"]), default=0)
            for r in loop["rows"]:
                if r["factor"] >= 2 and best:
                    lines.append(f"- {r['factor']:g}x: {what} {_f(100 * (r.get(key) or 0) / best, 0)}% of the best rate's.")
        lines.append("")
    fair = d.get("fairness")
    if fair:
        f1 = fair["flood_vs_one_at_a_time"]
        lines += ["## Fairness between organizations", "",
                  *_measured(d, "fairness"),
                  f"- One organization flooding with 24 concurrent streams ({f1['a_requests']} requests, "
                  f"{f1['a_refused']} refused), a second sending one short chat at a time: {f1['b_requests']} "
                  f"requests, {f1['b_refused']} refused, {f1['b_errors']} errors; its TTFT p50 "
                  f"{_f(f1.get('b_ttft_p50'))} s, p95 {_f(f1['b_ttft_p95'])} s "
                  f"against {_f(f1['b_unloaded_ttft_p95'])} s unloaded"
                  f"{_before_after(f1, 'b_unloaded_ttft_p95')} = {_f(f1['b_ttft_ratio'])}x."]
        for label, want in (("equal_weights", 1.0), ("weights_2_to_1", 2.0)):
            r = fair.get(label)
            if not r:
                continue
            window = f" over the last {r['window_s']:.0f} s" if r.get("window_s") else ""
            streams = f" ({r['streams_each']} streams each)" if r.get("streams_each") else ""
            lines.append(f"- {label.replace('_', ' ')}{streams}: tokens streamed{window} A {r['a_tokens']}, B {r['b_tokens']}: "
                         f"A/B = {_f(r['ratio'])} (wanted {want:g}); {r['refused']} of {r.get('requests', '?')} "
                         f"requests refused.")
            if "first_ratio" in r:
                gw = r.get("gateway", {}).get("limit")
                limit = f"; the gateway's limit {gw['min']:g}-{gw['max']:g} streams (median {gw['median']:g})" if gw else ""
                lines.append(f"  - the first third (the first wave holding its slots): A/B = {_f(r['first_ratio'])}{limit}.")
            if r.get("trace"):
                lines.append("  - tokens per " + f"{r['trace'][1]['t'] - r['trace'][0]['t'] if len(r['trace']) > 1 else 0} s, "
                             "A/B: " + ", ".join(f"{row['A']}/{row['B']}" for row in r["trace"]))
        lines.append("")
    lines += ["## How admission decides", "",
              "- Each worker fits its decode step time, step = base + per_seq x sequences, over its recent "
              "decode-only steps (services/worker/engine/load_stats.py; a prefilling step's time, less the line's "
              "share, gives the prefill rate) and reports the line, its prefill rate, the share of its recent "
              "wall time prompts took and the prompt tokens queued in GetLoad; the router passes the reports "
              "through ListWorkers. A worker runs a few made-up requests through its engine before it serves "
              "(services/worker/engine/warm_up.py), so its first report has a line; without one the limit is "
              "the configured per-worker fallback.",
              "- The gateway (services/gateway/overload.py, admission/) admits a model's requests while its "
              "streams are fewer than the pool can run at the per-stream target (or, where even one stream misses "
              "it, 80% of the peak throughput's worth; the median of the lines reported over the last 30 s, so a "
              "fit skewed for a few seconds does not move the limit) and its estimated first token (the prompts "
              "queued in the pool, drained beside the streams decoding at the token budget less their decodes a "
              "step, then its own prefill and a step; scaled by the 90th percentile of the last 64 first tokens' "
              "measured / estimated times, as the target is a p95) is within the TTFT target (overload."
              "ttft_target_s, or with overload.ttft_target_over_unloaded that multiple of the p95 of the first "
              "tokens of the last 64 requests admitted to an idle pool, as Envoy's adaptive concurrency targets "
              "its measured minimum latency times 1 + a buffer). The queued prompts "
              "are the reported ones plus this gateway's admissions since the report or, where more, the prompts of its "
              "admissions still awaiting their first token past the reported ones (requests on their way to "
              "the worker are in no report). In a standing queue the target "
              "speed is asked of the decode steps' share of the time, what the reported prefill share of the workers' last seconds leaves "
              "(steady arrivals keep prefilling; a burst's prefill happens once and is left out); the limit is "
              "split between gateway replicas through the Redis heartbeats.",
              "- Beyond that a request waits in a fair queue: priority class first, then organizations by virtual "
              "token counters over their weights. It may wait queue_timeout_s while the pool absorbs a burst. Once "
              "every slot has been taken for queue_timeout_s on end, or for 1.5 sustained windows with newcomers "
              "finding the pool full 1.5 times as often as slots free (a standing queue), it may wait only what the "
              "TTFT target leaves past the measured time from admission to first token (while every slot is "
              "taken, at most the mean time between slots freed), and the waiters queued before are held to "
              "that bound too; it stands until nobody has been refused for a sustained window. A burst is a "
              "quarter of the limit (at least 4) arriving within half a second (overload.burst_share); a queue is "
              "judged a burst's or not once half a second old, and its newcomers wait the long bound until then. A "
              "queue that formed with no burst (arrivals filled the pool, or its prompt queue, over time) stands, "
              "unless only the pool's queued prompts hold its newcomers back, with slots free "
              "and arrivals not outpacing the slots freed (Poisson arrivals clumped below capacity): those wait up "
              "to the TTFT target and the queue does not stand. A newcomer that waits over burst_arrival_s after a "
              "burst's queue formed, with nobody refused since who could wait the long bound (so it is no burst's retry), is new load: "
              "the queue stands from then on, and the burst's own waiters keep their bound. While a burst's "
              "queue is absorbed, only the slots hold its waiters back, not the pool's queued prompts: they are "
              "past the TTFT target already. A "
              "newcomer whose estimated wait (the end of the in-flight stream that frees the slot its turn needs, "
              "each expected at its grant + its answer budget at the measured speed, or, if later, when the prompts "
              "ahead of it, the waiters' before it included, let its first token be planned within the target) exceeds "
              "its bound is refused at once, with a Retry-After for when that wait would be half its bound (at most "
              "60 s, the most the openai SDK honours); every waiter's estimate is renewed "
              "when a slot frees, a report arrives, a prompt admitted here gets its first token or a newcomer is "
              "placed ahead, and one that can no longer make "
              "its bound is refused then. The worker's own waiting queue keeps the same weighted fair order by "
              "tokens served; on a tie of counters a tenant with nothing running goes first, and its newcomer has "
              "the next step to itself (a light user's first token waits for its own prefill only).",
              "- Metrics: llmserve_gateway_admission_decisions{model, organization, decision}, the queue wait "
              "estimated and measured, the TTFT estimate, llmserve_gateway_overload_limit.", ""]
    return "\n".join(lines)


def write_report(data: dict) -> None:
    """docs/perf/load.json: this run's parts replace the same parts of the last one; load.md from it."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "load.json"
    try:
        earlier = json.loads(path.read_text())
    except (OSError, ValueError):
        earlier = {}
    earlier = earlier if isinstance(earlier, dict) else {}
    data = {**earlier, **data, "measured": {**earlier.get("measured", {}), **data.get("measured", {})}}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False))
    (OUT / "load.md").write_text(render(data))
    print(json.dumps(data, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="gateway base URL of a running `make run` (default: start one)")
    parser.add_argument("--key", default=os.environ.get("LLMSERVE_DEV_API_KEY", "sk-local-dev"))
    parser.add_argument("--port-base", type=int, default=47200, help="the first of the ports of the `make run` "
                        "this starts (deploy/local/run.py --port-base)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60,
                        help=f"per open-loop rate (longer where {MIN_ARRIVALS} arrivals take longer)")
    parser.add_argument("--fairness-seconds", type=float, default=240,
                        help="per fairness phase; shares are counted over its last two thirds")
    parser.add_argument("--share-streams", type=int, default=0,
                        help="streams per organization in the shares' phases (more than half the pool's limit; "
                             "default: the gateway's max_in_flight_per_model)")
    parser.add_argument("--parts", default="burst,alternating,poisson,fairness,peers")
    parser.add_argument("--alternating-rounds", type=int, default=3,
                        help="rounds of the burst alternating with transformers (part `alternating`)")
    parser.add_argument("--capacity", type=float, help="the open loop's 1x in requests/s (default: measured by a "
                        "closed loop of 64 clients for --seconds)")
    parser.add_argument("--factors", default="0.5,1,2,4", help="the open loop's rates, as multiples of the capacity")
    parser.add_argument("--trace", type=Path, help="a JSON-lines file of the open loop's requests and gauges")
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python[server] (default: this one)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))

    from services.gateway.config import GatewayConfig
    from services.worker.model.gguf_loader import smollm2_gguf_path
    from services.worker.model.loader import smollm2_tokenizer

    overload = next(s.config.overload for s in launcher().plan({}) if isinstance(s.config, GatewayConfig))
    targets = dict(ttft_target_s=overload.ttft_target_s, ttft_target_over_unloaded=overload.ttft_target_over_unloaded,
                   stream_tokens_per_s=overload.stream_tokens_per_s,
                   queue_timeout_s=overload.queue_timeout_s)
    share_streams = args.share_streams or overload.max_in_flight_per_model
    tokenizer = smollm2_tokenizer()
    prompts = mixed_prompts(tokenizer, args.requests)
    data: dict = dict(started=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), targets=targets, dtypes=pool_dtypes(),
                      requests=args.requests, seconds=args.seconds, fairness_seconds=args.fairness_seconds)
    # With --url the platform runs elsewhere: only the client's machine is known here.
    machine = f"the platform at {args.url} (the client on {this_machine()})" if args.url else this_machine()
    data["measured"] = {part: dict(started=data["started"], machine=machine, dtypes=data["dtypes"])
                        for part in sorted(parts & PLATFORM_PARTS)}
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        needs_platform = parts & PLATFORM_PARTS
        proc, url = (None, args.url) if args.url or not needs_platform else start_make_run(Path(tmp), args.port_base)
        try:
            if "burst" in parts:
                # The default pool twice: cold, then warm (its load reports and measured holds in place).
                data["burst"] = [asyncio.run(burst(url, args.key, m, prompts, again))
                                 for m, again in ((MODEL, False), (MODEL, True), (INT8_MODEL, False))]
                for row in data["burst"]:
                    print("burst", json.dumps(row), flush=True)
            if "alternating" in parts:
                data["burst_alternating"] = alternating_burst(url, args.key, tokenizer, prompts,
                                                              data["dtypes"][MODEL], args.alternating_rounds)
            if "poisson" in parts:
                data["open_loop"] = asyncio.run(open_loop(url, args.key, prompts, args.capacity, args.seconds, targets,
                                                          tuple(float(f) for f in args.factors.split(",")),
                                                          args.trace))
            if "fairness" in parts:
                data["fairness"] = asyncio.run(fairness(url, prompts, args.fairness_seconds, share_streams))
        finally:
            if proc is not None:
                stop_make_run(proc)
    data["seconds_total"] = time.monotonic() - started
    write_report(data)
    if "peers" in parts:   # after the platform stopped: the peers get the machine
        peers: dict = {"peers_started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        peers["measured"] = {"peers": dict(started=peers["peers_started"], machine=this_machine(),
                                           dtypes=data["dtypes"])}
        try:
            # <|im_start|> (1) too: llama.cpp's ChatML handler stops on it, which cut a stream short.
            peers["llama_cpp"] = llama_cpp_peer(str(smollm2_gguf_path()), 0, 0, sorted({1, *tokenizer.eos_token_ids}),
                                                prompts=prompts, python=args.llama_python,
                                                port=args.port_base + LLAMA_PORT)
        except RuntimeError as e:
            peers["llama_cpp"] = {"error": str(e)}
        print("llama-cpp", json.dumps(peers["llama_cpp"]), flush=True)
        # One run per dtype the pools compute in, so each pool is compared in its own dtype.
        peers["transformers"] = {dtype: transformers_burst(tokenizer, prompts, dtype)
                                 for dtype in sorted(set(data["dtypes"].values()))}
        print("transformers", json.dumps(peers["transformers"]), flush=True)
        write_report(peers)


if __name__ == "__main__":
    main()
