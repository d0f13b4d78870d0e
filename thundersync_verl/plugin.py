"""verl plugin entry point: ``import verl`` in any process (Ray workers included) imports this.

setup.py declares it under the ``verl.plugins`` entry-point group. It registers:
1. platform ``cpu`` (and, when it is the active platform, the CPU patches);
2. rollout backends ``hf_cpu`` and ``replay`` (recorded generations, ``backends/replay/``);
3. agent loop ``thundersync_tool_agent``, the ThunderSync trainer mode and SAO's estimator and
   policy loss ``sao``, lazily (their modules import on first use by verl).
It also applies the runtime patches of ``verl_adapter/patches.py`` (every platform; the CPU ones only on the CPU
platform), among them the driver's check of this plugin's config sections before ``ray.init``.
verl swallows plugin import errors at debug level, so failures are logged loudly here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("thundersync_verl")


def register() -> None:
    from thundersync_verl import verl_adapter as va
    from thundersync_verl.backends.cpu.platform import cpu_platform_active, register_cpu_platform
    from thundersync_verl.backends.cpu.rollout import ROLLOUT_NAME

    register_cpu_platform()
    from thundersync_verl.verl_adapter.patches import (
        patch_launch_config_check,
        patch_logprob_diff_metric,
        patch_reuse_turn_teacher_scores,
        patch_reward_in_agent_loop,
        patch_sao_critic_values,
    )

    patch_logprob_diff_metric()
    patch_sao_critic_values()
    patch_reuse_turn_teacher_scores()
    patch_reward_in_agent_loop()
    patch_launch_config_check()
    if cpu_platform_active():
        from thundersync_verl.verl_adapter.patches import apply_cpu_patches

        apply_cpu_patches()

    def _load_replica():
        from thundersync_verl.backends.cpu.rollout import HFCpuReplica

        return HFCpuReplica

    va.register_rollout(ROLLOUT_NAME, _load_replica, "thundersync_verl.backends.cpu.rollout.HFCpuServerAdapter")

    def _load_replay_replica():
        from thundersync_verl.backends.replay.server import ReplayReplica

        return ReplayReplica

    va.register_rollout("replay", _load_replay_replica, "thundersync_verl.backends.replay.server.ReplayServerAdapter")
    from thundersync_verl.verl_adapter import registrations

    registrations.register_lazy()


try:
    register()
except Exception:  # pragma: no cover - surfaced loudly because verl hides plugin errors
    logger.exception("thundersync_verl plugin failed to register with verl")
    raise
