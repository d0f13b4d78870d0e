"""Bucket placement and cost (``core/bucket_memory.py``), the host pool's accounting and exact host folds.

GPUs needed: 0 (the host path's side stream and events are no-ops on a CPU; the same functions run).
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.core import BufferPool, GradLayout, StreamingConfigError
from thundersync_verl.core.bucket_memory import bucket_memory, bucket_placement
from thundersync_verl.core.buffers import axpy_, copy_into_


def test_auto_is_host_on_accelerators_and_device_on_cpu():
    assert bucket_placement("auto", accelerator=True) == "host"
    assert bucket_placement("auto", accelerator=False) == "device"
    mem = bucket_memory(1000, bucket_device="host", accelerator=True, buckets=3)
    assert (mem.storage, mem.pinned, mem.bucket_bytes, mem.peak_bytes, mem.host_bytes, mem.device_bytes) == \
        ("host", True, 4000, 12000, 12000, 0)
    assert not bucket_memory(10, bucket_device="host", accelerator=False).pinned  # no accelerator: plain host memory


def test_a_bad_bucket_device_is_refused_in_rule_why_fix_form():
    with pytest.raises(StreamingConfigError, match=r"thundersync.bucket_device(.|\n)*why: (.|\n)*fix: "):
        bucket_placement("gpu", accelerator=True)


def _layout():
    return GradLayout.from_tensors([torch.zeros(3, 5), torch.zeros(7)])


def test_the_host_pool_is_priced_by_bucket_memory_and_accounts_exactly():
    layout = _layout()
    pool = BufferPool.for_learner(layout, bucket_device="host", budget_bytes=2 * layout.buffer_bytes)
    assert pool.storage == "host" and not pool.pinned
    assert pool.buffer_bytes == bucket_memory(layout.numel, accelerator=False).bucket_bytes == 22 * 4
    pool.reserve("a", 1, is_group=True)
    bufs = pool.allocate("a")
    assert all(b.device.type == "cpu" for b in bufs)
    pool.reserve("b", 1, is_group=True)
    pool.allocate("b")
    assert pool.bytes_in_use == pool.host_peak_bytes == 2 * layout.buffer_bytes
    with pytest.raises(Exception, match="budget full"):
        pool.reserve("c", 1, is_group=True)
    pool.release("a")
    assert pool.bytes_in_use == layout.buffer_bytes and pool.host_peak_bytes == 2 * layout.buffer_bytes
    assert BufferPool.for_learner(layout).storage == "device"  # auto on a CPU learner


def test_a_host_bucket_folds_exactly_like_a_device_bucket():
    torch.manual_seed(0)
    grads = [[torch.randn(3, 5), torch.randn(7)] for _ in range(3)]
    grads[1][1] = None  # a parameter without gradient in one chunk
    results = []
    for storage in ("host", "device"):
        pool = BufferPool(_layout(), storage=storage)
        pool.reserve("k", 1, is_group=True)
        bucket = pool.allocate("k")
        copy_into_(bucket, grads[0])
        for g in grads[1:]:
            axpy_(bucket, g, 1.0)
        dst = [torch.ones(3, 5), torch.ones(7)]
        axpy_(dst, bucket, -0.37)
        results.append(dst)
    expected = [torch.ones(3, 5), torch.ones(7)]
    for i in range(2):
        total = sum(g[i] for g in grads if g[i] is not None)
        expected[i].add_(total, alpha=-0.37)
    for host, device, want in zip(*results, expected):
        assert torch.equal(host, device)  # the same arithmetic, bit for bit
        torch.testing.assert_close(host, want, rtol=0, atol=1e-6)
