"""Embeddings: the offline `LLM.embed()` and `POST /v1/embeddings` (through the openai client) on a
tiny random Qwen3 written by the test, checked in float32 (`dtype="float32"`: float32 weights and KV
pool) against transformers' final hidden states (last-token
and mean pooling, prompts split into several prefill chunks, a Qwen3-Embedding style checkpoint with
--task embed, Matryoshka truncation), and on the embedded model (float and base64, every input shape,
the errors in OpenAI's format). An embedding request is prefill only: no token sampled, no KV kept,
and its hidden state travels as float32 bytes in the extras of the per-token messages."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import numpy as np
import pytest
import torch
from test_models_support import save_tiny_hf_model
from test_server import ServerProcess, openai_client, served

from minisgl.core import RequestRejected, SamplingParams
from minisgl.llm import LLM
from minisgl.message import BaseFrontendMsg, BaseTokenizerMsg, DetokenizeExtra, DetokenizeMsg

pytestmark = pytest.mark.timeout(300)

TEXTS = ["hello world", "a", "The quick brown fox jumps over the lazy dog, twice over."]


def write_pooling(model_dir: Path, mode: str) -> None:
    """sentence-transformers' modules.json and Pooling config with one pooling mode on."""
    (model_dir / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (model_dir / "1_Pooling").mkdir(exist_ok=True)
    (model_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 64, f"pooling_mode_{mode}": True})
    )


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model("Qwen3ForCausalLM", tmp_path_factory.mktemp("qwen3"), tie=True, head_dim=16)


@pytest.fixture(scope="module")
def mean_dir(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("qwen3-mean")
    shutil.copytree(qwen3_dir, out, dirs_exist_ok=True)
    write_pooling(out, "mean_tokens")
    return out


@pytest.fixture(scope="module")
def embed_dir(qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3 as Qwen3-Embedding ships: the base model's weights (no LM head, no `model.`
    prefix) under a config that names Qwen3ForCausalLM, last-token pooling, Matryoshka sizes."""
    from transformers import AutoModel

    out = tmp_path_factory.mktemp("qwen3-embedding")
    AutoModel.from_pretrained(str(qwen3_dir), dtype=torch.float32).save_pretrained(str(out))
    for f in qwen3_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForCausalLM"], "matryoshka_dimensions": [8, 16, 32, 64]}
    (out / "config.json").write_text(json.dumps(config))
    write_pooling(out, "lasttoken")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        names = list(fh.keys())
    assert "lm_head.weight" not in names and not any(n.startswith("model.") for n in names)
    return out


def reference(model_dir: Path, ids: list[list[int]], mode: str, dims: int | None = None) -> list[np.ndarray]:
    """transformers' final hidden states of each prompt alone, pooled and normalised."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in ids:
            h = hf(torch.tensor([p])).last_hidden_state[0]  # (T, H)
            v = (h[-1] if mode == "last" else h.mean(0))[:dims]
            out.append(torch.nn.functional.normalize(v, dim=0).numpy())
    return out


def assert_close(got: list[list[float]] | np.ndarray, want: list[np.ndarray], atol: float = 2e-5) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, dtype=np.float32), w, atol=atol, rtol=0)


def test_llm_embed_matches_transformers_last_token(qwen3_dir: Path) -> None:
    with LLM(str(qwen3_dir), device="cpu", dtype="float32", num_pages=64) as llm:
        ids = [llm.tokenizer.encode(t) for t in TEXTS]
        prefills = llm.engine.stats.prefill_batches
        got = llm.embed(TEXTS)
        assert llm.engine.stats.prefill_batches == prefills + 1  # the three prompts in one step
        assert_close(llm.embed(ids[0]), [np.array(got[0])], 1e-5)  # token ids give the same as the text
        # nothing kept: every page free again, the prefix cache empty (a generation's prompt is cached)
        assert llm.table.allocator.num_free == llm.table.allocator.num_pages
        assert llm.cache.prefix.num_pages == 0
        llm.generate(TEXTS[2], SamplingParams(max_tokens=2))
        assert llm.cache.prefix.num_pages > 0
    assert_close(got, reference(qwen3_dir, ids, "last"))
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in got)


def test_llm_embed_mean_pooling_over_prefill_chunks(mean_dir: Path) -> None:
    # 5 tokens a step: the long prompt is pooled over chunks of several steps, next to the others
    with LLM(
        str(mean_dir), device="cpu", dtype="float32", num_pages=64, max_prefill_tokens=5, page_size=4
    ) as llm:
        ids = [llm.tokenizer.encode(t) for t in TEXTS]
        got = llm.embed(TEXTS)
        assert llm.engine.stats.prefill_batches > 10
    assert_close(got, reference(mean_dir, ids, "mean"))


