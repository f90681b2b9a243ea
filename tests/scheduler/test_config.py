"""SchedulerConfig and DistributedInfo: fields, frozen, private unique ipc directories."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

import pytest
import torch

from minisgl.distributed import DistributedInfo, init_process_groups
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.ipc import ipc_addr, ipc_dir_for


@pytest.fixture(autouse=True)
def ipc_root(ipc_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(ipc_dir))
    return ipc_dir


def make(**kw: object) -> SchedulerConfig:
    return SchedulerConfig(model_path="m", tp_info=DistributedInfo(0, 1), dtype=torch.float32, **kw)


def test_fields_in_order_with_defaults() -> None:
    names = [f.name for f in dataclasses.fields(SchedulerConfig)]
    assert names[:3] == ["model_path", "tp_info", "dtype"]
    assert names[-1] == "_unique_suffix"
    c = make()
    assert (c.device, c.engine, c.dummy_weights, c.page_size, c.num_pages, c.kv_cache_memory) == (
        "cpu",
        "model",
        False,
        16,
        None,
        None,
    )
    assert (c.gpu_memory_fraction, c.max_running_requests, c.max_prefill_tokens, c.max_seq_len, c.seed) == (
        0.85,
        256,
        4096,
        None,
        42,
    )
    assert c.offline_mode is False and c.dist_init_addr == "" and c.backend_create_detokenizer_link is True


def test_frozen() -> None:
    c = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 32  # type: ignore[misc]
    assert dataclasses.replace(c, page_size=32).page_size == 32


def test_two_configs_get_different_addresses(ipc_root: Path) -> None:
    a, b = make(), make()
    assert a._unique_suffix != b._unique_suffix
    addrs_a = {a.zmq_backend_addr, a.zmq_detokenizer_addr, a.zmq_scheduler_broadcast_addr}
    addrs_b = {b.zmq_backend_addr, b.zmq_detokenizer_addr, b.zmq_scheduler_broadcast_addr}
    assert len(addrs_a) == 3 and not addrs_a & addrs_b
    assert a.ipc_dir != b.ipc_dir
    for c in (a, b):
        c.remove_ipc_dir()


def test_same_suffix_same_addresses_for_every_rank() -> None:
    r0 = make(_unique_suffix="srv1")
    r1 = SchedulerConfig(
        model_path="m", tp_info=DistributedInfo(1, 2), dtype=torch.float16, _unique_suffix="srv1"
    )
    assert r0.zmq_scheduler_broadcast_addr == r1.zmq_scheduler_broadcast_addr
    assert r0.zmq_backend_addr == r1.zmq_backend_addr
    assert r0.ipc_addr("frontend") == r0.zmq_frontend_addr != r0.zmq_tokenizer_addr
    assert r0.zmq_frontend_addr.startswith(f"ipc://{r0.ipc_dir}/")
    r0.remove_ipc_dir()


def test_ipc_dir_private_created_on_use_removed_on_cleanup(ipc_root: Path) -> None:
    c = make()
    path = ipc_dir_for(c._unique_suffix)
    assert not path.exists()  # nothing made before first use
    addr = c.zmq_backend_addr
    assert path.is_dir() and addr == f"ipc://{path}/backend"
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert len(addr) - len("ipc://") < 107
    c.remove_ipc_dir()
    assert not path.exists()
    c.remove_ipc_dir()  # twice is fine


def test_default_root_is_short(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MINISGL_IPC_ROOT")
    path = ipc_dir_for(make()._unique_suffix)
    assert str(path).startswith("/tmp/msgl-") and len(str(path)) < 40


def test_refuses_a_directory_open_to_others(ipc_root: Path) -> None:
    c = make(_unique_suffix="shared")
    path = ipc_dir_for("shared")
    path.mkdir(mode=0o755)
    path.chmod(0o755)
    with pytest.raises(PermissionError, match="not a private directory"):
        _ = c.zmq_backend_addr


def test_overlong_ipc_path_refused(ipc_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = ipc_root / ("d" * 100)
    deep.mkdir()
    monkeypatch.setenv("MINISGL_IPC_ROOT", str(deep))
    c = make()
    with pytest.raises(ValueError, match="longer than"):
        _ = c.zmq_backend_addr
    with pytest.raises(ValueError, match="longer than"):
        ipc_addr(deep, "x" * 20)


def test_odd_or_long_suffix_is_hashed_short() -> None:
    long = make(_unique_suffix="x" * 500)
    odd = make(_unique_suffix="a/b c")
    assert len(long.ipc_dir.name) < 30 and "/" not in odd.ipc_dir.name
    assert make(_unique_suffix="x" * 500).ipc_dir == long.ipc_dir
    for c in (long, odd):
        c.remove_ipc_dir()


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"engine": "fast"}, "engine"),
        ({"cache_type": "lru"}, "cache_type"),
        ({"page_size": 0}, "page_size"),
        ({"num_pages": 0}, "num_pages"),
        ({"gpu_memory_fraction": 1.5}, "gpu_memory_fraction"),
        ({"dist_init_addr": "127.0.0.1:1"}, "tcp://"),
        ({"_unique_suffix": ""}, "suffix"),
    ],
)
def test_bad_values_rejected(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(**kw)


def test_bad_types_rejected() -> None:
    with pytest.raises(TypeError, match="tp_info"):
        SchedulerConfig(model_path="m", tp_info=(0, 1), dtype=torch.float32)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        SchedulerConfig(model_path="m", tp_info=DistributedInfo(0, 1), dtype="float32")  # type: ignore[arg-type]


def test_distributed_info() -> None:
    assert DistributedInfo(0, 2).is_primary() and not DistributedInfo(1, 2).is_primary()
    with pytest.raises(dataclasses.FrozenInstanceError):
        DistributedInfo(0, 1).rank = 1  # type: ignore[misc]
    for rank, size in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError):
            DistributedInfo(rank, size)


def test_single_rank_needs_no_process_group() -> None:
    assert init_process_groups(DistributedInfo(0, 1), "tcp://127.0.0.1:1") is None
    with pytest.raises(ValueError, match="tcp://"):
        init_process_groups(DistributedInfo(0, 2), "127.0.0.1:1")
