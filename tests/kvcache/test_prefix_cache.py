"""Prefix caching in the scheduler (CPU): greedy tokens equal to the naive cache's on shared-prefix
and multi-turn workloads, only the uncached suffix prefilled (counted), concurrent requests sharing a
prefix while it is prefilled, eviction in a tiny pool, aborts mid-prefill, overlap scheduling caching
only what returned steps computed, the same decisions in processes with different hash seeds, and a
property test over random submit/abort/finish interleavings (plain and overlapped)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_models_support import save_tiny_hf_model

from minisgl import LLM, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.kernels.triton import triton_available
from minisgl.message import AbortBackendMsg, BaseTokenizerMsg, DetokenizeExtra, DetokenizeMsg, UserMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.scheduler import Scheduler
from minisgl.tokenizer.detokenize import DetokenizeManager

PS = 4  # page size of every test here: prefixes of a few pages stay short
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), False)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 131) for _ in range(n)]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _no_request_pages(s: Scheduler) -> bool:
    alloc = s.table.allocator
    return alloc.num_free + s.cache.prefix.num_pages == alloc.num_pages


def _llm(model_dir: Path, cache_type: str, **opts: Any) -> LLM:
    return LLM(str(model_dir), device="cpu", page_size=PS, cache_type=cache_type, **opts)


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = [o["token_ids"] for o in llm.generate(prompts, params)]
    llm.check_integrity()
    assert _no_request_pages(llm)
    return outs


# -- same tokens as without the cache -------------------------------------------------------------


def _shared_prefix_workload(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """3 system prompts of 30-50 tokens, 12 requests with short own suffixes, interleaved."""
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randint(30, 50)) for _ in range(3)]
    prompts = [systems[i % 3] + _tokens(rng, rng.randint(1, 12)) for i in range(12)]
    return prompts, [_greedy(rng.randint(1, 16)) for _ in prompts]


@pytest.mark.parametrize("overlap", [False, True])
def test_shared_prefix_workload_gives_the_naive_caches_tokens(model_dir: Path, overlap: bool) -> None:
    prompts, params = _shared_prefix_workload(0)
    opts = dict(max_prefill_tokens=32, overlap_schedule=overlap)
    naive = _llm(model_dir, "naive", **opts)
    radix = _llm(model_dir, "radix", **opts)
    for _ in range(2):  # the second round finds every system prompt cached
        assert _run(radix, prompts, params) == _run(naive, prompts, params)
    assert naive.cache.stats.cached_tokens == 0
    stats = radix.cache.stats
    assert stats.cached_tokens > 0.6 * stats.prompt_tokens  # most of the second round, some of the first
    assert radix.num_prefill_tokens + stats.cached_tokens == naive.num_prefill_tokens


# triton on the CPU is its interpreter: 24 s here, covered on the GPU machine and by the kernels' own tests
@pytest.mark.parametrize(
    "attention",
    ["torch", pytest.param("triton", marks=[pytest.mark.slow] if DEV == "cpu" else [])]
    + (["cpu"] if DEV == "cpu" else []),
)
def test_every_attention_backend_gives_the_naive_caches_tokens(model_dir: Path, attention: str) -> None:
    """Prefill over a cached prefix runs each backend's extend path (Triton's varlen kernel runs in
    Triton's interpreter without a GPU; on a GPU, with overlap scheduling and CUDA graphs)."""
    if attention == "triton" and not triton_available():
        pytest.skip("triton is not installed")
    prompts, _ = _shared_prefix_workload(5)
    # the second shares the first's system prompt (every third request of the workload does); the
    # Triton kernels run in the interpreter without a GPU, so no more requests than that
    prompts, params = [prompts[0], prompts[3]], [_greedy(4)] * 2
    outs = {}
    for kind in ("naive", "radix"):
        llm = LLM(
            str(model_dir), device=DEV, dtype="float32", page_size=PS, cache_type=kind,
            attention_backend=attention, max_prefill_tokens=32, num_pages=128,
        )  # fmt: skip
        assert llm.engine.attn_backend.name == attention
        outs[kind] = _run(llm, prompts, params)
        if kind == "radix":
            assert llm.cache.stats.cached_tokens >= 28  # the shared system prompt's whole pages
    assert outs["radix"] == outs["naive"]


