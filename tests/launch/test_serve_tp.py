"""Real-model tensor-parallel serving on the CPU (gloo), issue 13: `minisgl serve --tp 3` of the
embedded model gives the same greedy text as `--tp 1`, and in-flight streams end with "abort" then
`data: [DONE]` when a non-zero rank's scheduler is killed, the server then exiting 1.

The embedded SmolLM2-135M has 9 attention heads and 3 KV heads, so 3 is its smallest tensor-parallel
size above 1 (`--tp 2` is refused at start-up: "num_attention_heads 9 is not divisible by 2").
Three ranks share the CI machine's two cores and synchronise over gloo every layer, so a step takes
seconds: slow."""

from __future__ import annotations

import time

import httpx
import psutil
import pytest
from test_reliability_procs import Stream, pid_of
from test_server import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ("--max-seq-len", "256")
PROMPTS = ["The capital of France is", "Once upon a time"]


def greedy(srv: ServerProcess, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def reference() -> list[str]:
    srv = ServerProcess(*ARGS)
    try:
        return [greedy(srv, p) for p in PROMPTS]
    finally:
        srv.stop()


def test_tp3_greedy_equals_tp1_and_a_dead_rank_aborts_streams(reference: list[str]) -> None:
    srv = ServerProcess(*ARGS, "--tp", "3")
    try:
        assert [greedy(srv, p) for p in PROMPTS] == reference
        streams = [Stream(srv.url, 200).start() for _ in range(2)]
        for s in streams:
            assert s.first.wait(300) and s.lines, s.error
        psutil.Process(pid_of(srv, "scheduler rank 1")).kill()
        start = time.monotonic()
        assert srv.proc.wait(120) == 1
        print(f"\nkill -9 of scheduler rank 1: the server exited {time.monotonic() - start:.2f} s later")
        for s in streams:
            s.wait_ended(60)
            assert s.finish_reason() == "abort", (s.lines[-2:], s.error)
        assert srv.stop() == 1
        assert srv.leftovers() == []
        assert "scheduler rank 1 was killed by signal 9; shutting the server down" in srv.output()
    finally:
        srv.stop()
