"""The step-1 update gap of the emulated device (``emulated_rollout.py`` point 5): ThunderSync's first update against
verl's Sync runs on the same replayed trajectories, over the floor of verl's own run-to-run spread."""

from __future__ import annotations

from pathlib import Path

import emulated_rollout as er  # the sibling script: run_replay

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="
TOKEN_SUM = ["actor_rollout_ref.actor.loss_agg_mode=token-sum"]
# name -> (mode, overrides); every "sync*" run of the token-mean config is a member of the floor
EXACT_RUNS = {"sync_bypass": ("sync_bypass", []), "sync_bypass_micro2": ("sync_bypass", [MICRO + "2"]),
              "sync_bypass_micro4": ("sync_bypass", [MICRO + "4"]), "sync": ("sync", []),
              "sync_micro2": ("sync", [MICRO + "2"]), "sync_micro4": ("sync", [MICRO + "4"]),
              "thundersync": ("thundersync", []),
              "token_sum_sync": ("sync", TOKEN_SUM), "token_sum_thundersync": ("thundersync", TOKEN_SUM)}
SGD = ["actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=1e4"]


def step1_update_gap(inputs: dict, work: Path, workload: str, rec: Path) -> dict:
    """Relative gaps of the step-1 updates (module docstring, point 5)."""
    import torch

    deltas = {}
    for name, (mode, extra) in EXACT_RUNS.items():
        wdir = work / "emulated" / "exact" / name
        for old in wdir.glob("weights_v*.pt"):
            old.unlink()
        er.run_replay(mode, 1, inputs, work / "emulated" / "exact", workload, rec, 0.0, tag=f"_{name}",
                   extra=SGD + extra, env={"THUNDERSYNC_REPLAY_WEIGHTS_DIR": str(wdir)}, pin=False)
        w0, w1 = (torch.load(wdir / f"weights_v{v}.pt") for v in (0, 1))
        deltas[name] = torch.cat([(w1[k].double() - w0[k].double()).flatten() for k in sorted(w0)])
    return update_gaps(deltas)


def update_gaps(deltas: dict) -> dict:
    """The step-1 figures from each run's update (a flat float64 tensor per ``EXACT_RUNS`` name)."""
    if float(deltas["sync_bypass"].norm()) == 0.0:  # nothing to compare: every ratio below would be 0 / 0
        raise ValueError("step-1 update gap: verl's Sync run did not move the weights (every group of the recording's "
                         "first batch has one reward, so every GRPO advantage is 0); record the workload again "
                         "(delete its folder under <work-dir>/emulated) or measure on a later step's batch")
    rel = lambda a, b, by="sync_bypass": float((deltas[a] - deltas[b]).norm() / deltas[by].norm())  # noqa: E731
    syncs = [k for k in EXACT_RUNS if k.startswith("sync")]
    spread = {(a, b): rel(a, b) for i, a in enumerate(syncs) for b in syncs[i + 1:]}
    floor, gap = max(spread.values()), rel("thundersync", "sync_bypass")
    bypass_floor = max(v for pair, v in spread.items() if all(k.startswith("sync_bypass") for k in pair))
    return {"step1_update_gap": gap, "step1_update_floor": floor,
            "step1_update_gap_over_floor": gap / floor if floor > 0 else float("inf"),
            "step1_update_floor_pairs": {f"{a}-{b}": v for (a, b), v in spread.items()},
            "step1_update_gap_vs_sync_own_old_log_probs": rel("thundersync", "sync"),
            "step1_update_gap_bypass_vs_sync": rel("sync_bypass", "sync"),
            "step1_update_floor_bypass_only": bypass_floor,
            "step1_update_gap_over_bypass_only_floor": gap / bypass_floor if bypass_floor > 0 else float("inf"),
            "step1_update_gap_token_sum": rel("token_sum_thundersync", "token_sum_sync", by="token_sum_sync"),
            # token-sum's coefficients are the advantages themselves: its update's direction is the exact one
            "step1_direction_gap_to_token_sum": {name: direction_gap(deltas[name], deltas["token_sum_sync"])
                                                 for name in ("thundersync", "sync", "sync_bypass")},
            "step1_update_norm": float(deltas["sync_bypass"].norm())}


def direction_gap(a, b) -> float:
    """|a/|a| - b/|b||: how far two updates point apart, whatever their lengths (a clipped token-sum step is longer)."""
    return float((a / a.norm() - b / b.norm()).norm())
