"""benchmarks/equivalence.py --seeds: the median/worst aggregation, the per-seed loop and the argument check (no Ray)."""

from __future__ import annotations

import json

import pytest
import torch



@pytest.fixture(scope="module")
def bench(equivalence_bench):
    return equivalence_bench


def seed_result(seed: int, ratio: float) -> dict:
    return {"seed": seed, "seconds": 10.0, "engine": "megatron", "tp": 1, "pp": 2, "dp": 1,
            "gap": ratio * 1e-7, "floor": 1e-7, "gap_over_floor": ratio}


def test_the_median_seed_carries_the_result_and_the_worst_stands_beside_it(bench):
    per_seed = [seed_result(0, 2.04), seed_result(1, 1.80), seed_result(2, 1.95)]
    result = bench.aggregate_seeds(per_seed)
    assert result["gap_over_floor"] == 1.95 and result["median_seed"] == 2
    assert (result["gap"], result["floor"]) == (per_seed[2]["gap"], per_seed[2]["floor"])
    assert result["gap_over_floor_worst"] == 2.04
    assert result["gap_over_floor_per_seed"] == [2.04, 1.80, 1.95] and result["seeds"] == [0, 1, 2]
    assert (result["engine"], result["tp"], result["pp"], result["dp"]) == ("megatron", 1, 2, 1)
    assert "seed" not in result and result["per_seed"] == per_seed


def test_the_applied_gradient_figure_is_aggregated_on_its_own_and_only_where_every_seed_has_it(bench):
    per_seed = [dict(seed_result(0, 4.7), gap_over_floor_applied=3.1), dict(seed_result(1, 2.0), gap_over_floor_applied=3.2),
                dict(seed_result(2, 1.9), gap_over_floor_applied=2.9)]
    result = bench.aggregate_seeds(per_seed)
    assert result["gap_over_floor"] == 2.0 and result["gap_over_floor_applied"] == 3.1  # its own median, not seed 1's
    assert result["gap_over_floor_applied_worst"] == 3.2 and result["gap_over_floor_applied_per_seed"] == [3.1, 3.2, 2.9]
    assert "gap_over_verl_rescaled_applied_worst" not in result
    for r, x in zip(per_seed, (1.04, 0.96, 0.9)):
        r["gap_over_verl_rescaled_applied"] = x
    assert bench.aggregate_seeds(per_seed)["gap_over_verl_rescaled_applied_worst"] == 1.04
    del per_seed[2]["gap_over_floor_applied"]
    assert "gap_over_floor_applied_worst" not in bench.aggregate_seeds(per_seed)


def test_applied_gradient_rows_compare_each_step_and_report_the_worst(bench):
    def rows(*pairs):  # float64, as the learner records them
        return [{"applied": torch.tensor(p, dtype=torch.float64)} for p in pairs]

    a, b = rows([1.0, 2.0], [3.0, 4.0]), rows([1.0, 2.0 + 1e-6], [3.0, 4.0 + 1e-6])
    s = rows([1.0, 2.0 + 2e-6], [3.0, 4.0 + 3e-6])
    out = bench._report_applied(a, b, s)
    assert out["gap_over_floor_applied"] == pytest.approx(3.0) and out["floor_applied"] == pytest.approx(1e-6 / 5)
    assert bench._report_applied(a, b, s[:1] + [{}]) == {}  # a run that did not record it (Megatron)


def test_with_an_even_count_the_median_is_the_higher_middle_value(bench):
    result = bench.aggregate_seeds([seed_result(0, 1.5), seed_result(1, 2.5), seed_result(2, 1.0), seed_result(3, 3.0)])
    assert result["gap_over_floor"] == 2.5 and result["median_seed"] == 1  # never in the stream's favour


def test_seeds_parse_and_the_default_stays_the_single_seed(bench):
    parser = bench.build_parser()
    assert parser.parse_args(["--seeds", "0,1,2"]).seeds == [0, 1, 2]
    args = parser.parse_args(["--seed", "3"])
    assert (args.seeds, args.seed) == (None, 3)


