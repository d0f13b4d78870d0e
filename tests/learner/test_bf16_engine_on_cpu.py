"""bf16 parameters with fp32 master weights and gradients: the streamed step against verl's own bf16 update (CPU).

Why:
1. Production runs compute in bf16. ``thundersync_harness.precision`` sets it up from the one actor config for
   verl's update and the stream alike: FSDP2 ``mixed_precision`` (bf16 params, fp32 reduce, fp32 master weights)
   and Megatron ``dtype=bfloat16`` with ``grad_reduce_in_fp32``. The streamed step must keep what bf16 does not
   touch in fp32: its buckets (a bucket is a copy of the fp32 gradient; a bf16 bucket would cost 2 bytes a value)
   and the deferred normaliser, applied to the fp32 gradient at the barrier.
2. The streaming machinery itself must add nothing: fed every trajectory before its first op, with every
   coefficient rounded as verl rounds its per-row loss scalars (``PrescaledSpec``), the stream's direct chunks are
   verl's micro-batches and its update is verl's bit for bit, bf16 backward included.
3. The floor rule of ``benchmarks/equivalence.py`` (median over batches of gap / floor <= 2, the floor being verl's
   update with its micro-batches regrouped; updates measured on the fp32 master weights), here on step 1 of seeds
   0-2 (4 groups x 4 rows). On Megatron it holds (2.20, 1.77, 1.86). On FSDP2 it misses (2.03, 2.68, 1.87): a
   row's whole bf16 backward rounds differently when its loss seed is A_i (or 1, in a bucket) instead of verl's
   fl(A_i / N), a rounding the floor (same seeds, rows regrouped) does not re-draw and verl's own update shows when
   its advantages are rescaled x24 vs x16 (FSDP2 1.78, 3.21, 2.14; Megatron 2.18, 1.88, 1.89 x floor;
   ``precision.py`` point 4). That verdict alone is the FSDP2 case's expected failure (``RuleMissed``); points 1
   and 2 are hard checks on both engines.
"""

from __future__ import annotations

import statistics

import pytest
import torch

from thundersync_harness import engine_setup as setup
from thundersync_harness import precision
from thundersync_harness.engine_steps import relative_gap, stream_step, sync_step, train
from thundersync_harness.megatron_engine import PrescaledSpec, build_megatron_model, megatron_config

pytestmark = pytest.mark.slow  # Ray and one verl engine per case (~15-25 s), then 12 one-step runs
GROUPS, MICRO, SEEDS = 4, 4, (0, 1, 2)


class RuleMissed(AssertionError):
    """The floor rule's verdict, apart from the hard checks (point 3)."""


ENGINES = [pytest.param("fsdp", marks=pytest.mark.xfail(
               raises=RuleMissed, strict=False,
               reason="bf16 rounds each row's backward by its loss seed: A_i streamed, fl(A_i / N) in verl (point 3)")),
           "megatron"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tmp_path_factory):
    work = tmp_path_factory.mktemp(f"bf16_{request.param}")
    with setup.ray_session():
        if request.param == "megatron":
            model_path, pad_id, vocab = build_megatron_model(work / "model")
            config = megatron_config(model_path, groups=GROUPS, micro=MICRO)
        else:
            model_path, pad_id, vocab = setup.build_tiny_model(work / "model")
            config = setup.verl_config(model_path, groups=GROUPS, micro=MICRO)
        precision.apply_precision(config, "bf16", request.param)
        yield {"wg": setup.start_workers(config, 1), "pad": pad_id, "vocab": vocab}


def stride_order(n: int) -> list[int]:
    """The benchmark's regrouped row order (``transposed_order``): every row gets new micro-batch companions."""
    stride = max(1, n // MICRO)
    return sorted(range(n), key=lambda i: (i % stride, i))


def test_bf16_streamed_step_equals_verls_bf16_update(engine):
    wg, pad = engine["wg"], engine["pad"]
    ratios = []
    for seed in SEEDS:
        trajs, arrival = setup.make_trajectories(1000 + 100 * seed, GROUPS, engine["vocab"])
        rows = list(range(len(trajs)))
        [d_verl], _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad)])
        [d_floor], _ = train(wg, [lambda: sync_step(wg, trajs, stride_order(len(trajs)), pad)])
        [d_stream], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, pad)])
        [d_matched], _ = train(wg, [lambda: stream_step(wg, trajs, arrival, pad, PrescaledSpec(), every=len(trajs))])
        assert info["stream/buffer_bytes"] >= 4 * d_verl.numel(), info["stream/buffer_bytes"]  # fp32 buckets (point 1)
        assert torch.equal(d_matched, d_verl), (seed, relative_gap(d_matched, d_verl))  # point 2
        floor, gap = relative_gap(d_floor, d_verl), relative_gap(d_stream, d_verl)
        assert 1e-4 < floor < 0.1 and gap < 0.1, (seed, gap, floor)  # bf16-sized (fp32's floor is ~1e-6)
        ratios.append(gap / floor)
    if statistics.median_high(ratios) > 2.0:
        raise RuleMissed(f"gap / floor per seed {[round(r, 2) for r in ratios]}: median above 2")