def test_multi_turn_chat_gives_the_naive_caches_tokens(model_dir: Path) -> None:
    """Each turn resends the history (prompt + answer) plus a new message: all but the last partial
    page of the history comes from the cache."""
    rng = random.Random(1)
    llms = {kind: _llm(model_dir, kind, max_prefill_tokens=24) for kind in ("naive", "radix")}
    prompts = [_tokens(rng, 20)]
    for turn in range(4):
        outs = {kind: llm.generate([prompts[-1]], _greedy(10))[0] for kind, llm in llms.items()}
        assert outs["radix"]["token_ids"] == outs["naive"]["token_ids"], turn
        assert outs["naive"]["cached_tokens"] == 0
        if turn:  # the previous turn's prompt and answer but the token it never fed, in whole pages
            assert outs["radix"]["cached_tokens"] == (len(prompts[-2]) + 10 - 1) // PS * PS
        prompts.append(prompts[-1] + outs["radix"]["token_ids"] + _tokens(rng, rng.randint(3, 9)))
    for llm in llms.values():
        llm.check_integrity()


def test_embedded_model_multi_turn_chat_is_unchanged_by_the_cache() -> None:
    """The real model (float32 CPU kernels; prefill over a cached prefix takes the extend path): a
    three-turn chat with a system prompt gives the naive cache's answers."""
    system = {"role": "system", "content": "You are a geography teacher. Answer in one short sentence."}
    questions = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    answers: dict[str, list[str]] = {}
    cached: list[int] = []
    for kind in ("naive", "radix"):
        llm = LLM(device="cpu", cache_type=kind, num_pages=256)
        conv = [system]
        answers[kind] = []
        for q in questions:
            conv.append({"role": "user", "content": q})
            [res] = llm.chat(conv, SamplingParams(max_tokens=24))
            conv.append({"role": "assistant", "content": res["text"]})
            answers[kind].append(res["text"])
            if kind == "radix":
                cached.append(res["cached_tokens"])
        llm.check_integrity()
        del llm
    assert answers["radix"] == answers["naive"]
    assert "Paris" in answers["radix"][0]
    assert cached[0] == 0 and cached[1] > 30 and cached[2] > cached[1]  # the history grows, cached


# -- what is prefilled ----------------------------------------------------------------------------


def test_second_request_prefills_only_its_suffix(model_dir: Path) -> None:
    rng = random.Random(2)
    shared = _tokens(rng, 64)  # 16 whole pages
    a, b = shared + _tokens(rng, 5), shared + _tokens(rng, 7)
    llm = _llm(model_dir, "radix")
    [ra] = llm.generate([a], _greedy(8))
    assert ra["cached_tokens"] == 0 and llm.num_prefill_tokens == len(a)
    fed, engine_fed = llm.num_prefill_tokens, llm.engine.stats.prefill_tokens
    [rb] = llm.generate([b], _greedy(8))
    assert rb["cached_tokens"] == 64
    assert llm.num_prefill_tokens - fed == 7 and llm.engine.stats.prefill_tokens - engine_fed == 7
    fed = llm.num_prefill_tokens
    [again] = llm.generate([a], _greedy(8))  # cached whole: all but the last token (68 = 17 pages)
    assert again["cached_tokens"] == 68 and llm.num_prefill_tokens - fed == 1
    assert again["token_ids"] == ra["token_ids"]
    naive = _llm(model_dir, "naive")
    assert [r["token_ids"] for r in naive.generate([a, b], _greedy(8))] == [ra["token_ids"], rb["token_ids"]]


