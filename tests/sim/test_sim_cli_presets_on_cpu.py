"""CLI, planner, presets and the dependency rule of the simulator package (CPU, < 60 s)."""

from __future__ import annotations

import ast
import runpy
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from thundersync_verl.sim import presets
from thundersync_verl.sim.sim_cli import main
from thundersync_verl.sim.sim_engine import simulate
from thundersync_verl.sim.hardware import ClusterSpec, accumulator_bytes_per_rank, open_groups_within
from thundersync_verl.sim.planner import plan
from thundersync_verl.sim.workload import SyntheticSource

SIM_DIR = Path(__file__).resolve().parents[2] / "thundersync_verl" / "sim"
FORBIDDEN = ("torch", "ray", "verl", "megatron", "omegaconf", "scipy")


def test_sim_sources_import_only_numpy_matplotlib_stdlib():
    for path in SIM_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"


def test_importing_the_simulator_pulls_no_heavy_framework():
    code = ("import sys, thundersync_verl; before = set(sys.modules); "
            "import thundersync_verl.sim, thundersync_verl.sim.sim_cli, thundersync_verl.sim.plot, "
            "thundersync_verl.sim.planner, thundersync_verl.sim.tracegen; "
            "new = {m.split('.')[0] for m in set(sys.modules) - before}; "
            f"bad = new & set({FORBIDDEN!r}); assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SIM_DIR.parents[1])


def test_paper_table_sources_every_parameter():
    table = presets.paper_setting().table
    assert len(table) >= 20
    assert {p.source for p in table} <= {presets.PUBLISHED, presets.VENDOR, presets.ASSUMED, presets.DERIVED}
    assert all(p.note for p in table)
    assert sum(p.source == presets.PUBLISHED for p in table) >= 5


def test_paper_preset_is_in_the_published_ballpark():
    """Coarse check on 60 steps; benchmarks/simulate_paper.py checks the 10% band on 600."""
    s = presets.paper_setting()
    src = SyntheticSource(s.workload, s.rollout, seed=0)
    sync = simulate(s.sim_config("sync", "grpo", 60), src, s.costs)
    ts = simulate(s.sim_config("thundersync", "grpo", 60), src, s.costs)
    pub = presets.PUBLISHED_STEP_S["grpo"]
    assert sync.step_time_s == pytest.approx(pub["sync_s"], rel=0.15)
    assert ts.step_time_s == pytest.approx(pub["thundersync_s"], rel=0.15)
    assert abs(sync.learner_wait_share - presets.PUBLISHED_SYNC_LEARNER_WAIT) < 0.08
    # the published 1.3-1.5 TB of accumulators over 4 ranks
    assert 1.2e12 < 4 * ts.accum_peak_bytes_per_rank < 1.6e12


def test_memory_arithmetic():
    cluster = ClusterSpec(gpus=8, learner_gpus=4, cp=4)
    model = presets.PAPER_MODEL
    assert accumulator_bytes_per_rank(model, cluster, 5) == pytest.approx(4 * 11 * 30e9 / 4)
    assert open_groups_within(model, cluster, 4 * 11 * 30e9 / 4) == 5
    assert open_groups_within(model, cluster, 1e9) == -1
    with pytest.raises(ValueError, match="multiple of tp"):
        ClusterSpec(gpus=8, learner_gpus=4, tp=8)


def test_scale_presets_refuse_models_that_do_not_fit():
    with pytest.raises(ValueError, match="larger cluster"):
        presets.scale_setting(8, "235B", "lognormal")
    s = presets.scale_setting(64, "30B", "pareto")
    assert s.cluster.dp == 8 and s.budget_groups > 0


@pytest.mark.slow  # simulates and renders a timeline image
def test_cli_simulate_prints_a_table_and_a_timeline(tmp_path, capsys):
    png = tmp_path / "tl.png"
    assert main(["simulate", "--steps", "4", "--groups", "8", "--timeline", str(png)]) == 0
    out = capsys.readouterr().out
    assert "sync/batch" in out and "thundersync/trajectory" in out and png.stat().st_size > 10_000


def test_cli_plan_explains_its_choice(capsys):
    assert main(["plan", "--params", "30B", "--gpus", "8", "--learner-gpus", "4", "--cp", "4", "--steps", "6",
                 "--groups", "8"]) == 0
    out = capsys.readouterr().out
    assert "Recommendation: mode=" in out and "Why:" in out and "4*P/shards" in out


def test_planner_respects_host_memory():
    s = presets.paper_setting(groups_per_step=8)
    s = replace(s, rollout=replace(s.rollout, slots=64))
    src = SyntheticSource(s.workload, s.rollout, seed=0)
    tight = plan(s, src, steps=6, host_mem_gb_per_rank=100)  # 80 GB: one batch buffer + 0 groups
    assert tight.mode in ("thundersync", "sync") and (tight.budget_groups or 0) <= 0
    none = plan(s, src, steps=6, host_mem_gb_per_rank=10)  # not even the batch accumulator fits
    assert none.mode == "sync" and any("does not fit" in r for r in none.reasons)
    roomy = plan(s, src, steps=6, host_mem_gb_per_rank=2000)
    assert roomy.step_time_s <= tight.step_time_s + 1e-9


def test_validate_benchmark_explains_how_to_get_traces(tmp_path, capsys):
    script = SIM_DIR.parents[1] / "benchmarks" / "simulate_validate.py"  # a script, not a package
    validate = runpy.run_path(str(script))["main"]

    assert validate(["--trace-dir", str(tmp_path)]) == 2
    assert "python benchmarks/modes.py" in capsys.readouterr().err
