"""`utils.transfer.to_device`: values and dtypes on any device; on a GPU the host does not wait for
the work queued before the copy (a pageable copy waited for it: a sampled decode step stalled)."""

from __future__ import annotations

import time

import pytest
import torch

from minisgl.utils.transfer import to_device


@pytest.mark.parametrize(
    ("data", "dtype", "want"),
    [
        ([1, 2, 3], torch.int64, torch.tensor([1, 2, 3])),
        ([0.5, 2.0], torch.float32, torch.tensor([0.5, 2.0])),
        (float("-inf"), torch.bfloat16, torch.tensor(float("-inf"), dtype=torch.bfloat16)),
        (torch.tensor([4, 5], dtype=torch.int32), torch.int64, torch.tensor([4, 5])),
        (torch.tensor([1.5]), None, torch.tensor([1.5])),
    ],
)
def test_values_and_dtypes_on_the_cpu(data, dtype, want) -> None:
    got = to_device(data, torch.device("cpu"), dtype)
    assert got.dtype == want.dtype and got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.gpu
def test_a_gpu_copy_does_not_wait_for_queued_work() -> None:
    dev = torch.device("cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of a busy kernel on the stream (clock cycles)
    t0 = time.perf_counter()
    got = to_device([7, 8, 9], dev, torch.int64)
    host_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    blocking = torch.tensor([7, 8, 9], device=dev)  # what the sampler did: waits for the sleep
    waited_s = time.perf_counter() - t0
    assert host_s < 0.1 < waited_s, (host_s, waited_s)
    torch.testing.assert_close(got, blocking, rtol=0, atol=0)
