"""Stock ``main_ppo`` in thundersync mode on a local multi-node Ray cluster: the learner and the standalone rollout
on different nodes, weights pushed across, every trajectory learned with zero staleness.

The cluster is three real raylets (``thundersync_verl/run/cluster.py``): a head with no learner/rollout slot (the
driver's) and two nodes of one slot each. The run reaches it through ``RAY_ADDRESS``, as a user's launch does,
and replays the shared recording. Where every actor ran is read from Ray's actor table after the run: a layout
whose learner and rollout processes share a node fails here, whatever the config says.
Slow: a cluster start and one launch (about 3 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import cluster_runs as cr
from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.run.cluster import LocalCluster, layout

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
def test_thundersync_on_three_nodes_separates_learner_and_rollout(tmp_path_factory, tiny_random_lm):
    rec = runs.shared_recording(tmp_path_factory, tiny_random_lm)
    work = tmp_path_factory.mktemp("multinode")
    cluster = LocalCluster(layout("split"), cr.cluster_env(work))
    try:
        cluster.start()
        rows, weights = cr.replayed(cluster, work, tiny_random_lm, rec, "cluster_thundersync", "thundersync",
                                    ["thundersync.deterministic=true"])
        where = cr.placement(cluster)
    finally:
        left = cluster.stop()
    assert left == 0
    print(f"placement: {where}")
    assert len(where["learner"]) == 1 and len(where["rollout"]) == 1, where
    assert where["rollout_server"] == where["rollout"], where  # the server runs beside its slot
    assert not set(where["learner"]) & set(where["rollout"]), f"learner and rollout shared a node: {where}"
    assert "head" not in where["learner"] + where["rollout"]  # the head declares no slot
    assert where["driver"] == ["head"]  # verl's TaskRunner runs next to the launching driver
    assert rows[0]["training/off_policy/trajectory_staleness/max"] == 0
    start = runs.start_weights(tiny_random_lm)
    assert runs.distance(runs.pushed(weights, 1), start) > 0  # the rollout node received the learner's step