@pytest.mark.parametrize("argv", [["--seeds", "0,x"], ["--seeds", ""], ["--seeds", "0,,1"], ["--seeds", "0,0"],
                                  ["--seeds", "-1,2"], ["--seed", "1", "--seeds", "0,1"]])
def test_a_bad_seeds_value_is_a_usage_error_not_a_traceback(bench, argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + ["--results-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--seeds" in err.splitlines()[-1] and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def fake_runs(ratio: float) -> dict:
    """Three steps whose stream-vs-sync gap is ``ratio`` x the floor at step 2 (and smaller elsewhere)."""
    base = torch.ones(8, dtype=torch.float64)
    unit = torch.zeros(8, dtype=torch.float64)
    unit[0] = 1e-3
    info = {"seconds": 1.0, "ops/direct": 1, "ops/bucket": 2, "ops/fold": 1, "stream/peak_bytes": 64}
    a = [base.clone() for _ in range(3)]
    b = [base + unit for _ in range(3)]
    st = [base + unit * r for r in (1.0, ratio, 0.5)]
    return {"sync_a": (a, [info] * 3), "sync_b": (b, [info] * 3), "stream": (st, [info] * 3)}


def test_several_seeds_run_the_comparison_once_each_and_write_one_seeds_file(bench, monkeypatch, tmp_path, capsys):
    ratios = {0: 2.1, 1: 1.7, 2: 1.9}
    seen = []

    def compare(parser, args):
        seen.append(args.seed)
        return bench.report(args, fake_runs(ratios[args.seed]), 1.0)

    monkeypatch.setattr(bench, "compare", compare)
    result = bench.main(["--quick", "--seeds", "0,1,2", "--results-dir", str(tmp_path)])
    assert seen == [0, 1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["equivalence_seeds.json"]  # the single-seed file untouched
    assert json.loads((tmp_path / "equivalence_seeds.json").read_text()) == result
    assert result["gap_over_floor"] == pytest.approx(1.9) and result["gap_over_floor_worst"] == pytest.approx(2.1)
    assert result["gap_over_floor_per_seed"] == pytest.approx([2.1, 1.7, 1.9]) and result["seeds"] == [0, 1, 2]
    assert [r["seed"] for r in result["per_seed"]] == [0, 1, 2]
    out = capsys.readouterr().out
    assert out.count("worst step: gap/floor") == 3 and "median 1.90 (seed 2) -> PASS" in out
    assert "worst seed 2.10 (above 2)" in out


def test_one_seed_in_seeds_is_the_plain_single_seed_run(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "compare", lambda parser, args: bench.report(args, fake_runs(1.5), 1.0))
    result = bench.main(["--quick", "--seeds", "4", "--results-dir", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["equivalence_seed4.json"] and "seeds" not in result  # as --seed 4


def test_a_failing_seed_keeps_the_seeds_compared_before_it(bench, monkeypatch, tmp_path, capsys):
    ratios = {0: 1.2, 1: 1.6}

    def compare(parser, args):
        if args.seed == 2:
            raise RuntimeError("the engine's worker died")
        return bench.report(args, fake_runs(ratios[args.seed]), 1.0)

    monkeypatch.setattr(bench, "compare", compare)
    with pytest.raises(RuntimeError, match="worker died"):
        bench.main(["--quick", "--seeds", "0,1,2,3", "--results-dir", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["equivalence_seeds_partial.json"]  # never a complete-looking file
    saved = json.loads((tmp_path / "equivalence_seeds_partial.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["gap_over_floor_per_seed"] == pytest.approx([1.2, 1.6])
    assert saved["failed_seed"] == {"seed": 2, "error": "RuntimeError: the engine's worker died"}
    assert saved["seeds_not_run"] == [3]
    assert "PARTIAL: 2 of 4 seeds" in capsys.readouterr().out
