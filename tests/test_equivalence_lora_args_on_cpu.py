"""benchmarks/equivalence.py --lora-rank: what it refuses, and what its result carries (no Ray).

The comparison itself runs in ``tests/learner/test_lora_engine_on_cpu.py`` (slow) and the benchmark; here the
argument check and the report: the ``lora_rank`` key (0 without the flag), the ``_lora<R>`` name and the rollout's
measured staleness in the printed output and the JSON.
"""

from __future__ import annotations

import json

import pytest
import torch



@pytest.fixture(scope="module")
def bench(equivalence_bench):
    return equivalence_bench


@pytest.mark.parametrize("argv", [["--lora-rank", "-1"], ["--lora-rank", "8", "--engine", "megatron"],
                                  ["--lora-rank", "8", "--algo", "opd"], ["--lora-rank", "8", "--mini-batches", "2"],
                                  ["--lora-rank", "8", "--dp", "2"], ["--lora-rank", "8", "--dtype", "bf16"]])
def test_lora_outside_the_fsdp_grpo_comparison_is_a_usage_error(bench, argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv + ["--results-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "Traceback" not in err and not list(tmp_path.iterdir())


def fake_runs() -> dict:
    base = torch.ones(8, dtype=torch.float64)
    unit = torch.zeros(8, dtype=torch.float64)
    unit[0] = 1e-3
    info = {"seconds": 1.0, "ops/direct": 1, "ops/bucket": 2, "ops/fold": 1, "stream/peak_bytes": 64,
            "stream/buffer_bytes": 8}
    return {"sync_a": ([base] * 2, [info] * 2), "sync_b": ([base + unit] * 2, [info] * 2),
            "stream": ([base + unit * 1.5] * 2, [info] * 2)}


def test_the_result_carries_the_rank_the_bucket_size_and_the_measured_rollout_staleness(bench, tmp_path, capsys):
    args = bench.build_parser().parse_args(["--lora-rank", "8", "--results-dir", str(tmp_path)])
    args.per_seed = None
    args.lora_rollout = {"rollout_adapter_staleness": 0, "rollout_staleness_per_step": [0, 0],
                         "rollout_logprob_gap_max": 1e-6, "rollout_logprob_step_change_min": 2e-3,
                         "rollout_tensors_pushed": 28, "rollout_merged_modules": 14,
                         "gap_over_floor_common_theta": 1.5, "gap_over_floor_common_theta_per_step": [1.5]}
    result = bench.report(args, fake_runs(), 1.0)
    assert result["lora_rank"] == 8 and result["stream_bucket_bytes"] == 8 and result["model_param_bytes"] == 32
    assert result["rollout_adapter_staleness"] == 0
    assert "rollout_adapter_staleness: 0" in capsys.readouterr().out
    assert json.loads((tmp_path / "equivalence_lora8.json").read_text())["rollout_adapter_staleness"] == 0


def test_without_the_flag_the_result_says_lora_rank_0(bench, tmp_path):
    args = bench.build_parser().parse_args(["--results-dir", str(tmp_path)])
    args.per_seed = None
    assert bench.report(args, fake_runs(), 1.0)["lora_rank"] == 0
    assert (tmp_path / "equivalence.json").is_file()
