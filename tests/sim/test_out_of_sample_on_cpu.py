"""Out-of-sample replay: costs fitted on one trace predict the other modes' traces without refitting (CPU, no GPU).

The traces here are synthetic (one cost model for every mode, ``simulate_validate.write_self_test_traces``), so an
exact transfer must predict every other mode's step time; measured traces are what the benchmark is for.
"""

from __future__ import annotations

import runpy
import shutil
from pathlib import Path

import pytest

from thundersync_verl.sim.calibrate import Calibration, transferred

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "simulate_validate.py"  # a script, not a package


@pytest.fixture(scope="module")
def grpo_traces(tmp_path_factory):
    validate = runpy.run_path(str(SCRIPT))
    folder = tmp_path_factory.mktemp("traces")
    validate["write_self_test_traces"](folder)
    grpo = folder / "grpo"
    grpo.mkdir()
    for path in folder.glob("grpo_*.jsonl"):
        shutil.move(str(path), grpo / path.name)
    return validate, grpo


@pytest.mark.parametrize("fit", ["grpo_sync.jsonl", "grpo_thundersync.jsonl"])
def test_one_traces_costs_predict_the_other_modes(grpo_traces, fit):
    validate, grpo = grpo_traces
    out = validate["out_of_sample"](grpo / fit, [grpo])
    assert len(out["per_target"]) == 3 and not any(fit in name for name in out["per_target"])
    assert out["max_abs_rel_err_out_of_sample"] < 0.02


def test_transferred_keeps_the_targets_configuration_and_takes_the_fits_system_costs():
    own = Calibration(reward_timing=True, landing_s=0.0, step_gap_s=0.5, slots=64, partial_rollout=True,
                      contention=2.0, contention_ops=9, rollout_contention=1.5, turn_latency_s=None)
    fit = Calibration(reward_timing=False, landing_s=0.3, step_gap_s=0.01, slots=16, partial_rollout=False,
                      contention=1.2, contention_ops=3, rollout_contention=1.0, turn_latency_s=0.2)
    got = transferred(own, fit, fit_landing_s=0.3)
    assert (got.slots, got.partial_rollout, got.turn_latency_s) == (64, True, None)
    assert (got.reward_timing, got.landing_s, got.step_gap_s, got.contention, got.rollout_contention) == (
        False, 0.3, 0.01, 1.2, 1.0)


def test_identical_work_drift_is_the_gap_between_two_runs_of_the_same_learner_work(grpo_traces, tmp_path):
    """Sync and its bypass run train the same rows: their per-token learner cost differs by the machine alone."""
    import json

    validate, grpo = grpo_traces
    sync = [json.loads(line) for line in (grpo / "grpo_sync.jsonl").read_text().splitlines() if line.strip()]
    slowed = [dict(r, t1=r["t0"] + 1.25 * (r["t1"] - r["t0"])) if r["kind"] == "learner" else r for r in sync]
    for name, recs in (("grpo_sync.jsonl", sync), ("grpo_sync_bypass.jsonl", slowed)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in recs))
    files = sorted(tmp_path.glob("grpo_*.jsonl"))
    assert validate["identical_work_drift"](files) == pytest.approx(0.25, abs=1e-3)
    assert validate["identical_work_drift"](files[:1]) is None  # no pair: nothing to compare


def test_the_fits_learner_slowdown_reaches_one_step_off_async_on_its_own_rollout_device(grpo_traces, tmp_path):
    """On the emulated device the rollout side's work on the other core slows the learner's (shared caches and
    memory), so a target whose learner trains while its rollouts run is dealt the fit run's slowdown whatever its
    trainer (sim/transfer.py, point 4); Sync's learner never overlaps its rollouts and is not."""
    from dataclasses import replace

    from thundersync_verl.sim.trace import load_trace, replay_calibration

    validate, grpo = grpo_traces
    for path in grpo.glob("grpo_*.jsonl"):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "meta.json").write_text('{"workload": "recorded"}')  # what modes.py --rollout emulated writes
    fit_path = tmp_path / "grpo_thundersync.jsonl"
    assert validate["rollout_on_own_device"](fit_path)
    trace = load_trace(fit_path)
    calib = replay_calibration(trace)[1]
    settings = validate["RunSettings"]()

    def predicted(target: str, slowdown: float) -> float:
        fit = (trace, replace(calib, contention=slowdown, contention_ops=9), fit_path)
        return validate["predict_file"](tmp_path / target, fit, settings)["predicted_s"]

    # a higher slowdown also lowers the alone costs the fit's records give (each is divided by its stretch), which
    # Sync, never overlapped, shows alone; Async pays them stretched again while its rollouts run
    ratio = {s: predicted("grpo_async.jsonl", s) / predicted("grpo_sync.jsonl", s) for s in (1.0, 1.5)}
    assert ratio[1.5] > 1.08 * ratio[1.0], ratio  # measured 1.13; dealt none, 1.05