def test_task_embed_loads_an_embedding_checkpoint(embed_dir: Path) -> None:
    with LLM(str(embed_dir), task="embed", device="cpu", dtype="float32", num_pages=64) as llm:
        ids = [llm.tokenizer.encode(t) for t in TEXTS]
        assert_close(llm.embed(TEXTS), reference(embed_dir, ids, "last"))
        assert_close(llm.embed(TEXTS, dimensions=16), reference(embed_dir, ids, "last", dims=16))
        with pytest.raises(ValueError, match="may be truncated to 8, 16, 32, 64 dimensions, not 12"):
            llm.embed(TEXTS, dimensions=12)
        [res] = llm.generate("hello", SamplingParams(max_tokens=2))
        assert res["finish_reason"] == "error" and "only embeddings" in res["error"]
        with pytest.raises(RequestRejected, match="prompt 1: the prompt is empty"):
            llm.embed(["ok", ""])
        with pytest.raises(RequestRejected, match="maximum context length is 256 tokens"):
            llm.embed("x" * 300)


def test_embedding_travels_as_float32_bytes_in_the_extras() -> None:
    vec = np.arange(6, dtype=np.float32) / 7
    msg = DetokenizeMsg(3, -1, True, "stop", DetokenizeExtra(embedding=vec.tobytes()))
    back = BaseTokenizerMsg.from_bytes(msg.to_bytes())
    assert isinstance(back, DetokenizeMsg) and back.extra is not None
    assert np.array_equal(np.frombuffer(back.extra.embedding, np.float32), vec)
    raw = msg.to_bytes()
    assert vec.tobytes() in raw  # one msgpack bin, not a list of floats
    # a plain token's message is the chapters' three fields, as before
    plain = {"__type__": "DetokenizeMsg", "uid": 3, "next_token": 17, "finished": False}
    assert DetokenizeMsg(3, 17, False).to_bytes() == msgpack.packb(plain)
    from minisgl.message import UserReply, UserReplyExtra

    reply = UserReply(3, "", True, "stop", extra=UserReplyExtra(embedding=vec.tobytes()))
    got = BaseFrontendMsg.from_bytes(reply.to_bytes())
    assert isinstance(got, UserReply) and got.extra is not None and got.extra.embedding == vec.tobytes()


# -- the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    yield from served("--max-seq-len", "256", "--served-model-name", "smol")


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai_client(server)


def _post(server: ServerProcess, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)


