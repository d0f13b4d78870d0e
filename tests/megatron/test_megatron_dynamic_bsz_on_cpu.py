"""The streamed step on verl's Megatron engine with token-budgeted micro-batches (``use_dynamic_bsz=True``).

verl's Megatron engine cuts every ``forward_backward_batch`` call by ``ppo_max_token_len_per_gpu`` (verl's
``rearrange_micro_batches``, balanced by sequence length): its update of a harness batch runs at least 3 micro-batches
of different row counts, and each streamed chunk goes through the same engine call, so it is cut by the same budget.
The stream must still give verl's update: the benchmark's rule, gap over the floor at most 2 (median over batches),
with the floor the largest of verl's own update's variations that the benchmark measures on Megatron under a token
budget (``thundersync_harness.batching`` points 3 and 5, ``benchmarks/equivalence.py`` point 7): rows in a
stride-permuted order (which a budget cuts into largely the same micro-batches), another budget, one row per
micro-batch, and its per-row loss scalars A_i / N rounded otherwise (advantages x24 vs x16: the term no regrouping
of verl's rows shows and no streamed row can share). A chunk whose gradient kept the micro-batch count the budget
gave it (or lost it) would move the update by a sizeable share of that chunk's rows (a few of 16), far above the
1e-5 bound on the gap (||dθ|| ~ 3e-2). TP1, one Ray launch (~40-60 s on 2 cores, most of it the launch).
"""

from __future__ import annotations

import statistics

import pytest

from thundersync_harness import batching
from thundersync_harness.engine_setup import make_trajectories
from thundersync_harness.engine_steps import PolicySpec, relative_gap, stream_step, sync_step, train

GROUPS, MICRO, BUDGET = 4, 4, batching.DYNAMIC_MAX_TOKEN_LEN
BATCHES = (1000, 1100, 1200)  # the first batch of the benchmark's seeds 0, 1, 2


@pytest.fixture(scope="module")
def group(start_megatron):
    return start_megatron(groups=GROUPS, micro=MICRO, max_token_len=BUDGET)


def stride_order(n: int) -> list[int]:
    """The benchmark's regrouped row order (``transposed_order``)."""
    stride = max(1, n // MICRO)
    return sorted(range(n), key=lambda i: (i % stride, i))


def recorded(wg, fn):
    """``fn()`` with rank 0's micro-batch record on: (result, training calls' cuts, forward-only calls' cuts)."""
    wg.probe_record_micro_batches(True)
    try:
        out = fn()
    finally:
        log = wg.probe_record_micro_batches(False)[0]
    return out, [c for c in log if not c["forward_only"]], [c for c in log if c["forward_only"]]


@pytest.mark.slow  # one Ray launch of verl's Megatron engine over gloo
def test_streamed_step_equals_verls_update_under_megatron_token_budgets(group):
    wg, pad = group.wg, group.pad_id
    ratios, streamed_cuts = {"interleaved": [], "after_arrival": []}, []
    for seed in BATCHES:
        trajs, arrival = make_trajectories(seed, GROUPS, group.vocab)
        rows = list(range(len(trajs)))
        ([d_verl], [info]), verl_cut, _ = recorded(wg, lambda: train(wg, [lambda: sync_step(wg, trajs, rows, pad)]))
        [d_stride], _ = train(wg, [lambda: sync_step(wg, trajs, stride_order(len(trajs)), pad)])
        [d_budget], _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad,
                                                     max_token_len=batching.DYNAMIC_FLOOR_MAX_TOKEN_LEN)])
        ([d_fine], _), fine_cut, _ = recorded(wg, lambda: train(wg, [lambda: sync_step(wg, trajs, rows, pad, micro=1)]))
        [d_x16], _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad, PolicySpec(advantage_scale=16.0))])
        [d_x24], _ = train(wg, [lambda: sync_step(wg, trajs, rows, pad, PolicySpec(advantage_scale=24.0))])

        # verl's own update ran ONE call cut by the budget: several micro-batches of different row counts
        [cut] = verl_cut
        assert len(cut["rows"]) >= 3 and len(set(cut["rows"])) > 1 and sum(cut["rows"]) == len(trajs), cut
        assert max(cut["tokens"]) <= BUDGET, cut
        assert [c["rows"] for c in fine_cut] == [[1] * len(trajs)]  # the one-row floor is one row per micro-batch
        floors = {"stride": relative_gap(d_stride, d_verl), "budget": relative_gap(d_budget, d_verl),
                  "one_row": relative_gap(d_fine, d_verl), "rounding": relative_gap(d_x24, d_x16)}
        assert float(d_verl.norm()) > 1e-4 and 0 < max(floors.values()) < 1e-5, (seed, floors)

        # streamed while the rows arrive (chunks of 1-2 rows, open groups in buckets), and after they all arrived
        # (closed groups: direct chunks of up to 4 rows, which the budget cuts into several micro-batches)
        for kind, every in (("interleaved", None), ("after_arrival", len(trajs))):
            ([d_stream], [info_s]), cuts, _ = recorded(
                wg, lambda: train(wg, [lambda: stream_step(wg, trajs, arrival, pad, every=every)]))
            assert all(max(c["tokens"]) <= BUDGET for c in cuts) and sum(sum(c["rows"]) for c in cuts) == len(trajs)
            streamed_cuts += cuts
            gap = relative_gap(d_stream, d_verl)
            assert gap < 1e-5, (seed, kind, gap, floors)
            assert info_s["grad_norm"] == pytest.approx(info["grad_norm"], rel=1e-4)
            ratios[kind].append(gap / max(floors.values()))
    assert any(len(c["rows"]) > 1 for c in streamed_cuts), streamed_cuts  # a streamed chunk the budget cut again
    assert all(statistics.median_high(r) <= 2.0 for r in ratios.values()), ratios


def test_megatron_dynamic_bsz_runs_only_the_plain_comparison_in_the_benchmark(equivalence_bench, capsys, tmp_path):
    """The benchmark's ``--dynamic-bsz`` on Megatron runs the plain GRPO comparison (also per-token, packed); the
    comparisons that do not honour it refuse it by name before anything is built."""
    parser = equivalence_bench.build_parser()
    base = ["--engine", "megatron", "--dynamic-bsz", "--results-dir", str(tmp_path)]
    args = equivalence_bench.settings.check(parser, parser.parse_args(base + ["--per-token-loss"]))
    assert batching.megatron_batching_options(args) == {"max_token_len": BUDGET}  # per_token_config packs
    args = equivalence_bench.settings.check(parser, parser.parse_args(base + ["--remove-padding"]))
    assert batching.megatron_batching_options(args) == {"remove_padding": True, "max_token_len": BUDGET}
    for extra, flag in ((["--kl"], "--kl"), (["--mini-batches", "2"], "--mini-batches"),
                        (["--float64-sum"], "--float64-sum"), (["--estimator", "rloo"], "--estimator")):
        with pytest.raises(SystemExit) as exc:
            equivalence_bench.main(base + extra)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--dynamic-bsz" in err and flag in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())
