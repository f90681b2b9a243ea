"""The offline LLM on the embedded model (CPU, `dtype="float32"`: the dequantized reference path):
token-exact vs transformers, batching, chunked prefill, a pool too small for everyone, seeds, top-k,
stop tokens, bad inputs, chat; and the default (the GGUF's blocks kept) against it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from minisgl import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like apples.",
    "Q: What is the boiling point of water?\nA:",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "Hi",
]
N_NEW = 20  # page crossings for every prompt (CPU pages of 16); 32 cost ~30 s more of `make test`
GREEDY = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One torch thread: on a shared 2-core box, two spinning OpenMP threads are often 10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    yield LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompt_ids(llm: LLM) -> list[list[int]]:
    return [list(llm.tokenizer.encode(p)) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_tokens(prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy generate on the same weights, one prompt at a time (no padding)."""
    from minisgl.models import resolve_model_path
    from minisgl.models.reference import transformers_model

    hf = transformers_model(resolve_model_path(None))
    # No EOS at all, so both sides produce N_NEW tokens from unmodified logits (min_new_tokens would
    # instead mask the EOS logits, which our ignore_eos does not).
    hf.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N_NEW, pad_token_id=0)
            out.append(gen[0, len(ids) :].tolist())
    del hf
    return out


def test_greedy_batched_matches_transformers(
    llm: LLM, prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    outs = llm.generate(prompt_ids, GREEDY)  # all prompts together, different lengths
    assert [o["token_ids"] for o in outs] == hf_tokens
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == N_NEW for o in outs)
    assert outs[0]["text"] == llm.tokenizer.decode(hf_tokens[0], skip_special_tokens=True)


