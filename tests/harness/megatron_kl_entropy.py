"""GRPO with verl's KL loss and entropy bonus on verl's MEGATRON engine: config and worker groups.

Why:
1. The streamed step with ``actor.use_kl_loss`` / ``actor.entropy_coeff`` is engine-independent
   on the learner side: the chunk's loss (``stream_loss.stream_policy_loss``) reads the log-probs
   and verl's ``calculate_entropy`` output of the engine's forward, and the reference log-probs
   ride in the chunk. What differs on Megatron is the setup: the Megatron config
   (``megatron_engine.megatron_config``) plus the same KL/entropy keys as the FSDP2 harness
   (``kl_entropy_steps``), and a reference worker group with the actor's TP x PP x DP layout
   (verl's ``ref.megatron`` inherits it) in fp32, as the actor runs here.
2. The step is ``kl_entropy_steps.kl_spec`` run by ``engine_steps.sync_step`` / ``stream_step``: verl's
   ``update_actor`` on the Megatron engine against the streamed step, same trajectories.
3. The reference is ``kl_entropy_steps.build_reference`` applied to the Megatron model (vocabulary
   padded for TP): start policy plus seeded noise, so the KL term pulls from the first step on.
"""

from __future__ import annotations

from pathlib import Path

from thundersync_harness import kl_entropy_steps as kle
from thundersync_harness.megatron_engine import megatron_config

ACTOR, REF = kle.ACTOR, kle.REF


def megatron_kl_entropy_config(model_path: Path, *, groups: int, micro: int, tp: int = 1, pp: int = 1,
                               kl_type: str | None, entropy: bool, loss_agg_mode: str = "token-mean",
                               distributed_optimizer: bool = False):
    """``megatron_config`` plus verl's KL loss / entropy bonus keys and a reference in the actor's precision."""
    from omegaconf import OmegaConf

    config = megatron_config(model_path, groups=groups, micro=micro, tp=tp, pp=pp, loss_agg_mode=loss_agg_mode,
                             distributed_optimizer=distributed_optimizer)
    dtype = config.actor_rollout_ref.actor.megatron.dtype
    changes = {
        f"{ACTOR}.use_kl_loss": kl_type is not None, f"{ACTOR}.kl_loss_type": kl_type or "low_var_kl",
        f"{ACTOR}.kl_loss_coef": kle.KL_COEF if kl_type else 0.0,
        f"{ACTOR}.entropy_coeff": kle.ENTROPY_COEF if entropy else 0.0,
        f"{REF}.log_prob_micro_batch_size_per_gpu": micro,
        f"{REF}.megatron.dtype": dtype,  # verl's default is bf16; the CPU actor runs fp32
        f"{REF}.megatron.sequence_parallel": tp > 1,
    }
    if loss_agg_mode == "seq-mean-token-sum-norm":
        changes[f"{ACTOR}.loss_scale_factor"] = kle.LOSS_SCALE_FACTOR
    for key, value in changes.items():
        OmegaConf.update(config, key, value, force_add=True)
    return config


def start_megatron_kl_workers(config, world: int, ref_path: Path | None):
    """``(actor group, reference group or None)``, one worker per TP x PP x DP rank in each.

    ``kl_entropy_steps.start_kl_workers`` with ``world`` workers per group: verl's reference worker
    (role ref) builds its Megatron model with ``ref.megatron``, which inherits the actor's layout.
    """
    return kle.start_kl_workers(config, world, ref_path)

