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


@pytest.mark.parametrize("dst_dtype,src_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.bfloat16, torch.float32), (torch.float64, torch.float32)])
def test_multi_tensor_axpy_and_copy_equal_the_per_shard_loop_bit_for_bit(dst_dtype, src_dtype):
    """buffers.py point 8: one multi-tensor call per axpy/copy, the same values as one add_/copy_ per shard
    (the promoted dtype and the single rounding of point 7 included); None shards skipped or zeroed."""
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (), (7,), (2, 2, 2)]
    dst = [torch.randn(s, generator=g).to(dst_dtype) for s in shapes]
    src = [torch.randn(s, generator=g).to(src_dtype) for s in shapes]
    src[1] = None
    want_axpy = [d.clone() if s is None else d.clone().add_(s, alpha=-0.37) for d, s in zip(dst, src)]
    want_copy = [torch.zeros_like(d) if s is None else d.clone().copy_(s) for d, s in zip(dst, src)]
    got_axpy, got_copy = [d.clone() for d in dst], [d.clone() for d in dst]
    axpy_(got_axpy, src, -0.37)
    copy_into_(got_copy, src)
    for want, got in ((want_axpy, got_axpy), (want_copy, got_copy)):
        for w, x in zip(want, got):
            assert x.dtype == dst_dtype and torch.equal(w, x)
    assert not torch.equal(got_axpy[0], dst[0])  # the add happened
