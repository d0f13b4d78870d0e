"""The local multi-node Ray cluster (``thundersync_verl/run/cluster.py``): real raylets, each node its own slots,
a lost node seen as dead by the head, and nothing left running after ``stop``."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from thundersync_verl.run import cluster as cluster_mod
from thundersync_verl.run.cluster import LocalCluster, NodeSpec, layout


def ray_cli_that(tmp_path: Path, first_call: str) -> tuple[str, Path]:
    """A ``ray`` command whose first call runs ``first_call`` (shell: ``$REAL`` is Ray's own command) instead;
    later calls run the real one. Returns the script and the file counting its calls."""
    calls = tmp_path / "calls"
    script = tmp_path / "ray"
    script.write_text(f"""#!/bin/bash
REAL={cluster_mod._ray_cli()}
n=$(cat {calls} 2>/dev/null || echo 0); echo $((n + 1)) > {calls}
if [ "$n" = 0 ]; then {first_call}; fi
exec "$REAL" "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script), calls


def test_unknown_layout_and_a_head_with_slots_are_refused():
    with pytest.raises(ValueError, match="unknown cluster layout"):
        layout("three")
    with pytest.raises(ValueError, match="head node first"):
        LocalCluster([NodeSpec("node1", gpus=1)])


def test_a_failing_ray_start_that_is_not_a_startup_timeout_is_raised_at_once(tmp_path):
    cli, calls = ray_cli_that(tmp_path, "echo 'ValueError: bad --resources'; exit 1")
    cluster = LocalCluster(layout("split"), ray_cli=cli, log=lambda msg: None)
    with pytest.raises(RuntimeError, match="(?s)ray start of node .head. failed.*bad --resources") as err:
        cluster.start()
    assert not isinstance(err.value, cluster_mod.RayStartTimeout)
    assert calls.read_text().strip() == "1"  # no second attempt
    cluster.stop()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_three_raylets_declare_their_own_slots_and_a_killed_node_goes_dead(tmp_path):
    # the head's first ``ray start`` starts it, then gives up as a loaded machine's does ("timed out during
    # startup"): the cluster ends what it left and starts again
    cli, calls = ray_cli_that(tmp_path, '"$REAL" "$@" >/dev/null 2>&1; '
                              "echo 'The current node timed out during startup.'; exit 1")
    logged = []
    cluster = LocalCluster(layout("split"), ray_cli=cli, log=logged.append)
    try:
        cluster.start()
        assert any("'head' gave up while starting" in m and "attempt 2/" in m for m in logged), logged
        assert int(calls.read_text()) == 4  # the head twice, then each worker node once
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
