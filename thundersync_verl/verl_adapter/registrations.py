"""Registrations that need heavier verl modules: done when verl imports them."""

from __future__ import annotations

from thundersync_verl.verl_adapter.patch_hooks import when_imported

AGENT_LOOP_MODULE = "verl.experimental.agent_loop.agent_loop"
CHECKPOINT_ENGINE_MODULE = "verl.checkpoint_engine.base"
TRAINER_MODULE = "verl.trainer.ppo.v1.trainer_base"
CORE_ALGOS_MODULE = "verl.trainer.ppo.core_algos"


def _register_agent_loops(_module) -> None:
    import thundersync_verl.envs.agent_loop  # noqa: F401  (registers via verl's decorator)
    import thundersync_verl.envs.swe.swe_agent_loop  # noqa: F401  (the SWE agent: thundersync_swe_agent)


def _register_checkpoint_engine(_module) -> None:
    from thundersync_verl.backends.cpu.cpu_channel import register_checkpoint_engine
    from thundersync_verl.backends.sparse_sync.sparse_engine import register_checkpoint_engine as register_sparse

    register_checkpoint_engine()
    register_sparse()  # "sparse_sync": lossless sparse pushes


def _register_trainers(_module) -> None:
    import thundersync_verl.step.thundersync_trainer  # noqa: F401  (registers trainer mode "thundersync")


def _register_sao(_module) -> None:
    from thundersync_verl.algos.sao.sao_verl import register

    register()  # estimator and policy loss "sao"


def register_lazy() -> None:
    when_imported(TRAINER_MODULE, _register_trainers)
    when_imported(CORE_ALGOS_MODULE, _register_sao)
    when_imported(AGENT_LOOP_MODULE, _register_agent_loops)
    when_imported(CHECKPOINT_ENGINE_MODULE, _register_checkpoint_engine)
