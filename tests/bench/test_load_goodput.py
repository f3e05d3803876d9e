"""bench-load's open-loop row: goodput counts what good requests streamed while the rate's
arrivals came, not the tails they stream after (which favoured the rate with most in flight)."""

from bench.load import Result, open_loop_row


def streamed(ttft_s: float, start: float, times: list[float]) -> Result:
    return Result(200, ttft_s=ttft_s, tokens=len(times), decode_s=times[-1] - times[0], chunk_times=times,
                  sent_at=start)


def test_goodput_counts_the_good_requests_tokens_within_the_rates_window():
    start, seconds = 100.0, 10.0
    results = [
        streamed(0.2, 100.0, [100.2 + 0.1 * i for i in range(20)]),      # all 20 within the window
        streamed(0.35, 109.0, [109.35 + 0.1 * i for i in range(20)]),    # 7 within, 13 after it
        streamed(5.0, 101.0, [106.0 + 0.1 * i for i in range(20)]),      # a first token too late: none
        Result(429, latency_s=0.002, sent_at=105.0, retry_after=True),
    ]
    row = open_loop_row(1.0, 1.0, results, start, seconds, unloaded_ttft=0.5, ttft_target=1.0, speed_target=2.0)
    assert row["goodput"] == (20 + 7) / seconds
    assert row["goodput_at_target"] == (20 + 7) / seconds
    assert (row["ok"], row["refused"], row["refused_within_100ms"]) == (3, 1, 1)