def test_server_embeddings_float_and_base64(server: ServerProcess, client) -> None:
    text = "The capital of France is Paris."
    out = client.embeddings.create(model="smol", input=text)  # the client asks for base64
    [item] = out.data
    assert out.model == "smol" and item.index == 0 and len(item.embedding) == 576
    assert abs(np.linalg.norm(item.embedding) - 1) < 1e-5
    assert out.usage.prompt_tokens == out.usage.total_tokens > 3
    plain = client.embeddings.create(model="smol", input=text, encoding_format="float")
    assert plain.data[0].embedding == item.embedding  # float32 both ways, exactly
    raw = _post(server, {"input": text, "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == item.embedding and raw["object"] == "list"
    with LLM(device="cpu", max_seq_len=256) as llm:  # the same model offline
        np.testing.assert_allclose(llm.embed(text)[0], item.embedding, atol=1e-4)
        ids = llm.tokenizer.encode(text)
    by_ids = client.embeddings.create(model="smol", input=ids, encoding_format="float")
    np.testing.assert_allclose(by_ids.data[0].embedding, item.embedding, atol=1e-5)


def test_server_embeddings_of_several_inputs(server: ServerProcess, client) -> None:
    texts = ["one", "two words", "and a third, longer input"]
    many = client.embeddings.create(model="smol", input=texts, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    single = [client.embeddings.create(model="smol", input=t, encoding_format="float") for t in texts]
    for d, s in zip(many.data, single, strict=True):
        np.testing.assert_allclose(d.embedding, s.data[0].embedding, atol=1e-5)
    assert many.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    ids = _post(server, {"input": [[1, 2, 3], [4, 5]]}).json()
    assert [len(d["embedding"]) for d in ids["data"]] == [576, 576] and ids["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    "body, status, words",
    [
        ({"input": ""}, 400, "input is empty"),
        ({"input": []}, 400, "input must not be empty"),
        ({"input": ["ok", ""]}, 400, "input[1] is empty"),
        ({"input": [[1, 2], []]}, 400, "input[1] is empty"),
        ({"input": [1, "a"]}, 400, "input"),
        ({"input": 5}, 400, "input"),
        ({"input": "x", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"input": "x", "dimensions": 64}, 400, "not trained for shorter ones"),
        ({"input": "x", "dimensions": 0}, 400, "dimensions"),
        ({"input": "x", "model": "other"}, 404, "does not exist"),
        ({"input": [10**6]}, 400, "is out of vocabulary"),
        ({"input": "word " * 400}, 400, "context"),
        ({"input": ["x"] * 2049}, 400, "at most 2048 inputs"),
    ],
)
def test_server_embedding_errors(server: ServerProcess, body: dict, status: int, words: str) -> None:
    r = _post(server, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) == {"message", "type", "param", "code"}, err


def test_server_embeddings_next_to_generation(server: ServerProcess, client) -> None:
    import threading

    texts: list[str] = []

    def chat() -> None:
        stream = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=24, stream=True
        )
        texts.extend(c.choices[0].delta.content or "" for c in stream if c.choices)

    t = threading.Thread(target=chat)
    t.start()
    out = [
        client.embeddings.create(model="smol", input=f"input {i}", encoding_format="float") for i in range(4)
    ]
    t.join(120)
    assert "".join(texts) and all(len(o.data[0].embedding) == 576 for o in out)


def test_server_task_embed_serves_an_embedding_model(embed_dir: Path) -> None:
    srv = ServerProcess(
        "--model", str(embed_dir), "--task", "embed", "--dtype", "float32", "--max-seq-len", "128"
    )
    try:
        client = openai_client(srv)
        out = client.embeddings.create(model=str(embed_dir), input=TEXTS, encoding_format="float")
        short = client.embeddings.create(model=str(embed_dir), input=TEXTS, dimensions=8)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and "only embeddings" in r.json()["error"]["message"], r.text
    finally:
        assert srv.stop() == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embed_dir))
    ids = [tok.encode(t) for t in TEXTS]
    assert_close([d.embedding for d in out.data], reference(embed_dir, ids, "last"))
    assert_close([d.embedding for d in short.data], reference(embed_dir, ids, "last", dims=8))


def test_every_field_of_openais_embeddings_request_is_known() -> None:
    """The installed openai package's embeddings request fields are all EmbeddingRequest's (none is
    dropped by `extra="ignore"`)."""
    from openai.types import embedding_create_params

    from minisgl.entrypoints.openai.embeddings.protocol import EmbeddingRequest

    fields = set(embedding_create_params.EmbeddingCreateParams.__annotations__)
    assert {"input", "model", "dimensions", "encoding_format"} <= fields
    assert fields <= set(EmbeddingRequest.model_fields), fields - set(EmbeddingRequest.model_fields)


@pytest.mark.parametrize("overlap", [False, True])
def test_embeddings_share_steps_with_generation_and_survive_retraction(mean_dir: Path, overlap: bool) -> None:
    """Generations and mean-pooled embeddings in one run of a pool too small for all of them: the
    scheduler retracts requests (an embedding included, on some runs) and recomputes them; every
    embedding still equals transformers', every generation its run alone. With overlap scheduling
    (on the CPU here) an embedding's answer is pending like a token."""
    gen = SamplingParams(max_tokens=30, ignore_eos=True)
    prompts = [f"story {i}: once" for i in range(4)]
    with LLM(str(mean_dir), device="cpu", dtype="float32", num_pages=64) as llm:
        alone = [r["token_ids"] for r in llm.generate(prompts, gen)]
        ids = [llm.tokenizer.encode(t) for t in TEXTS]
    options = dict(
        device="cpu",
        dtype="float32",
        num_pages=20,
        page_size=4,
        max_prefill_tokens=8,
        overlap_schedule=overlap,
    )
    with LLM(str(mean_dir), **options) as llm:
        embed = SamplingParams(max_tokens=1, embed=True)
        token_lists = [llm.tokenizer.encode(p) for p in prompts] + ids
        results = llm._run(token_lists, [gen] * len(prompts) + [embed] * len(ids))
        assert llm.num_retractions > 0
        assert llm.table.allocator.num_free + llm.cache.prefix.num_pages == llm.table.allocator.num_pages
    assert [r["token_ids"] for r in results[: len(prompts)]] == alone
    from minisgl.models.pooling import embedding_vector

    assert_close(
        [embedding_vector(r["embedding"]) for r in results[len(prompts) :]], reference(mean_dir, ids, "mean")
    )
