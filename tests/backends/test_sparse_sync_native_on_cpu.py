"""sparse_sync's compiled CPU kernels give the payloads of the numpy/torch kernels, bit for bit.

1. The one-pass diff (its AVX2 and portable forms) finds exactly the changed elements (positions,
   values, snapshot) of random bf16/fp16/fp32 tensors at densities 0, 1e-4, 0.02, 0.5 and 1.0, odd
   lengths and odd offsets, like the numpy and torch kernels; whole pushes through either path give
   equal payloads.
2. The scatter writes what ``index_copy_`` writes and refuses an out-of-range position before
   writing anything; the block digest equals numpy's and torch's.
3. ``THUNDERSYNC_SPARSE_NATIVE=0`` and a failed build fall back to the numpy kernels (logged once).
Needs a C++ compiler and the ninja executable (skipped with the reason otherwise); the first test
builds the kernels into the cache folder (~40 s, once per machine), later runs only load them.
"""

from __future__ import annotations

import logging

import pytest
import torch

from thundersync_verl.backends.sparse_sync import codec, native
from thundersync_verl.backends.sparse_sync.state import Mirror, ShardEncoder

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DENSITIES = [0.0, 1e-4, 0.02, 0.5, 1.0]


@pytest.fixture(scope="module")
def kernels():
    why = native.why_unavailable()
    if why is not None:
        pytest.skip(f"compiled sparse_sync kernels unavailable here: {why}")
    return native.kernels()