def test_two_fits_of_the_same_run_predict_the_same_targets_and_a_slower_machine_spreads_them(grpo_traces, tmp_path):
    """Point 7: fits that differ only in the machine's speed while they ran predict the same targets apart."""
    import json

    validate, grpo = grpo_traces
    fit = [json.loads(line) for line in (grpo / "grpo_thundersync.jsonl").read_text().splitlines() if line.strip()]
    slowed = [dict(r, t1=r["t0"] + 1.3 * (r["t1"] - r["t0"])) if r["kind"] == "learner" else r for r in fit]
    for name, recs in (("same", fit), ("twin", fit), ("slow", slowed)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "grpo_thundersync.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    settings = validate["RunSettings"]()
    fits = lambda *names: [tmp_path / n / "grpo_thundersync.jsonl" for n in names]  # noqa: E731
    twins = validate["fit_to_fit"](fits("same", "twin"), [grpo], settings)
    assert sorted(Path(t).name for t in twins["targets"]) == [  # the folder's own ThunderSync run is not a fit
        "grpo_async.jsonl", "grpo_fully_async.jsonl", "grpo_sync.jsonl", "grpo_thundersync.jsonl"]
    assert twins["max_fit_to_fit_spread"] == 0.0
    in_folder = validate["fit_to_fit"]([grpo / "grpo_thundersync.jsonl", *fits("twin")], [grpo], settings)
    assert "grpo_thundersync.jsonl" not in {Path(t).name for t in in_folder["targets"]}  # a fit is never a target
    assert in_folder["max_fit_to_fit_spread"] == 0.0
    apart = validate["fit_to_fit"](fits("same", "slow"), [grpo], settings)
    assert all(v > 0.05 for v in apart["fit_to_fit_spread"].values()), apart["fit_to_fit_spread"]
    assert apart["max_fit_to_fit_spread"] == max(apart["fit_to_fit_spread"].values())


def test_paired_runs_predict_each_other_and_a_folder_without_thundersync_is_refused(grpo_traces, tmp_path):
    """Point 8: each folder's ThunderSync run predicts its other mode; a Sync partner predicts the ThunderSync run."""
    validate, grpo = grpo_traces
    for folder, mode in (("with_async", "async"), ("with_sync", "sync")):
        (tmp_path / folder).mkdir()
        for name in (f"grpo_{mode}.jsonl", "grpo_thundersync.jsonl"):
            shutil.copy(grpo / name, tmp_path / folder / name)
    settings = validate["RunSettings"]()
    out = validate["paired"]([tmp_path / "with_async", tmp_path / "with_sync"], settings)
    names = {k.split("/", 1)[1] for k in out["per_target"]}
    assert names == {"with_async/grpo_async.jsonl <- grpo_thundersync", "with_sync/grpo_sync.jsonl <- grpo_thundersync",
                     "with_sync/grpo_thundersync.jsonl <- grpo_sync"}  # Async never predicts ThunderSync; Sync does
    assert out["max_abs_rel_err_out_of_sample_paired"] < 0.02  # one cost model wrote every synthetic trace
    (tmp_path / "alone").mkdir()
    shutil.copy(grpo / "grpo_sync.jsonl", tmp_path / "alone" / "grpo_sync.jsonl")
    with pytest.raises(SystemExit, match="needs grpo_thundersync.jsonl"):
        validate["paired"]([tmp_path / "alone"], settings)


def test_a_fit_on_a_slower_machine_is_brought_back_to_the_targets_speed_by_the_probes(grpo_traces, tmp_path):
    """Point 9: the fit run's learner ran 1.3x slower for identical work; its raw predictions miss the targets, and
    the probes' ratio (the fit's probe 1.3x the targets') gives the targets' costs back. Without probes: None."""
    import json

    validate, grpo = grpo_traces
    fit = [json.loads(line) for line in (grpo / "grpo_thundersync.jsonl").read_text().splitlines() if line.strip()]
    slowed = [dict(r, t1=r["t0"] + 1.3 * (r["t1"] - r["t0"])) if r["kind"] == "learner" else r for r in fit]
    for path in grpo.glob("grpo_*.jsonl"):
        shutil.copy(path, tmp_path / path.name)
    (tmp_path / "grpo_thundersync.jsonl").write_text("".join(json.dumps(r) + "\n" for r in slowed))
    targets = [tmp_path / f"grpo_{m}.jsonl" for m in ("sync", "async", "fully_async")]
    bare = validate["out_of_sample"](tmp_path / "grpo_thundersync.jsonl", [], only=targets)
    assert bare["max_abs_rel_err_at_machine_speed"] is None  # no meta.json: no probes, nothing claimed
    assert bare["max_abs_rel_err_out_of_sample"] > 0.05
    probes = {"thundersync": [0.26, 0.26], "sync": [0.2, 0.2], "async": [0.19, 0.21], "fully_async": [0.2, 0.2]}
    (tmp_path / "meta.json").write_text(json.dumps({"workload": "recorded", "machine_probe_s": probes}))
    assert validate["speed_ratio"](tmp_path / "grpo_thundersync.jsonl", targets[1]) == pytest.approx(1 / 1.3)
    out = validate["out_of_sample"](tmp_path / "grpo_thundersync.jsonl", [], only=targets)
    assert out["max_abs_rel_err_at_machine_speed"] < 0.02 < out["max_abs_rel_err_out_of_sample"]
    entry = out["per_target"][validate["_short"](targets[0])]
    assert entry["machine_speed_ratio"] == pytest.approx(1 / 1.3, abs=1e-4)


def _digests(node) -> dict[str, str]:
    """Every ``trace_sha256`` mapping in a result file, merged (path in the repository -> digest)."""
    if isinstance(node, list):
        return {k: v for item in node for k, v in _digests(item).items()}
    if not isinstance(node, dict):
        return {}
    found = dict(node["trace_sha256"]) if isinstance(node.get("trace_sha256"), dict) else {}
    for key, value in node.items():
        if key != "trace_sha256":
            found.update(_digests(value))
    return found


def test_the_committed_results_were_made_from_the_committed_traces():
    """``simulate_validate.json`` and every ``simulate_validate_out_of_sample*.json`` (cited on docs/results.md) keep
    each replayed trace's digest: traces re-recorded since (``modes.py`` writes them under ``benchmarks/results``)
    need the script re-run with the command of its docs/results.md row, and the row updated."""
    import json

    validate = runpy.run_path(str(SCRIPT))
    results, repo = SCRIPT.parent / "results", SCRIPT.parents[1]
    per_mode = json.loads((results / "simulate_validate.json").read_text())["per_mode"]
    checked = {"simulate_validate.json": {f"benchmarks/results/traces/{stem}.jsonl": entry.get("trace_sha256")
                                          for stem, entry in per_mode.items()}}
    for path in sorted(results.glob("simulate_validate_out_of_sample*.json")):
        checked[path.name] = _digests(json.loads(path.read_text()))
    assert len(checked) >= 6  # the validation and the five out-of-sample files cited
    for name, digests in checked.items():
        assert digests, f"{name} keeps no trace digest: re-run the command of its docs/results.md row"
        stale = sorted(path for path, digest in digests.items()
                       if not (repo / path).is_file() or digest != validate["trace_digest"](repo / path))
        assert not stale, (f"{name}: re-run the command of its docs/results.md row (and update the row): these "
                           f"traces changed or went since it was made: {stale}")

def test_a_cited_file_is_made_again_by_its_own_command_and_a_wrong_family_is_a_usage_error(tmp_path, capsys):
    """The ``driver-low`` row's command (``--family NAME=DIR --save-as NAME``) gives its committed figures again."""
    import json

    validate = runpy.run_path(str(SCRIPT))
    results = SCRIPT.parent / "results"
    name = "simulate_validate_out_of_sample_driver_low"
    folder = results / "traces_emulated_recorded_driver_low" / "r0"
    assert validate["main"](["--out-of-sample", "--family", f"emulated_recorded={folder}", "--save-as", name,
                             "--results-dir", str(tmp_path)]) == 0
    made, committed = (json.loads(p.read_text()) for p in (tmp_path / f"{name}.json", results / f"{name}.json"))
    assert made == committed
    with pytest.raises(SystemExit) as usage:
        validate["main"](["--out-of-sample", "--family", f"no_such_family={folder}"])
    assert usage.value.code == 2 and "--family no_such_family=" in capsys.readouterr().err
