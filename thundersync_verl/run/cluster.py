"""A multi-node Ray cluster on one machine: a head and worker nodes as separate ``ray start`` processes.

Why:
1. The recipes' multi-node layouts (learner on some nodes, the standalone rollout pool on others, weight pushes
   and the TransferQueue between them) only meet their real failure modes on a real Ray cluster: several
   raylets, each with its own object store, resources and worker processes. Ray runs such a cluster on one
   machine (its own tests do), so each node here is a real raylet started by ``ray start``, the way users
   start theirs, and a run reaches it the way users do: ``RAY_ADDRESS`` pointed at the head.
2. Placement by construction: verl places its learner pool and its standalone rollout pool by the ``GPU``
   resource (the CPU platform's logical slots), one bundle per slot. The head declares no slot and each worker
   node exactly one, so no two learner or rollout processes can share a node, nor run on the head, whatever
   order Ray fills them in. Which worker node gets which role is Ray's choice: it is read back from Ray's
   actor table (each node carries a custom resource ``thundersync_<name>`` naming it).
3. Nothing is left running: every process of this cluster names its private ``--temp-dir`` on its command line,
   so ``stop`` ends exactly those (by process id, never ``ray stop``, which would end every Ray on the machine)
   and ``leftover_processes`` counts them from ``/proc``. Ports are chosen free; the temp dir is short
   (``/tmp/tsc_*``: Ray's socket paths must stay under 108 bytes).
4. ``kill_node`` ends one node's raylet with SIGKILL (a lost machine as the head sees it); ``restart_node``
   starts a fresh raylet with the same resources (a replaced machine joining the cluster).
5. A loaded machine can make ``ray start`` give up while its GCS or raylet is still coming up ("timed out during
   startup", "Deadline Exceeded"), leaving some of its processes running. Such a start is retried, up to
   ``START_ATTEMPTS`` in all, after ending what it left: the whole cluster for ``start``, the node for
   ``restart_node``. Any other failure of ``ray start`` is raised at once with Ray's output.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RESOURCE_PREFIX = "thundersync_"
OBJECT_STORE_BYTES = 300 * 1024 * 1024  # per node: weights of a tiny model and a step's trajectories fit many times
QUERY_TAG = "@@thundersync-query "  # marks a short-lived driver's answer among Ray's own stdout lines
CPUS_PER_NODE = 8  # logical CPU slots: verl bundles take 2-3 CPUs each, helper actors 1
START_ATTEMPTS = 3
START_TIMEOUT_S = 180
STARTUP_TIMEOUT_MARKS = ("timed out during startup", "Deadline Exceeded")  # Ray's words for a start that gave up


class RayStartTimeout(RuntimeError):
    """``ray start`` gave up while the node was still starting (point 5): worth another attempt."""


@dataclass(frozen=True)
class NodeSpec:
    """One node: its name, logical CPU slots, logical learner/rollout slots (Ray ``GPU``)."""

    name: str
    gpus: int = 0
    cpus: int = CPUS_PER_NODE


@dataclass
class Node:
    spec: NodeSpec
    node_manager_port: int
    ports: list[int] = field(default_factory=list)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free right now (bound and released together, so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def layout(name: str) -> list[NodeSpec]:
    """The named layouts: ``split`` (head + two one-slot nodes: the recipe's learner and its standalone rollout),
    ``dp2`` (head + three one-slot nodes: ``trainer.nnodes=2`` learner ranks and the rollout)."""
    workers = {"split": 2, "dp2": 3}
    if name not in workers:
        raise ValueError(f"unknown cluster layout {name!r}: use one of {sorted(workers)}")
    return [NodeSpec("head"), *(NodeSpec(f"node{i}", gpus=1) for i in range(1, workers[name] + 1))]


class LocalCluster:
    """``with LocalCluster(layout("split"), env) as c: ... c.address ...``: started, then every process ended."""

    def __init__(self, nodes: list[NodeSpec], env: dict[str, str] | None = None, *, log=None, ray_cli: str = ""):
        if not nodes or nodes[0].gpus:
            raise ValueError("a local cluster needs a head node first, declaring no learner/rollout slot")
        self.specs = nodes
        self.env = dict(os.environ if env is None else env)
        self.env["RAY_AUTH_MODE"] = "disabled"  # a self-contained cluster: no token under $HOME
        self.temp_dir = tempfile.mkdtemp(prefix="tsc_", dir="/tmp")
        self.env["RAY_TMPDIR"] = self.temp_dir
        self.env.pop("RAY_ADDRESS", None)
        self.nodes: dict[str, Node] = {}
        self.names_by_id: dict[str, str] = {}  # Ray node id -> node name, for every node seen alive
        self.address = ""
        self.ray_cli = ray_cli or _ray_cli()
        self.log = log or (lambda msg: print(f"[cluster] {msg}", file=sys.stderr, flush=True))

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "LocalCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        def end_all() -> None:
            self._end_processes()
            self.nodes.clear()

        t0 = time.time()
        self._retried(self._start_all, end_all, "the local cluster")
        self.log(f"{len(self.specs)} nodes up at {self.address} in {time.time() - t0:.1f}s "
                 f"({', '.join(f'{s.name}: {s.gpus} slot(s)' for s in self.specs)})")

    def _start_all(self) -> None:
        head = self.specs[0]
        gcs_port, client_port, dash_port = free_ports(3)
        self.address = f"127.0.0.1:{gcs_port}"
        self._start_node(head, ["--head", f"--port={gcs_port}", f"--ray-client-server-port={client_port}",
                                "--include-dashboard=false", f"--dashboard-port={dash_port}",
                                f"--temp-dir={self.temp_dir}"])
        for spec in self.specs[1:]:
            self._start_node(spec, [f"--address={self.address}"])
        self.wait_for_nodes(len(self.specs))

    def _start_node(self, spec: NodeSpec, extra: list[str]) -> None:
        """One ``ray start``; raises ``RayStartTimeout`` when it gave up while starting (point 5)."""
        nm, om, agent_grpc, agent_http, runtime_env, metrics = free_ports(6)
        self.nodes[spec.name] = Node(spec, nm, [nm, om, agent_grpc, agent_http, runtime_env, metrics])
        cmd = [self.ray_cli, "start", "--node-ip-address=127.0.0.1", f"--num-cpus={spec.cpus}",
               f"--num-gpus={spec.gpus}", f"--resources={json.dumps({RESOURCE_PREFIX + spec.name: 1})}",
               f"--object-store-memory={OBJECT_STORE_BYTES}", f"--node-manager-port={nm}",
               f"--object-manager-port={om}", f"--dashboard-agent-grpc-port={agent_grpc}",
               f"--dashboard-agent-listen-port={agent_http}", f"--runtime-env-agent-port={runtime_env}",
               f"--metrics-export-port={metrics}", "--disable-usage-stats", *extra]
        try:
            out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise RayStartTimeout(f"ray start of node {spec.name!r} still ran after {START_TIMEOUT_S}s") from exc
        if out.returncode != 0:
            said = (out.stdout + out.stderr)[-3000:]
            if any(mark in said for mark in STARTUP_TIMEOUT_MARKS):
                raise RayStartTimeout(f"ray start of node {spec.name!r} gave up while starting "
                                      f"(exit {out.returncode}):\n{said}")
            raise RuntimeError(f"ray start of node {spec.name!r} failed (exit {out.returncode}):\n{said}")

    def stop(self) -> int:
        """End every process of this cluster (SIGTERM, then SIGKILL after 10 s); returns how many were left after."""
        pids, left = self._end_processes()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        if pids:
            self.log(f"stopped {len(pids)} processes; {left} left")
        return left

    def _end_processes(self) -> tuple[list[int], int]:
        pids = self.processes()
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.time() + 10
        while time.time() < deadline and self.processes():
            time.sleep(0.3)
        for pid in self.processes():
            _signal(pid, signal.SIGKILL)
        time.sleep(0.5)
        return pids, len(self.processes())

    # -- what runs where ----------------------------------------------------------------------
    def processes(self) -> list[int]:
        """Ids of the live processes of this cluster: those naming its temp dir on their command line (Ray's
        daemons) or in their environment (worker processes, whose command line Ray rewrites to ``ray::<name>``)."""
        mark = f"RAY_TMPDIR={self.temp_dir}\0".encode()
        return [pid for pid, cmd in _proc_cmdlines() if pid != os.getpid()
                and (self.temp_dir in cmd or mark in _environ(pid))]

    def leftover_processes(self) -> int:
        return len(self.processes())

    def node_processes(self, name: str) -> list[int]:
        """Ids of node ``name``'s raylet and of the processes it started (workers, agents)."""
        raylet = self.raylet_pid(name)
        return [] if raylet is None else [raylet, *(pid for pid, _ in _proc_cmdlines() if _ppid(pid) == raylet)]

    def raylet_pid(self, name: str) -> int | None:
        port = self.nodes[name].node_manager_port
        for pid, cmd in _proc_cmdlines():
            if "raylet" in cmd.split(" ", 1)[0] and f"--node_manager_port={port}" in cmd:
                return pid
        return None

    def query(self, expression: str, what: str, imports: str = "") -> object:
        """Evaluate ``expression`` (JSON-able) in a short-lived driver attached to the cluster.

        Ray may print its own lines on stdout after ours (a node's lagging heartbeats, say), so the answer
        travels on one line of its own, tagged, and is found by its tag.
        """
        code = (f"import json, ray{imports}; ray.init(address={self.address!r}, logging_level='ERROR', "
                f"log_to_driver=False); print({QUERY_TAG!r} + json.dumps({expression}), flush=True)")
        out = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=120)
        answers = [line[len(QUERY_TAG):] for line in out.stdout.splitlines() if line.startswith(QUERY_TAG)]
        if out.returncode != 0 or not answers:
            raise RuntimeError(f"reading {what} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
        return json.loads(answers[-1])

    def node_table(self) -> list[dict]:
        """Ray's node table, read by a short-lived driver: alive, node id, resources, node name by custom resource."""
        rows = self.query("[{'id': n['NodeID'], 'alive': n['Alive'], 'resources': n['Resources']} "
                          "for n in ray.nodes()]", "the node table")
        for row in rows:
            names = [k[len(RESOURCE_PREFIX):] for k in row["resources"] if k.startswith(RESOURCE_PREFIX)]
            if names:
                self.names_by_id[row["id"]] = names[0]
            row["name"] = self.names_by_id.get(row["id"])  # a dead node may list no resources: its name seen alive
        return rows

    def wait_for_nodes(self, n: int, timeout: float = 120) -> list[dict]:
        """Ray's table once exactly ``n`` nodes are alive (joined, or the others seen dead by the head)."""
        deadline = time.time() + timeout
        while True:
            rows = [r for r in self.node_table() if r["alive"]]
            if len(rows) == n:
                return rows
            if time.time() > deadline:
                raise RuntimeError(f"{len(rows)} nodes alive in the cluster at {self.address} after {timeout:.0f}s, "
                                   f"not {n}")
            time.sleep(1)

    # -- node loss -----------------------------------------------------------------------------
    def kill_node(self, name: str) -> int:
        """SIGKILL node ``name``'s raylet (its workers then exit on their own); returns the raylet's id."""
        pid = self.raylet_pid(name)
        if pid is None:
            raise RuntimeError(f"node {name!r} has no live raylet")
        _signal(pid, signal.SIGKILL)
        _wait_gone(pid)  # a SIGKILL is delivered asynchronously: the raylet may still run when kill() returns
        self.log(f"killed node {name!r} (raylet {pid})")
        return pid

    def restart_node(self, name: str) -> None:
        """A fresh raylet with node ``name``'s resources joins the cluster (a replaced machine)."""
        pids = self.node_processes(name)
        for pid in pids:
            _signal(pid, signal.SIGKILL)  # whatever of the lost node still runs
        for pid in pids:
            _wait_gone(pid)  # its ports are free before the replacement binds them
        def end_node() -> None:
            for pid in self.node_processes(name):
                _signal(pid, signal.SIGKILL)

        self._retried(lambda: self._start_node(self.nodes[name].spec, [f"--address={self.address}"]), end_node,
                      f"node {name!r}")
        self.wait_for_nodes(len(self.specs))

    def _retried(self, start, clean_up, what: str) -> None:
        """``start()`` up to ``START_ATTEMPTS`` times while it raises ``RayStartTimeout``, ``clean_up()`` after each
        such failure (point 5)."""
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                return start()
            except RayStartTimeout as exc:
                clean_up()
                if attempt == START_ATTEMPTS:
                    raise RuntimeError(f"{what} did not start in {START_ATTEMPTS} attempts; the last: {exc}") from exc
                self.log(f"{str(exc).splitlines()[0]}: ended what it left, starting again "
                         f"(attempt {attempt + 1}/{START_ATTEMPTS})")


def _ray_cli() -> str:
    local = Path(sys.executable).with_name("ray")
    return str(local) if local.is_file() else "ray"


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Return once ``pid`` has exited (gone, or a zombie: an empty command line) or raise after ``timeout``."""
    deadline = time.time() + timeout
    while _cmdline(pid):
        if time.time() > deadline:
            raise RuntimeError(f"process {pid} still runs {timeout:.0f}s after SIGKILL")
        time.sleep(0.05)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def _proc_cmdlines():
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        raw = _cmdline(int(entry))
        if raw:
            yield int(entry), raw.replace(b"\0", b" ").decode(errors="replace")
