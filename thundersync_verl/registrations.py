"""Registrations that need heavier verl modules: done when verl imports them."""

from __future__ import annotations

from thundersync_verl.verl_patches import when_imported

AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"


def _register_agent_loops(_module) -> None:
    import thundersync_verl.envs.agent_loop  # noqa: F401  (registers via verl's decorator)


def register_lazy() -> None:
    when_imported(AGENT_LOOP_MODULE, _register_agent_loops)