def _changed(base: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """``base`` with about ``density`` of its elements given other bits (a few flips of sign bits too)."""
    new = base.clone()
    mask = torch.rand(base.numel(), generator=gen) < density
    new[mask] = (new[mask].float() * 1.5 + 0.01).to(base.dtype)
    flips = torch.nonzero(mask).squeeze(1)[:3]
    new[flips] = -new[flips]  # -0.0 vs +0.0 and sign flips: bit changes a float compare can miss
    return new


@pytest.mark.parametrize("avx2", [True, False], ids=["avx2_where_present", "portable"])
def test_the_compiled_diff_finds_what_the_numpy_and_torch_kernels_find(kernels, avx2):
    ran_avx2 = kernels.set_avx2(avx2)
    if avx2 and not ran_avx2:
        pytest.skip("this CPU has no AVX2: the portable kernels are tested")
    try:
        _diff_matches_every_kernel()
    finally:
        kernels.set_avx2(True)


def _diff_matches_every_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for density in DENSITIES:
            for n in (1, 7, 4099, 70001):
                old = torch.randn(n + 3, generator=gen).to(dtype)
                new = _changed(old, density, gen)
                for lo in (0, 1, 3):  # aligned and odd offsets: words straddle the slice's ends
                    lo = min(lo, n + 2)
                    results = {}
                    for kernel in ("native", "numpy", "torch"):
                        snap = old.clone()
                        pos, values = codec.diff_update(codec.bits(new)[lo:], codec.bits(snap)[lo:], kernel=kernel)
                        results[kernel] = (pos, values, snap)
                    want = torch.nonzero(codec.bits(new)[lo:] != codec.bits(old)[lo:]).squeeze(1)
                    for kernel, (pos, values, snap) in results.items():
                        where = (dtype, density, n, lo, kernel)
                        assert pos.dtype == codec.INDEX_DTYPE and torch.equal(pos.long(), want), where
                        assert torch.equal(values, codec.bits(new)[lo:][want]), where
                        assert torch.equal(codec.bits(snap)[lo:], codec.bits(new)[lo:]), where
                        assert torch.equal(codec.bits(snap)[:lo], codec.bits(old)[:lo]), where  # untouched


def _pushes(native_on: bool, monkeypatch, weights: list[dict], **encoder_kw) -> list:
    monkeypatch.setenv(native.ENV_SWITCH, "1" if native_on else "0")
    enc, mirror = ShardEncoder(**encoder_kw), Mirror()
    out = []
    for w in weights:
        payload, _stats = enc.encode(list(w.items()))
        mirror.apply(payload)
        enc.commit(payload)
        out.append((payload, {n: codec.bits(t).clone() for n, t in mirror.flat.items()}))
    return out


def test_pushes_through_either_path_give_equal_payloads(kernels, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    base = {f"{codec.dtype_name(d)}_{n}": torch.randn(n, generator=gen).to(d) for d in DTYPES for n in (4099, 70001)}
    steps = [base] + [{k: _changed(t, density, gen) for k, t in base.items()} for density in DENSITIES]
    for kw in ({}, {"chunk_elems": 4096, "bucket_bytes": 1 << 14}):  # small chunks: dense runs and many buckets
        fast, slow = _pushes(True, monkeypatch, steps, **kw), _pushes(False, monkeypatch, steps, **kw)
        for (p_fast, held_fast), (p_slow, held_slow), want in zip(fast, slow, steps):
            assert p_fast.entries == p_slow.entries and p_fast.checksum == p_slow.checksum
            assert (p_fast.full, p_fast.reason, p_fast.changed) == (p_slow.full, p_slow.reason, p_slow.changed)
            for b_fast, b_slow in zip(p_fast.buckets, p_slow.buckets, strict=True):
                assert torch.equal(b_fast.indices, b_slow.indices) and torch.equal(b_fast.values, b_slow.values)
            for name, t in want.items():
                assert torch.equal(held_fast[name], codec.bits(t)) and torch.equal(held_slow[name], codec.bits(t))
        assert any(not p.full and p.changed for p, _ in fast), "no sparse push was exercised"


def test_the_compiled_scatter_writes_what_index_copy_writes_and_checks_positions_first(kernels):
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.uint8, torch.int16, torch.int32, torch.int64):
        target = torch.randint(-100, 100, (5001,), generator=gen).to(dtype)
        idx = torch.randperm(5001, generator=gen)[:777].sort().values.to(torch.int32)
        values = torch.randint(-100, 100, (777,), generator=gen).to(dtype)
        want = target.clone().index_copy_(0, idx.long(), values)
        kernels.scatter(target, idx, values)
        assert torch.equal(target, want), dtype
        for bad in (5001, -1):
            before = target.clone()
            with pytest.raises(RuntimeError, match="outside"):
                kernels.scatter(target, torch.tensor([0, 5, bad], dtype=torch.int32), values[:3])
            assert torch.equal(target, before), (dtype, bad)  # nothing written


def test_the_compiled_digest_equals_the_numpy_and_torch_digests(kernels):
    gen = torch.Generator().manual_seed(3)
    for n_bytes in (0, 5, 8, 8 * 1024, 8 * 1024 + 3, 8 * 2048 + 8, 8 * 5000 + 7):
        t = torch.randint(0, 256, (n_bytes,), generator=gen, dtype=torch.uint8)
        digest = codec.block_digest(t, kernel="native")
        assert digest == codec.block_digest(t, kernel="numpy") == codec.block_digest(t, kernel="torch"), n_bytes


def test_the_switch_and_a_failed_build_fall_back_to_the_numpy_kernels(kernels, monkeypatch, caplog):
    t = torch.zeros(64, dtype=torch.int16)
    assert codec.default_kernel(t) == "native"
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert codec.default_kernel(t) == "numpy" and native.why_unavailable() == f"{native.ENV_SWITCH}=0"
    monkeypatch.delenv(native.ENV_SWITCH)

    def broken():
        raise RuntimeError("Error building extension\nsimulated compiler error")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_build", broken)
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert codec.default_kernel(t) == "numpy" and codec.default_kernel(t) == "numpy"
        assert "simulated compiler error" in native.why_unavailable()
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1  # logged once
    weights = {"w": torch.randn(1000).to(torch.bfloat16)}
    enc, mirror = ShardEncoder(), Mirror()
    for step in range(2):
        weights["w"][step::7] += 1.0
        payload, _ = enc.encode(list(weights.items()))
        mirror.apply(payload)
        enc.commit(payload)
    assert not payload.full and payload.changed  # the patch went through the numpy kernels
    assert torch.equal(codec.bits(mirror.tensor("w")), codec.bits(weights["w"]))
