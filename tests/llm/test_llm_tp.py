"""`LLM(model, tp=N)`: N scheduler processes behind the offline API. The same tokens as tp=1; close(),
`with`, and interpreter exit leave no process behind; a rank that dies raises RankFailed naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from minisgl import LLM, SamplingParams
from minisgl.llm import MultiRankLLM, RankFailed

pytestmark = pytest.mark.timeout(300)

PROMPTS: list[str | list[int]] = ["Once upon a time", [1, 2, 3], "The capital of France is"]


def _tokens(llm: object, params: SamplingParams) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, params)]  # type: ignore[attr-defined]


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_tp2_dummy_engine_equals_tp1_then_a_dead_rank_raises() -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = _tokens(LLM(device="cpu", engine="dummy"), params)
    with LLM(device="cpu", engine="dummy", tp=2) as llm:
        assert isinstance(llm, MultiRankLLM)
        assert _tokens(llm, params) == expected
        assert _tokens(llm, params) == expected  # and again: the ranks stay in step
        pids = list(llm.pids)
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankFailed, match="LLM rank 1 was killed by signal 9"):
            llm.generate("Hi", SamplingParams(max_tokens=50, ignore_eos=True))
        assert llm.closed
        with pytest.raises(RuntimeError, match="closed"):
            llm.generate("Hi", params)
    assert _gone(pids)


def test_tp_must_be_a_positive_int() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tp must be an int >= 1"):
            LLM(device="cpu", engine="dummy", tp=bad)


def test_interpreter_exit_leaves_no_process() -> None:
    """A script that never closes its LLM: the finalizer stops the ranks at exit."""
    script = textwrap.dedent(
        """
        import sys
        from minisgl import LLM, SamplingParams
        if __name__ == "__main__":
            kept = LLM(device="cpu", engine="dummy", tp=2)
            print(*kept.pids, flush=True)
            print(kept.generate([1, 2], SamplingParams(max_tokens=3, ignore_eos=True))[0]["token_ids"])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    pids = [int(p) for p in lines[0].split()]
    assert len(pids) == 2
    assert lines[1].startswith("[") and len(eval(lines[1])) == 3
    assert _gone(pids)


@pytest.mark.slow
def test_tp3_equals_tp1_on_the_embedded_model() -> None:
    """9 attention heads and 3 KV heads: tp 3 splits both."""
    params = SamplingParams(temperature=0, max_tokens=12)
    expected = _tokens(LLM(device="cpu"), params)
    with LLM(device="cpu", tp=3) as llm:
        assert _tokens(llm, params) == expected
