"""Tensor parallelism on CPU (gloo): two ranks give the logits of one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_models_support import run_prompts, save_tiny_hf_model

from minisgl.distributed import DistributedInfo
from minisgl.models import load_model

PROMPTS = [[3, 17, 99, 5, 8], list(range(10, 40)), [120, 7, 7, 64, 33, 2, 90]]
CASES = {  # odd vocab: the last LM-head shard is padded
    "llama-untied": ("LlamaForCausalLM", False, {}),
    "qwen2-tied": ("Qwen2ForCausalLM", True, {}),
    "qwen3-kv-replicated": ("Qwen3ForCausalLM", True, {"num_key_value_heads": 1, "head_dim": 32}),
}

RANK_SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from safetensors.torch import save_file

tests_dir, init, rank, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
backend, device = sys.argv[6], sys.argv[7].replace("RANK", str(rank))
model_dirs = sys.argv[8:]
sys.path[:0] = tests_dir.split(os.pathsep)  # every test folder (conftest's TEST_DIRS)
torch.set_num_threads(1)
from test_models_support import run_prompts
from test_models_tp import PROMPTS
from minisgl.distributed import DistributedInfo
from minisgl.models import load_model

if device.startswith("cuda"):
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=init, rank=rank, world_size=size)
result = {}
for i, d in enumerate(model_dirs):
    model, _ = load_model(d, torch.float32, device, tp_info=DistributedInfo(rank, size), progress=False)
    for j, logits in enumerate(run_prompts(model, PROMPTS)):
        result[f"{i}.{j}"] = logits.cpu().contiguous()
    result[f"{i}.local_heads"] = torch.tensor([model.num_local_heads, model.num_local_kv_heads])
save_file(result, out)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return [
        save_tiny_hf_model(arch, tmp_path_factory.mktemp(name), tie, **extra)
        for name, (arch, tie, extra) in CASES.items()
    ]


def run_ranks(model_dirs: list[Path], tmp_path: Path, size: int, backend: str, device: str) -> list[dict]:
    """Run RANK_SCRIPT in `size` processes; each rank's logits per model and prompt."""
    init = f"file://{tmp_path / 'rendezvous'}"
    outs = [tmp_path / f"rank{r}.safetensors" for r in range(size)]
    tests_dir = os.environ["MINISGL_TEST_DIRS"]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK_SCRIPT,
                tests_dir,
                init,
                str(r),
                str(size),
                str(outs[r]),
                backend,
                device,
            ]
            + [str(d) for d in model_dirs],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(size)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=150)[0].decode(errors="replace"))
        finally:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    return [load_file(str(o)) for o in outs]


def check_ranks_match_one(model_dirs: list[Path], ranks: list[dict], size: int, tol: float = 1e-5) -> None:
    for i, d in enumerate(model_dirs):
        model, cfg = load_model(d, torch.float32, "cpu", progress=False)
        want = run_prompts(model, PROMPTS)
        for r in range(size):
            heads = ranks[r][f"{i}.local_heads"].tolist()
            assert heads == [cfg.num_heads // size, max(1, cfg.num_kv_heads // size)]
            for j, w in enumerate(want):
                torch.testing.assert_close(ranks[r][f"{i}.{j}"], w, atol=tol, rtol=tol)


@pytest.mark.timeout(180)
def test_two_ranks_match_one(model_dirs: list[Path], tmp_path: Path) -> None:
    check_ranks_match_one(model_dirs, run_ranks(model_dirs, tmp_path, 2, "gloo", "cpu"), 2)


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_two_gpus_match_one(model_dirs: list[Path], tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    check_ranks_match_one(model_dirs, run_ranks(model_dirs, tmp_path, 2, "nccl", "cuda:RANK"), 2, tol=1e-4)


def test_indivisible_heads_are_a_clear_error(model_dirs: list[Path]) -> None:
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tensor-parallel size 3"):
        load_model(model_dirs[0], torch.float32, "cpu", tp_info=DistributedInfo(0, 3), dummy=True)


def test_shard_shapes_without_collectives(model_dirs: list[Path]) -> None:
    """Building rank 1 of 2 allocates only its shard (no process group is needed to build)."""
    model, cfg = load_model(
        model_dirs[0], torch.float32, "cpu", tp_info=DistributedInfo(1, 2), progress=False
    )
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv_proj.weight.shape == ((2 + 2 * 1) * cfg.head_dim, cfg.hidden_size)
    assert attn.o_proj.weight.shape == (cfg.hidden_size, 2 * cfg.head_dim)
    assert mlp.down_proj.weight.shape == (cfg.hidden_size, cfg.intermediate_size // 2)
    assert model.lm_head.weight.shape == (66, cfg.hidden_size)  # ceil(131 / 2)
    assert torch.equal(model.lm_head.weight[-1], torch.zeros(cfg.hidden_size))  # padding row
    full, _ = load_model(model_dirs[0], torch.float32, "cpu", progress=False)
    q_rows = full.model.layers[0].self_attn.qkv_proj.weight[2 * cfg.head_dim : 4 * cfg.head_dim]
    assert torch.equal(attn.qkv_proj.weight[: 2 * cfg.head_dim], q_rows)  # heads 2, 3 of 4


@pytest.mark.parametrize("case", range(len(CASES)))
def test_dummy_weights_are_one_model_at_every_tp_size(model_dirs: list[Path], case: int) -> None:
    """Random weights are drawn per checkpoint tensor and sharded: rank 1 of 2 holds its shard of the
    TP=1 model (so TP=2 can be checked against TP=1 without a checkpoint)."""
    full, cfg = load_model(model_dirs[case], torch.float32, "cpu", dummy=True, progress=False)
    part, _ = load_model(
        model_dirs[case], torch.float32, "cpu", tp_info=DistributedInfo(1, 2), dummy=True, progress=False
    )
    d, hq = cfg.head_dim, cfg.num_heads
    fa, pa = full.model.layers[1].self_attn, part.model.layers[1].self_attn
    assert torch.equal(pa.qkv_proj.weight[: hq // 2 * d], fa.qkv_proj.weight[hq // 2 * d : hq * d])
    inter = cfg.intermediate_size // 2
    assert torch.equal(
        part.model.layers[1].mlp.down_proj.weight, full.model.layers[1].mlp.down_proj.weight[:, inter:]
    )
    assert torch.equal(part.model.embed_tokens.weight, full.model.embed_tokens.weight)
    rows = cfg.vocab_size - 66  # rank 1's vocab rows of the LM head, 66 to the end (then padding)
    assert torch.equal(part.lm_head.weight[:rows], full.lm_head.weight[66:])
    assert torch.equal(part.lm_head.weight[rows:], torch.zeros_like(part.lm_head.weight[rows:]))
    assert fa.qkv_proj.weight.std() > 0.01
