"""What a planner's ops do to each trajectory, read off the ops alone (the planner tests share it)."""

from __future__ import annotations

from thundersync_verl.step.stream_plan import BackwardOp, FoldOp


def effective_coefficients(ops: list) -> dict:
    """Per planned item, the coefficient its gradient finally enters the batch gradient with: its backward's
    coefficient, times its bucket's fold coefficient when it went to a bucket. An item planned twice fails."""
    folds = {k: c for op in ops if isinstance(op, FoldOp) for k, c in op.folds.items()}
    out = {}
    for op in ops:
        if isinstance(op, BackwardOp):
            for item, coef in zip(op.items, op.coefs):
                assert item not in out, f"{item} planned twice"
                out[item] = coef if op.dest == "direct" else coef * folds[op.dest]
    return out
