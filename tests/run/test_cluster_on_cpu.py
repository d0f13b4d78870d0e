"""The local multi-node Ray cluster (``thundersync_verl/run/cluster.py``): real raylets, each node its own slots,
a lost node seen as dead by the head, and nothing left running after ``stop``."""

from __future__ import annotations

import pytest

from thundersync_verl.run.cluster import LocalCluster, NodeSpec, layout


def test_unknown_layout_and_a_head_with_slots_are_refused():
    with pytest.raises(ValueError, match="unknown cluster layout"):
        layout("three")
    with pytest.raises(ValueError, match="head node first"):
        LocalCluster([NodeSpec("node1", gpus=1)])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_three_raylets_declare_their_own_slots_and_a_killed_node_goes_dead():
    cluster = LocalCluster(layout("split"))
    try:
        cluster.start()
        table = {row["name"]: row for row in cluster.node_table()}
        assert sorted(table) == ["head", "node1", "node2"]
        assert len({row["id"] for row in table.values()}) == 3  # three raylets, not one node seen three times
        assert table["head"]["resources"].get("GPU", 0) == 0  # the driver's node holds no learner/rollout slot
        assert table["node1"]["resources"]["GPU"] == 1 and table["node2"]["resources"]["GPU"] == 1
        raylet = cluster.kill_node("node2")
        assert cluster.raylet_pid("node2") is None and raylet not in cluster.processes()
        cluster.wait_for_nodes(2)
        alive = {row["name"] for row in cluster.node_table() if row["alive"]}
        assert alive == {"head", "node1"}
    finally:
        left = cluster.stop()
    assert left == 0 and cluster.leftover_processes() == 0
