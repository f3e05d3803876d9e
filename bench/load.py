"""Load benchmark: open-loop Poisson arrivals at rising rates through the gateway (`make bench-load`).

Starts the platform on free loopback ports (two CPU workers, router, conversations, one gateway with
a small overload guard), measures an unloaded baseline with one request at a time, then offers each
rate for a fixed time. Arrivals do not wait for answers (open loop), so past saturation the excess
must be shed by the gateway (429) rather than queue without bound. Per rate: TTFT p50/p95 of short
streamed prompts, per-stream decode speed, 429 count and how fast a 429 comes back.

    python -m bench.load [--rates 0.5,1,2,4,8] [--seconds 20] [--max-tokens 32]
                         [--max-in-flight 2 --max-queued 0 --queue-timeout 0.25] [--name load]
                         [--url URL --key KEY]

With --url/--key it targets a running platform (`make run`) instead of starting one. Writes
docs/perf/load.md (table) and docs/perf/load.png (plot). On a shared 2-core machine absolute numbers
are inflated; the ratios (admitted TTFT p95 against the unloaded one) are what to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL = "smollm2-135m-instruct"
OUT = Path(__file__).resolve().parents[1] / "docs" / "perf"
TTFT_LIMIT_S = 1.0
SPEED_FLOOR = 20.0     # tokens/s per stream

def overload_settings(args: argparse.Namespace) -> dict[str, str]:
    """The gateway's overload guard (LLMSERVE_GATEWAY__OVERLOAD__*): what decides who gets a 429."""
    return {"overload__max_in_flight_per_model": str(args.max_in_flight),
            "overload__max_queued_per_model": str(args.max_queued),
            "overload__queue_timeout_s": str(args.queue_timeout)}


@dataclass
class Result:
    status: int
    ttft_s: float | None = None        # first content chunk
    latency_s: float = 0.0             # whole response (for refusals: how fast the 429 came)
    tokens: int = 0
    decode_s: float = 0.0              # first to last content chunk

    @property
    def tokens_per_s(self) -> float | None:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else None


@dataclass
class RateReport:
    rate: float
    offered: int
    results: list[Result] = field(default_factory=list)

    def ok(self) -> list[Result]:
        return [r for r in self.results if r.status == 200 and r.ttft_s is not None]

    def summary(self) -> dict:
        ok = self.ok()
        ttfts = [r.ttft_s for r in ok]
        speeds = [r.tokens_per_s for r in ok if r.tokens_per_s]
        refused = [r for r in self.results if r.status == 429]
        return {"rate": self.rate, "offered": self.offered, "ok": len(ok), "429": len(refused),
                "errors": len(self.results) - len(ok) - len(refused),
                "ttft_p50": pct(ttfts, 50), "ttft_p95": pct(ttfts, 95),
                "tok_s_p50": pct(speeds, 50), "tok_s_p5": pct(speeds, 5),
                "refusal_p95_ms": 1000 * pct([r.latency_s for r in refused], 95) if refused else None}


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def one(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> Result:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Question {i}: name a color and a fruit."}],
            "max_completion_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                await response.read()
                return Result(response.status, latency_s=time.monotonic() - start)
            result, last = Result(200), None
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    result.status = 500
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    last = time.monotonic()
                    if result.ttft_s is None:
                        result.ttft_s, first = last - start, last
                if chunk.get("usage"):
                    result.tokens = chunk["usage"]["completion_tokens"]
            result.latency_s = time.monotonic() - start
            result.decode_s = (last - first) if result.ttft_s is not None else 0.0
            return result
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return Result(0, latency_s=time.monotonic() - start)


async def offer(session: aiohttp.ClientSession, url: str, rate: float, seconds: float, max_tokens: int,
                rng: random.Random) -> RateReport:
    """Poisson arrivals at `rate` per second for `seconds`; waits for the stragglers (bounded)."""
    tasks, t, i = [], 0.0, 0
    start = time.monotonic()
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        await asyncio.sleep(max(0.0, start + t - time.monotonic()))
        tasks.append(asyncio.create_task(one(session, url, i, max_tokens)))
        i += 1
    report = RateReport(rate, len(tasks))
    done, pending = await asyncio.wait(tasks, timeout=120) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    report.results = [t.result() for t in done] + [Result(0) for _ in pending]
    return report


async def baseline(session: aiohttp.ClientSession, url: str, max_tokens: int, n: int = 6) -> RateReport:
    report = RateReport(0.0, n)
    for i in range(n):
        report.results.append(await one(session, url, 10_000 + i, max_tokens))
    return report


async def run(url: str, key: str, rates: list[float], seconds: float, max_tokens: int) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=180)
    connector = aiohttp.TCPConnector(limit=0)
    rng = random.Random(0)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as session:
        await baseline(session, url, max_tokens, 2)                 # warm-up, not reported
        rows = [(await baseline(session, url, max_tokens)).summary()]
        print(fmt_row(rows[0]), flush=True)
        for rate in rates:
            rows.append((await offer(session, url, rate, seconds, max_tokens, rng)).summary())
            print(fmt_row(rows[-1]), flush=True)
    return rows