@pytest.mark.parametrize(("overlap", "budget"), [(False, 16), (True, 16), (False, 256), (True, 256)])
def test_concurrent_requests_share_a_prefix_while_it_is_prefilled(
    model_dir: Path, overlap: bool, budget: int
) -> None:
    """A and B (the same 64-token prefix) arrive together. B is not admitted while A is computing
    that prefix (in chunks of 16, or at once), nor, with overlap scheduling, while the step with A's
    last chunk is in flight; then it borrows the whole prefix and prefills only its 7 own tokens."""
    rng = random.Random(3)
    shared = _tokens(rng, 64)
    a, b = shared + _tokens(rng, 5), shared + _tokens(rng, 7)
    llm = _llm(model_dir, "radix", max_prefill_tokens=budget, overlap_schedule=overlap)
    ra, rb = llm.generate([a, b], _greedy(6))
    assert (ra["cached_tokens"], rb["cached_tokens"]) == (0, 64)
    assert llm.num_prefill_tokens == len(a) + 7
    # with chunks of 16 and no overlap, A's budget-filling chunks keep B out until the prefix is cached
    assert (llm.prefill.num_prefix_waits > 0) == (overlap or budget == 256)
    naive = _llm(model_dir, "naive", max_prefill_tokens=budget)
    assert [r["token_ids"] for r in naive.generate([a, b], _greedy(6))] == [ra["token_ids"], rb["token_ids"]]


# -- pool pressure --------------------------------------------------------------------------------


def test_eviction_in_a_tiny_pool_keeps_tokens_and_leaks_nothing(model_dir: Path) -> None:
    """24 pages of 4 tokens: the cache fills up and is evicted (before any retraction), requests wait
    and get retracted, and every token equals the naive cache's."""
    rng = random.Random(4)
    systems = [_tokens(rng, 24) for _ in range(4)]
    prompts = [systems[rng.randrange(4)] + _tokens(rng, rng.randint(1, 10)) for _ in range(16)]
    params = [_greedy(rng.randint(4, 24)) for _ in prompts]
    opts = dict(num_pages=24, max_prefill_tokens=16)
    naive, radix = _llm(model_dir, "naive", **opts), _llm(model_dir, "radix", **opts)
    for i in range(0, 16, 4):  # four rounds: what one round cached is evicted by the next ones
        assert _run(radix, prompts[i : i + 4], params[i : i + 4]) == _run(
            naive, prompts[i : i + 4], params[i : i + 4]
        )
    assert radix.cache.stats.evicted_pages > 0 and radix.cache.stats.cached_tokens > 0
    assert radix.num_retractions > 0 and radix.prefill.num_page_waits > 0
    assert radix.cache.prefix.num_evictable == radix.cache.prefix.num_pages  # nothing pinned when idle


def test_eviction_comes_before_retraction(model_dir: Path) -> None:
    """A pool full of cached pages: a new request's decode growth evicts them and never retracts."""
    rng = random.Random(5)
    llm = _llm(model_dir, "radix", num_pages=16)
    llm.generate([_tokens(rng, 44)], _greedy(9))  # 52 tokens: 13 pages, 12 of them stay cached
    assert llm.cache.prefix.num_pages == 13 and llm.table.allocator.num_free == 3
    llm.generate([_tokens(rng, 8), _tokens(rng, 8)], _greedy(20))  # 2 x 7 pages: needs eviction
    assert llm.num_retractions == 0 and llm.cache.stats.evicted_pages >= 11
    llm.check_integrity()


# -- aborts and overlap ---------------------------------------------------------------------------


