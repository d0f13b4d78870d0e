"""``SWEConfig``: the ``swe.*`` keys of a run's hydra config, typed once at the edge.

Why:
1. The SWE agent loop (``envs/swe/swe_agent_loop.py``) reads its limits (turns, context, timeouts) and
   picks its sandbox backend from one top-level ``swe`` section of the run config, next to verl's own
   sections, so a hydra override such as ``swe.sandbox=docker`` switches the backend.
2. The section is checked the way ``thundersync.*`` is (``thundersync_verl/config.py``, whose key
   machinery this module reuses): every key has a type, a range and a one-line doc; a bad value or an
   unknown key raises ``StreamingConfigError`` naming the key (``swe.max_turns``).
3. A run without a ``swe`` section gets the defaults; ``docker`` is a nested section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from thundersync_verl import verl_adapter as va
from thundersync_verl.config import (section_of, _Refused, _Section, _boolean, _choice, _integer, _key, _number, _optional, _path,
                                     _section)

SANDBOXES = ("local", "docker")
DEFAULT_TEST_COMMAND = "python -m pytest -rA --tb=no -q -p no:cacheprovider"
SWE_SMITH_ENV_SETUP = "source /opt/miniconda3/bin/activate testbed >/dev/null 2>&1 || true"


def _text(*, empty: bool = False) -> Callable:
    def check(value, key):
        if not isinstance(value, str) or (not empty and not value.strip()):
            raise _Refused("a string" if empty else "a non-empty string")
        return value
    return check


def _unprivileged(value, key):
    parts = str(value).split(":")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) == 0:
        raise _Refused("uid:gid in numbers, uid not 0 (e.g. 1000:1000): the agent's shell never runs as root")
    return str(value)


@dataclass
class DockerConfig(_Section, va.base_config_cls()):
    """``swe.docker``: one container per trajectory, through the docker CLI (``envs/swe/docker.py``)."""

    PREFIX: ClassVar[str] = "swe.docker"

    binary: str = _key("docker", _text(), "the docker CLI (a name on PATH or a path)")
    image: str | None = _key(None, _optional(_text(), "the instance's image_name"),
                             "image for every instance instead of its image_name (e.g. a generic Python image)")
    network: str = _key("none", _text(), "docker run --network; 'none' keeps the agent off the network")
    cpus: float = _key(2.0, _number(above=0), "docker run --cpus: CPU share of one container")
    memory: str = _key("4g", _text(), "docker run --memory: memory limit of one container")
    pids_limit: int = _key(512, _integer(16), "docker run --pids-limit: processes one container may hold")
    workdir: str = _key("/testbed", _text(), "the repository's folder inside the image (SWE-smith images: /testbed)")
    env_setup: str = _key(SWE_SMITH_ENV_SETUP, _text(empty=True),
                          "shell run before every command (SWE-smith images: activate the testbed conda env)")
    start_timeout_s: float = _key(600.0, _number(above=0), "seconds docker run (and an image pull) may take")
    user: str = _key("1000:1000", _unprivileged, "uid:gid the agent's commands run as (never 0: the container "
                     "holds no capability and the repository volume is handed to this uid)")
    tmp_size: str = _key("512m", _text(), "size of the container's /tmp tmpfs (also $HOME); its root is read-only")
    nofile: int = _key(1024, _integer(64), "docker run --ulimit nofile: open files per process")


@dataclass
class SWEConfig(_Section, va.base_config_cls()):
    """The ``swe`` section; ``from_verl(config)`` is the one way in from a run's config."""

    PREFIX: ClassVar[str] = "swe"

    sandbox: str = _key("local", _choice(*SANDBOXES), "local: a subprocess sandbox on a temporary copy of the "
                        "repository (swe.repos_dir); docker: one container per trajectory from the instance's image")
    max_turns: int = _key(30, _integer(1), "assistant turns a trajectory may take (each may call one tool)")
    max_context: int | None = _key(None, _optional(_integer(2), "rollout.prompt_length + rollout.response_length"),
                                   "tokens of prompt + response the model may see; the loop stops before exceeding it")
    tool_timeout_s: float = _key(60.0, _number(above=0), "seconds one bash command may run before it is killed")
    verifier_timeout_s: float = _key(300.0, _number(above=0),
                                     "seconds the FAIL_TO_PASS/PASS_TO_PASS run may take; past it the reward is 0")
    max_observation_chars: int = _key(4000, _integer(64), "characters of a tool's output the model sees (the rest is cut)")
    repos_dir: str | None = _key(None, _optional(_path, "a repos/ folder next to the first data.train_files"),
                                 "local sandbox: the folder holding each instance's clean repository under its repo name")
    local_mem_mb: int = _key(2048, _integer(64), "local sandbox: address-space limit of each process (MiB); with a "
                             "cgroup also the memory of the whole workspace")
    local_cpu_s: int = _key(300, _integer(1), "local sandbox: CPU-seconds limit of each command's processes")
    local_disk_mb: int = _key(1024, _integer(16), "local sandbox: size of the workspace's tmpfs (MiB): the repository "
                              "copy and everything the agent writes in it")
    local_tmp_mb: int = _key(256, _integer(1), "local sandbox: size of each command's private /tmp (MiB)")
    local_max_procs: int = _key(256, _integer(8), "local sandbox: processes one workspace may hold at once")
    allow_weak_sandbox: bool = _key(False, _boolean, "local sandbox: where the kernel sandbox cannot run (no root, "
                                    "namespaces forbidden), run commands in the weaker one (the trainer's user and "
                                    "filesystem) instead of failing")
    test_command: str = _key(DEFAULT_TEST_COMMAND, _text(), "pytest command the verifier runs; the node ids are appended "
                             "(keep -rA: the verifier reads its PASSED/FAILED lines)")
    trace_path: str | None = _key(None, _optional(_path, "no trace"), "JSONL file: one line per finished trajectory")
    docker: DockerConfig = _key(None, _section(DockerConfig), "the docker backend", factory=DockerConfig)

    @classmethod
    def from_verl(cls, config: Any) -> "SWEConfig":
        """The ``swe`` section of a run's config (OmegaConf or plain mapping), typed; absent gives the defaults."""
        return section_of(config, cls, "swe", "it holds the SWE agent loop's settings")