def fmt(v, scale=1.0, digits=2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


def fmt_row(r: dict) -> str:
    rate = "unloaded" if r["rate"] == 0 else f"{r['rate']:g}/s"
    return (f"| {rate} | {r['offered']} | {r['ok']} | {r['429']} | {r['errors']} | {fmt(r['ttft_p50'])} | "
            f"{fmt(r['ttft_p95'])} | {fmt(r['tok_s_p50'], digits=1)} | {fmt(r['tok_s_p5'], digits=1)} | "
            f"{fmt(r['refusal_p95_ms'], digits=0)} |")


def findings(rows: list[dict]) -> list[str]:
    unloaded, loaded = rows[0], rows[1:]
    crossing = next((r["rate"] for r in loaded if (r["ttft_p95"] or 0) > TTFT_LIMIT_S), None)
    slow = next((r["rate"] for r in loaded if r["tok_s_p50"] is not None and r["tok_s_p50"] < SPEED_FLOOR), None)
    lines = [f"- Unloaded TTFT p95: {fmt(unloaded['ttft_p95'])} s, per-stream speed p50 "
             f"{fmt(unloaded['tok_s_p50'], digits=1)} tokens/s.",
             f"- TTFT p95 crosses {TTFT_LIMIT_S:g} s at: {f'{crossing:g} req/s' if crossing else 'no rate tried'}.",
             f"- Per-stream speed p50 drops under {SPEED_FLOOR:g} tokens/s at: "
             f"{f'{slow:g} req/s' if slow else 'no rate tried'}."]
    shedding = [r for r in loaded if r["429"]]
    for r in shedding:
        ratio = (r["ttft_p95"] / unloaded["ttft_p95"]) if r["ttft_p95"] and unloaded["ttft_p95"] else None
        lines.append(f"- At {r['rate']:g} req/s: {r['429']} of {r['offered']} refused with 429 "
                     f"(p95 {fmt(r['refusal_p95_ms'], digits=0)} ms); admitted TTFT p95 = {fmt(ratio)} x unloaded "
                     f"({'within' if ratio is not None and ratio <= 2 else 'NOT within'} 2x).")
    if not shedding:
        lines.append("- No rate tried was high enough for the gateway to shed load (no 429).")
    return lines


def write_report(rows: list[dict], args: argparse.Namespace, elapsed_s: float) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    header = ("| offered rate | requests | ok | 429 | errors | TTFT p50 (s) | TTFT p95 (s) | tokens/s p50 | "
              "tokens/s p5 | 429 p95 (ms) |\n|---|---|---|---|---|---|---|---|---|---|")
    text = "\n".join([
        "# Load: open-loop Poisson arrivals through the gateway", "",
        f"`make bench-load` (python -m bench.load --rates {','.join(f'{r:g}' for r in args.rates)} "
        f"--seconds {args.seconds:g} --max-tokens {args.max_tokens}), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{elapsed_s:.0f} s. Two SmolLM2-135M CPU workers (one torch thread each) behind the router, one gateway "
        f"with overload guard {json.dumps({k.split('__')[1]: v for k, v in overload_settings(args).items()})}. "
        "Short chat prompts, streamed, greedy. The machine is a shared 2-core VM: absolute times are inflated, "
        "compare ratios.", "", header, *[fmt_row(r) for r in rows], "", f"![load]({args.name}.png)", "", *findings(rows), ""])
    (OUT / f"{args.name}.md").write_text(text)
    (OUT / f"{args.name}.json").write_text(json.dumps(rows, indent=1))
    plot(rows, OUT / f"{args.name}.png")
    print(text)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loaded = rows[1:]
    rates = [r["rate"] for r in loaded]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4))
    ax1.plot(rates, [r["ttft_p50"] or float("nan") for r in loaded], "o-", label="p50")
    ax1.plot(rates, [r["ttft_p95"] or float("nan") for r in loaded], "s-", label="p95")
    ax1.axhline(TTFT_LIMIT_S, color="grey", ls="--", label=f"{TTFT_LIMIT_S:g} s")
    if rows[0]["ttft_p95"]:
        ax1.axhline(2 * rows[0]["ttft_p95"], color="red", ls=":", label="2 x unloaded p95")
    ax1.set(xscale="log", xlabel="offered rate (req/s)", ylabel="TTFT (s)", title="time to first token")
    ax2.plot(rates, [r["tok_s_p50"] or float("nan") for r in loaded], "o-", label="p50")
    ax2.plot(rates, [r["tok_s_p5"] or float("nan") for r in loaded], "s-", label="p5")
    ax2.axhline(SPEED_FLOOR, color="grey", ls="--", label=f"{SPEED_FLOOR:g} tokens/s")
    ax2.set(xscale="log", xlabel="offered rate (req/s)", ylabel="tokens/s per stream", title="decode speed")
    ax3.bar([str(f"{r:g}") for r in rates], [r["ok"] for r in loaded], label="ok")
    ax3.bar([str(f"{r:g}") for r in rates], [r["429"] for r in loaded], bottom=[r["ok"] for r in loaded], label="429")
    ax3.set(xlabel="offered rate (req/s)", ylabel="requests", title="admitted vs shed")
    for ax in (ax1, ax2, ax3):
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def start_platform(tmp: Path, args: argparse.Namespace):
    from tests.reliability.clients import Admin
    from tests.reliability.platform import launch

    platform = launch(tmp, num_workers=2, num_gateways=1, **overload_settings(args))
    return platform, Admin(platform.gateway_url).new_org("load")[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.5, 1, 2, 4, 8])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-in-flight", type=int, default=2, help="gateway overload guard, per model")
    parser.add_argument("--max-queued", type=int, default=0, help="gateway overload guard queue, per model")
    parser.add_argument("--queue-timeout", type=float, default=0.25, help="seconds a queued request may wait")
    parser.add_argument("--name", default="load", help="report name under docs/perf/ (.md, .png, .json)")
    parser.add_argument("--url", help="gateway base URL of a running platform (default: start one)")
    parser.add_argument("--key", help="API key for --url")
    args = parser.parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-load-") as tmp:
        platform = None
        if args.url:
            url, key = args.url, args.key
        else:
            platform, key = start_platform(Path(tmp), args)
            url = platform.gateway_url
        try:
            rows = asyncio.run(run(url + "/v1/chat/completions", key, args.rates, args.seconds, args.max_tokens))
        finally:
            if platform is not None:
                platform.stop()
    write_report(rows, args, time.monotonic() - started)


if __name__ == "__main__":
    main()