class Harness(Scheduler):
    """A scheduler in offline mode with plain-list inbox and outbox (dummy engine or the tiny model)."""

    def __init__(self, model_path: str = "/nonexistent", engine: str = "dummy", **cfg: Any) -> None:
        config = SchedulerConfig(
            model_path=model_path, tp_info=DistributedInfo(0, 1), dtype=torch.float32, engine=engine,
            offline_mode=True, **{"page_size": PS, "num_pages": 64, "max_seq_len": 128, **cfg},
        )  # fmt: skip
        self.inbox: list[Any] = []
        self.outbox: list[BaseTokenizerMsg] = []
        super().__init__(config)

    def offline_receive_msg(self, blocking: bool = False) -> list[Any]:
        msgs, self.inbox = self.inbox, []
        return msgs

    def offline_send_result(self, reply: list[BaseTokenizerMsg]) -> None:
        self.outbox.extend(reply)

    def submit(self, uid: int, ids: list[int], max_tokens: int) -> None:
        self.inbox.append(UserMsg(uid, torch.tensor(ids, dtype=torch.int32), _greedy(max_tokens)))

    def drain(self, max_steps: int = 5000) -> None:
        for _ in range(max_steps):
            if not self.has_work() and not self.inbox and self._in_flight is None:
                return
            self.step()
            self.check_integrity()
        raise AssertionError("the scheduler did not finish its work")

    def replies(self, uid: int) -> list[DetokenizeMsg]:
        return [m for m in self.outbox if isinstance(m, DetokenizeMsg) and m.uid == uid]


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_mid_prefill_leaves_what_returned_in_the_cache(model_dir: Path, overlap: bool) -> None:
    s = Harness(str(model_dir), "model", max_prefill_tokens=8, overlap_schedule=overlap)
    prompt = _tokens(random.Random(6), 40)
    s.submit(1, prompt, 5)
    for _ in range(3):  # three chunks of 8 launched; 3 (2 with overlap) returned
        s.step()
    s.inbox.append(AbortBackendMsg(1))
    s.step()
    assert [m.finish_reason for m in s.replies(1)] == ["abort"]
    s.drain()
    returned = 24 if not overlap else 16
    assert s.cache.prefix.num_pages == returned // PS == s.cache.prefix.num_evictable
    assert _no_request_pages(s)
    s.submit(2, prompt, 5)
    s.drain()
    first, *rest = s.replies(2)
    assert first.extra == DetokenizeExtra(cached_tokens=returned)  # the usage rides on the first token
    assert [m.extra for m in rest] == [None] * 4  # the others are plain


def test_overlap_caches_only_what_returned_steps_computed(model_dir: Path) -> None:
    """With overlap, step N's chunk enters the cache when its tokens are taken (after step N+1 was
    launched), never at launch: the tree trails the request's K/V by one chunk."""
    s = Harness(str(model_dir), "model", max_prefill_tokens=8, overlap_schedule=True)
    s.submit(1, _tokens(random.Random(7), 33), 3)
    s.step()  # chunk 1 launched, nothing returned
    assert s.cache.prefix.num_pages == 0
    for k in range(2, 5):  # chunk k launched, chunk k - 1 returned and cached
        s.step()
        [req] = s.prefill.prefilling
        assert req.cached_len == 8 * k and req.kv_ready_len == 8 * (k - 1)
        assert s.cache.prefix.num_pages == 2 * (k - 1)
    s.drain()
    assert s.cache.prefix.num_pages == (33 + 3 - 1) // PS and _no_request_pages(s)


# -- determinism across processes -----------------------------------------------------------------

_DIGEST_SCRIPT = """
import hashlib, os, random, sys
sys.path[:0] = sys.argv[1].split(os.pathsep)
from minisgl.message import AbortBackendMsg
from test_prefix_cache import Harness, _tokens
s = Harness(num_pages=30, max_prefill_tokens=12, max_running_requests=8)
rng = random.Random(11)
systems = [_tokens(rng, rng.randint(8, 30)) for _ in range(5)]
h = hashlib.sha256()
for step in range(400):
    if step < 300 and rng.random() < 0.4:
        s.submit(step, rng.choice(systems) + _tokens(rng, rng.randint(1, 9)), rng.randint(1, 40))
    if rng.random() < 0.05 and step:
        s.inbox.append(AbortBackendMsg(rng.randrange(step)))
    s.step()
    h.update(repr((s.table.row_pages, s.table.row_shared, s.cache.prefix.held_pages(),
                   s.table.allocator._free, s.cache.stats)).encode())
print(h.hexdigest(), s.cache.stats.evicted_pages, s.num_retractions, s.cache.stats.cached_tokens)
"""


