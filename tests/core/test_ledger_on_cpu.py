"""The accumulator's split: a ledger without tensors, and gradient buffers that it drives.

The ledger (groups, counts, reservations, buffer keys) must hold no gradient tensor, so a
planner that has no gradients can take the learner's decisions; every buffer it records must
exist in ``GradientBuffers`` and nothing else may, so the byte accounting is exact.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from thundersync_verl.core import (
    NEG,
    POS,
    AccumulatorBudgetError,
    BatchLedger,
    GradientBuffers,
    GRPOEstimator,
    MemoryBudget,
    RLOOEstimator,
    StreamingGradientAccumulator,
    StreamingStateError,
)

CORE = Path(__file__).resolve().parents[2] / "thundersync_verl" / "core"
SHAPES = [(3, 2), (4,)]


def _grad(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]


def _tensors_in(obj, seen=None) -> list:
    """Every tensor reachable from ``obj`` through attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = [*obj.keys(), *obj.values()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        children = []
    return [t for c in children for t in _tensors_in(c, seen)]


def _mid_batch(**kwargs) -> StreamingGradientAccumulator:
    """An accumulator with open groups, pending gradients and a closed group, mid-batch."""
    params = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    acc = StreamingGradientAccumulator(params, **kwargs)
    acc.begin_batch({"a": 3, "b": 2, "c": 1})
    variants = {"grads_negative": _grad(99)} if acc.sign_buckets else {}
    acc.add_policy_grad("a", 0, _grad(0), 4, reward=1.0, **variants)
    acc.add_policy_grad("a", 1, _grad(1), 2, reward=0.0, **variants)
    if acc.path != "canonical":
        acc.add_policy_grad("b", 0, _grad(2), 3, **variants)  # reward unknown: pending
    acc.add_policy_grad("c", 0, _grad(3), 5, reward=0.5, **variants)  # closes c at once
    return acc


PATHS = {
    "affine": dict(estimator=GRPOEstimator()),
    "buckets": dict(estimator=RLOOEstimator(), path="buckets"),
    "sign buckets": dict(estimator=GRPOEstimator(), sign_buckets=True),
    "canonical": dict(estimator=GRPOEstimator(), canonical_order=True),
}


@pytest.mark.parametrize("kwargs", PATHS.values(), ids=PATHS.keys())
def test_the_ledger_holds_no_tensor_and_the_buffers_hold_what_it_charged(kwargs):
    acc = _mid_batch(**kwargs)
    assert _tensors_in(acc.ledger) == []
    held = acc.buffers.tensors()
    assert len(held) > len(SHAPES)  # the batch gradient plus at least one open-group buffer
    assert acc.bytes_in_use == sum(t.numel() * t.element_size() for t in held)
    assert acc.bytes_in_use == acc.ledger.budget.bytes_in_use


def test_buffer_keys_mirror_the_tensors_and_vanish_together():
    acc = _mid_batch(estimator=GRPOEstimator(), sign_buckets=True)
    owner = ("group", "a")
    names = acc.ledger.buffer_names(owner)
    assert set(names) == {("bucket", 1.0, POS), ("bucket", 1.0, NEG), ("bucket", 0.0, POS), ("bucket", 0.0, NEG)}
    assert list(acc.buffers.held(owner)) == list(names)
    acc.report_reward("a", 2, 1.0)  # a closes: its buckets fold and are released in both places
    assert acc.ledger.buffer_names(owner) == () and acc.buffers.held(owner) == {}
    acc.abort_batch()
    assert acc.buffers.tensors() == [] and acc.ledger.budget.bytes_in_use == 0


def test_a_second_buffer_under_one_key_is_refused():
    ledger = BatchLedger(estimator=GRPOEstimator(), buffer_bytes=8)
    ledger.begin({"g": 2})
    ledger.reserve(ledger.group("g"), need_group=True, pending=False, tid=None)
    ledger.charge(("group", "g"), ("s0",))
    with pytest.raises(StreamingStateError, match="already exists"):
        ledger.charge(("group", "g"), ("s0",))
    ledger.charge(("group", "g"), ("s1",))
    with pytest.raises(AccumulatorBudgetError, match="more buffers than it reserved"):
        ledger.charge(("group", "g"), ("s2",))


def test_memory_budget_counts_without_tensors():
    budget = MemoryBudget(buffer_bytes=10, budget_bytes=30)
    budget.reserve("g", 2, is_group=True)
    assert budget.fits(1) and not budget.fits(2)
    budget.charge("g")
    assert (budget.bytes_in_use, budget.reserved_bytes, budget.open_groups) == (10, 20, 1)
    budget.release("g")
    assert (budget.bytes_in_use, budget.peak_bytes, budget.peak_open_groups) == (0, 10, 1)
    budget.reset_peaks()
    assert (budget.peak_bytes, budget.peak_open_groups) == (0, 0)


def test_gradient_buffers_refuse_gradients_outside_a_batch():
    acc = StreamingGradientAccumulator([torch.zeros(s) for s in SHAPES], estimator=GRPOEstimator())
    bufs = GradientBuffers(acc.layout)
    with pytest.raises(StreamingStateError, match="not allocated"):
        bufs.add_to_batch(_grad(0), 1.0)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", ["ledger.py", "budget.py", "groups.py", "scheduling.py"])
def test_the_bookkeeping_modules_do_not_import_torch(name):
    assert "torch" not in _imports(CORE / name)
