"""Where the worst step's gap sits (``equivalence.py`` point 20): spread over the model, or in a few parameters whose
fp32 storage rounded one way in one run and the other way in the other.

Why:
1. An update's elements are stored in fp32, so two runs' parameters differ by whole multiples of each element's ulp
   (its fp32 spacing). A weight near 1 has an ulp of 1.2e-7 (6e-8 just below 1); where two runs' gradients differ
   by 1e-10 there, whether one of them rounds across a spacing boundary is a coin, and one flip there outweighs
   the gradient's whole difference spread over every other weight (found on the k1 tail: one ``model.norm.weight``
   element, ``docs/results.md``).
2. So each comparison reports, at its worst step, the share of the gap's squared norm in its 3 largest elements and
   each one's size in ulps of its stored value: a share near 1 at 1-2 ulps of a weight of magnitude ~1 is storage
   rounding, which the applied gradient (point 19) does not see; a share spread over many elements is not.
"""

from __future__ import annotations

import torch

TOP = 3


def ulps(values: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing at each value's magnitude (float64)."""
    mag = values.to(torch.float32).abs()
    return (torch.nextafter(mag, torch.full_like(mag, float("inf"))) - mag).double()


def storage_report(gap: torch.Tensor, params: torch.Tensor | None) -> dict:
    """``gap``: the stream's update minus verl's at one step (flat, float64); ``params``: verl's parameters after that
    step in the same layout (None where the run did not keep them: {}). The 3 largest elements' share of
    ``||gap||^2``, their sizes in ulps of their stored values, and those values' magnitudes."""
    if params is None or params.shape != gap.shape:
        return {}
    sq = gap.double() ** 2
    total = float(sq.sum())
    if total == 0.0:
        return {"worst_step_top3_gap_share": 0.0, "worst_step_top3_ulps": [], "worst_step_top3_magnitudes": []}
    top = torch.topk(sq, min(TOP, sq.numel())).indices
    return {"worst_step_top3_gap_share": float(sq[top].sum()) / total,
            "worst_step_top3_ulps": [round(float(x), 2) for x in gap[top].abs() / ulps(params[top])],
            "worst_step_top3_magnitudes": [round(float(x), 4) for x in params[top].abs()]}


def print_storage(row: dict) -> None:
    if row:
        print(f"  worst step: its {TOP} largest elements carry {row['worst_step_top3_gap_share']:.0%} of the gap^2, "
              f"at {', '.join(f'{u:g}' for u in row['worst_step_top3_ulps'])} ulps of stored values of magnitude "
              f"{', '.join(f'{m:g}' for m in row['worst_step_top3_magnitudes'])}")