def test_plain_torch_paths_match_transformers(
    prompt_ids: list[list[int]], hf_tokens: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the C kernels unavailable (no compiler, or MINISGL_CPU_KERNELS=0) every layer, the decode
    attention and the decode matmuls take their torch paths: the same tokens."""
    import minisgl.kernels

    monkeypatch.setattr(minisgl.kernels, "available", lambda: False)
    monkeypatch.setattr(minisgl.kernels, "fits", lambda *tensors: False)
    plain = LLM(device="cpu", dtype="float32")
    try:
        assert not plain.engine.attn_backend.decode_kernel
        outs = plain.generate(prompt_ids, GREEDY)
        assert [o["token_ids"] for o in outs] == hf_tokens
    finally:
        del plain


def test_text_prompts_alone_match_transformers(llm: LLM, hf_tokens: list[list[int]]) -> None:
    for i in (2, 7):  # the longest and the shortest prompt, each alone, as text
        assert llm.generate(PROMPTS[i], GREEDY)[0]["token_ids"] == hf_tokens[i]


def test_tiny_prefill_budget_and_tiny_pool_give_the_same_tokens(
    prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    # 7 prefill tokens per step forces chunking of every prompt; 24 pages of 4 tokens (96 slots) hold
    # about one and a half requests, so most wait for pages and running ones get retracted.
    small = LLM(device="cpu", dtype="float32", max_prefill_tokens=7, page_size=4, num_pages=24)
    try:
        idx = [2, 0, 6, 5]
        outs = small.generate([prompt_ids[i] for i in idx], GREEDY)
        assert [o["token_ids"] for o in outs] == [hf_tokens[i] for i in idx]
        assert small.prefill.num_page_waits > 0
        assert small.num_retractions > 0
        alloc = small.table.allocator
        assert alloc.num_free + small.cache.prefix.num_pages == alloc.num_pages  # no request holds one
        small.check_integrity()
    finally:
        del small


def test_seeds_reproduce_and_differ(llm: LLM, prompt_ids: list[list[int]]) -> None:
    p = prompt_ids[2]

    def run(seed: int | None, others: int = 0) -> list[int]:
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=seed)
        batch = [p] + prompt_ids[:others]
        params = [sp] + [SamplingParams(temperature=0.7, max_tokens=5)] * others
        return llm.generate(batch, params)[0]["token_ids"]

    a, b, c = run(1), run(1), run(2)
    assert a == b
    assert a != c
    assert run(1, others=3) == a  # batch mates do not change a seeded request's draws


def test_top_k_1_equals_greedy(llm: LLM, prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    sp = SamplingParams(temperature=0.9, top_k=1, max_tokens=N_NEW, ignore_eos=True)
    assert llm.generate(prompt_ids[4], sp)[0]["token_ids"] == hf_tokens[4]


def test_degenerate_sampling_params_run_and_match_greedy(
    llm: LLM, prompt_ids: list[list[int]], hf_tokens: list[list[int]]
) -> None:
    """Issue 9: temperatures and top_p that round to 0 in float32 once made the sampler index -1 and
    killed the scheduler. Tiny temperatures now sample greedily; a tiny top_p keeps the top token."""
    batch = [prompt_ids[0], prompt_ids[1], prompt_ids[5]]
    params = [
        SamplingParams(temperature=1e-40, max_tokens=N_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=1e-46, max_tokens=N_NEW, ignore_eos=True, seed=3),
        SamplingParams(temperature=2e-6, top_k=2**80, max_tokens=N_NEW, ignore_eos=True),
    ]
    outs = llm.generate(batch, params)
    assert [o["token_ids"] for o in outs] == [hf_tokens[0], hf_tokens[1], hf_tokens[5]]
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            llm.generate("Hi", SamplingParams(temperature=bad, max_tokens=2))


def test_stop_token_ids_and_eos(llm: LLM, prompt_ids: list[list[int]], hf_tokens: list[list[int]]) -> None:
    ref = hf_tokens[3]
    stop = ref[5]
    out = llm.generate(prompt_ids[3], SamplingParams(max_tokens=N_NEW, stop_token_ids=[stop]))[0]
    assert out["finish_reason"] == "stop"
    assert out["token_ids"] == ref[: ref.index(stop) + 1]
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=200))[0]
    assert chat["finish_reason"] == "stop" and chat["token_ids"][-1] in llm.eos_ids


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", None, "prompt 0: the prompt is empty"),
        ([], None, "must be a string"),
        ([[]], None, "prompt 0: the prompt is empty"),
        ([[5, -1]], None, "out of vocabulary"),
        ([[5, 10**6]], None, "out of vocabulary"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
        ("hi", SamplingParams(temperature=-0.5), "temperature must be >= 0"),
        ("hi", SamplingParams(max_tokens=10**6), "maximum context length"),
        (["a", "b"], [SamplingParams()], "one per prompt"),
    ],
)
def test_bad_inputs_raise_clear_errors_and_lose_nothing(
    llm: LLM, prompt: object, params: SamplingParams | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)  # type: ignore[arg-type]
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0]["token_ids"]  # still works


def test_the_offline_path_checks_a_request_once(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """generate() checks every request before it queues any; the in-process scheduler then trusts them."""
    import minisgl.llm.api as api
    import minisgl.scheduler.scheduler as scheduler

    checked, real = [], api.check_request

    def counting(token_ids: list[int], *rest: object) -> None:
        checked.append(list(token_ids))
        real(token_ids, *rest)

    monkeypatch.setattr(api, "check_request", counting)
    monkeypatch.setattr(scheduler, "check_request", counting)
    assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0]["token_ids"]
    assert checked == [[5, 6, 7]]


def test_unknown_option_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(device="cpu", max_prefil_tokens=5)


def test_chat_answers_the_capital_of_france(llm: LLM) -> None:
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=30)
    )
    assert "Paris" in out[0]["text"]
    assert out[0]["finish_reason"] in ("stop", "length")


def test_llm_starts_without_transformers_and_its_tokenizer_is_transformers() -> None:
    """LLM() encodes, decodes and chats through tokenizer.json alone (transformers' import is ~1.5 s
    of its start); `llm.tokenizer` is still transformers' tokenizer, loaded when first asked for,
    and gives the same ids and text."""
    import subprocess
    import sys

    code = """
import sys
import minisgl
llm = minisgl.LLM(device="cpu")
out = llm.generate(["The capital of France is"], minisgl.SamplingParams(max_tokens=4, ignore_eos=True))[0]
assert "transformers" not in sys.modules, "LLM() and generate() imported transformers"
tok = llm.tokenizer
from transformers import PreTrainedTokenizerBase
assert isinstance(tok, PreTrainedTokenizerBase), type(tok)
assert tok.encode("The capital of France is") == llm._text.encode("The capital of France is")
assert tok.decode(out["token_ids"], skip_special_tokens=True) == out["text"], out
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
