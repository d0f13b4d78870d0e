"""Every planner and algorithm the trainer builds has every member ``StreamedStep`` uses; the step probes for none.

GPUs needed: 0 (CPU only). No Ray, no verl engine.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from thundersync_verl.algos.opd.opd_stream import OPDTurnPlanner
from thundersync_verl.algos.opd.opd_trainer_step import OPDArrivals
from thundersync_verl.algos.sao.sao_streaming import SAOStreamPlanner
from thundersync_verl.algos.sao.sao_trainer_step import SAOArrivals, SAOStepPlanner
from thundersync_verl.step.contracts import Algorithm, Planner
from thundersync_verl.step.minibatch_plan import MiniBatchPlanner
from thundersync_verl.step.stream_plan import StreamPlanner
from thundersync_verl.step.streamed_step import GRPOArrivals

STEP = Path(__file__).resolve().parents[2] / "thundersync_verl" / "step" / "streamed_step.py"


def _members(protocol) -> set[str]:
    """Every member a protocol declares: its annotated attributes, properties and methods."""
    declared = {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, property)}
    return (set(protocol.__annotations__) | declared) - {n for n in declared if n.startswith("_")}


def _has(obj, member: str) -> bool:
    """A property or method on the class (a property may need an open batch to answer), or an attribute."""
    return member in dir(type(obj)) or hasattr(obj, member)


def _planners() -> dict:
    grpo = StreamPlanner()
    return {
        "grpo": grpo,
        "minibatch": MiniBatchPlanner(StreamPlanner(), minibatch_groups=1),
        "opd": OPDTurnPlanner(),
        "sao": SAOStepPlanner(SAOStreamPlanner(eps_low=0.2, eps_high=0.2)),
    }


@pytest.mark.parametrize("name", sorted(_planners()))
def test_every_planner_has_every_member_the_step_uses(name):
    planner = _planners()[name]
    assert {"ready_count", "next_ops", "finalize", "memory", "metrics", "fills_free_slots"} <= _members(Planner)
    missing = [m for m in _members(Planner) if not _has(planner, m)]
    assert not missing, missing
    assert isinstance(planner.verl_settings, dict) and callable(planner.metrics)
    # GRPO's and OPD's turn planners plan to the pipeline's free slots (arrivals wait and share the next call)
    assert planner.fills_free_slots is (name in ("grpo", "opd"))
    if planner.fills_free_slots:
        assert "max_backwards" in inspect.signature(planner.next_ops).parameters


def test_every_algorithm_has_every_member_the_step_uses():
    planners = _planners()
    algorithms = {"grpo": GRPOArrivals(planners["grpo"]), "opd": OPDArrivals(planners["opd"]),
                  "sao": SAOArrivals(planners["sao"])}
    for name, algo in algorithms.items():
        missing = [m for m in _members(Algorithm) if not _has(algo, m)]
        assert not missing, (name, missing)
        assert algo.admitted() is None


def test_the_step_never_probes_its_planner_or_algorithm():
    source = STEP.read_text()
    probes = re.findall(r"(?:hasattr|getattr)\((?:self\.)?(?:planner|algo)\b[^)]*\)", source)
    assert not probes, probes


def test_every_op_a_planner_emits_has_one_entry_in_the_dispatch_table():
    """stream_exec.OP_KINDS is the one place an op type meets the learner: method, chunk, figures, lane."""
    from thundersync_verl.algos.opd.opd_stream import TurnBackwardOp
    from thundersync_verl.algos.sao.sao_streaming import SAOBackwardOp
    from thundersync_verl.step.minibatch_plan import PPOBackwardOp
    from thundersync_verl.step.stream_exec import OP_KINDS, op_kind
    from thundersync_verl.step.stream_plan import BackwardOp, FoldOp

    assert set(OP_KINDS) == {FoldOp, BackwardOp, PPOBackwardOp, TurnBackwardOp, SAOBackwardOp}
    assert {k.name for k in OP_KINDS.values()} == {"fold", "backward"}
    assert [t.__name__ for t, k in OP_KINDS.items() if k.row_items] == ["PPOBackwardOp", "BackwardOp"]
    with pytest.raises(TypeError, match="list its type in stream_exec.OP_KINDS"):
        op_kind(object())
    source = STEP.read_text() + (STEP.parent / "stream_exec.py").read_text()
    assert not re.findall(r"isinstance\(op, \(?(?:Fold|Backward|PPOBackward|TurnBackward|SAOBackward)Op", source)
