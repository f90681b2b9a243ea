"""The serving benchmark's statistics and report, on hand-made results (no server)."""

from __future__ import annotations

import json
import math

from minisgl.benchmark.serve import (
    BenchConfig,
    RequestResult,
    format_table,
    load_prompts,
    percentile,
    plot,
    random_prompts,
    summarize,
)


def test_percentile_interpolates() -> None:
    xs = [float(x) for x in range(1, 101)]
    assert percentile(xs, 50) == 50.5
    assert percentile(xs, 0) == 1 and percentile(xs, 100) == 100
    assert math.isclose(percentile(xs, 99), 99.01)
    assert math.isnan(percentile([], 50))


def test_summary_and_table() -> None:
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itl=[0.1] * 4),
        RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.2, e2e=0.4, itl=[0.1] * 2),
        RequestResult(ok=False, error="HTTP 503: busy"),
    ]
    s = summarize(BenchConfig(), results, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 503: busy"]
    assert s["output_tokens"] == 8 and s["output_throughput"] == 4.0 and s["request_throughput"] == 1.0
    assert math.isclose(s["ttft_ms"]["mean"], 150.0) and math.isclose(s["ttft_ms"]["p50"], 150.0)
    assert math.isclose(s["tpot_ms"]["mean"], 100.0)  # (0.5-0.1)/4 and (0.4-0.2)/2
    assert math.isclose(s["itl_ms"]["p99"], 100.0)
    json.dumps(s)
    table = format_table(s)
    for word in ("TTFT", "ITL", "TPOT", "E2E", "4.0 output tok/s", "2 ok, 1 failed", "HTTP 503"):
        assert word in table


def test_prompts_are_seeded_and_files_cycle(tmp_path) -> None:
    assert random_prompts(3, 5, seed=1) == random_prompts(3, 5, seed=1)
    assert random_prompts(3, 5, seed=1) != random_prompts(3, 5, seed=2)
    assert all(len(p.split()) == 5 for p in random_prompts(3, 5, seed=1))
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a b"}\nplain line\n\n')
    assert load_prompts(str(f), 3) == ["a b", "plain line", "a b"]


def test_plot_writes_a_png(tmp_path) -> None:
    results = [
        RequestResult(ok=True, output_tokens=4, ttft=0.01 * i, e2e=0.1 + 0.01 * i, itl=[0.02, 0.03])
        for i in range(1, 20)
    ]
    path = tmp_path / "lat.png"
    plot(results, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
