"""The tail study's deployments (sim/tail_study.py): Sync with the same tail policy as the fair reference (CPU, s)."""

from __future__ import annotations

import numpy as np

from test_sim_tail_on_cpu import tail_run
from thundersync_verl.sim.tail_study import SYNC_TAIL, TAIL, Deployment, Variant, run_deployment


def test_sync_with_the_tail_policy_trains_the_same_groups_later_than_the_stream():
    streamed, _ = tail_run(1.5, 2, "dedicated")
    synced, _ = tail_run(1.5, 2, "dedicated", granularity="batch")
    for a, b in zip(streamed.extra["tail_log"], synced.extra["tail_log"]):
        assert a["trained"].tolist() == b["trained"].tolist()  # same launches, aborts and kept groups
    assert set(synced.staleness) == {0}
    assert np.all(np.asarray(synced.step_times) >= np.asarray(streamed.step_times) - 1e-9)  # no overlap to gain


def test_a_deployment_reports_the_sync_tail_reference_beside_every_mode():
    dep = Deployment(16, "30B", "lognormal", 8)
    rows = run_deployment(dep, [Variant(1.25, 2)], steps=6, plan_steps=4, warmup=2)
    by = {r["mode"]: r for r in rows}
    assert set(by) == {"sync", "async", "fully_async", "thundersync", TAIL, SYNC_TAIL}
    ref = by[SYNC_TAIL]
    assert ref["variant"] == "eta1.25_K2_dedicated" and ref["staleness_max"] == 0
    assert ref["x_sync"] == by["sync"]["step_s"] / ref["step_s"]
    assert 0.0 <= ref["deferred_prompt_share"] <= 1.0 and ref["wasted_token_share"] >= 0.0