def test_same_decisions_and_placements_under_different_hash_seeds(tmp_path: Path) -> None:
    """Every tensor-parallel rank must place KV identically: two processes with different
    PYTHONHASHSEED run the same message sequence and agree on every page of every step."""
    script = tmp_path / "digest.py"
    script.write_text(_DIGEST_SCRIPT)
    tests_dir = os.environ["MINISGL_TEST_DIRS"]
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, str(script), tests_dir], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout.split())
    assert outs[0] == outs[1]
    evicted, retracted, cached = map(int, outs[0][1:])
    assert evicted > 0 and retracted > 0 and cached > 0  # the run exercised eviction and retraction


# -- random interleavings -------------------------------------------------------------------------

_PREFIXES = [list(range(10, 10 + n)) for n in (3, 9, 17)] + [[7] * 12]
_SUBMIT = st.tuples(st.just("submit"), st.integers(0, 3), st.integers(0, 9), st.integers(1, 30))
_OPS = st.lists(
    st.one_of(
        _SUBMIT,
        _SUBMIT,
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 6)),
    ),
    min_size=4,
    max_size=40,
)


def _interleave(s: Harness, ops: list[tuple]) -> None:
    uid = 0
    for op in ops:
        if op[0] == "submit":
            _, which, extra, max_tokens = op
            s.submit(uid, _PREFIXES[which] + [40 + uid % 50] * extra, max_tokens)
            uid += 1
        elif op[0] == "abort":
            s.inbox.append(AbortBackendMsg(op[1] % max(uid, 1)))
        else:
            for _ in range(op[1]):
                s.step()
                s.check_integrity()
    s.drain()
    assert _no_request_pages(s)
    prefix = s.cache.prefix
    assert prefix.num_evictable == prefix.num_pages  # nothing pinned once idle
    prefix.check()
    ends = [m for m in s.outbox if isinstance(m, DetokenizeMsg) and m.finished]
    assert len({m.uid for m in ends}) == len(ends) == uid  # every request ended exactly once


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(_OPS)
def test_random_interleavings_keep_tree_and_pool_consistent(ops: list[tuple]) -> None:
    _interleave(Harness(num_pages=16, max_prefill_tokens=8, max_running_requests=6), ops)


def test_random_interleavings_overlapped_on_the_model(model_dir: Path) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_OPS)
    def run(ops: list[tuple]) -> None:
        s = Harness(str(model_dir), "model", num_pages=16, max_prefill_tokens=8, overlap_schedule=True)
        assert s.overlap
        _interleave(s, ops)

    run()


# -- the wire -------------------------------------------------------------------------------------


def test_old_detokenize_bytes_decode_and_cached_tokens_reach_the_reply() -> None:
    old = msgpack.packb(
        {"__type__": "DetokenizeMsg", "uid": 3, "next_token": 9, "finished": True, "finish_reason": "stop"}
    )
    msg = BaseTokenizerMsg.from_bytes(old)
    assert msg == DetokenizeMsg(3, 9, True, "stop") and msg.extra is None
    new = DetokenizeMsg(4, 9, True, "stop", DetokenizeExtra(cached_tokens=48))
    assert BaseTokenizerMsg.from_bytes(new.to_bytes()) == new

    class Tok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    reply = DetokenizeManager(Tok()).detokenize(new)
    assert reply.extra is not None and reply.extra.cached_tokens == 48 and reply.finished
