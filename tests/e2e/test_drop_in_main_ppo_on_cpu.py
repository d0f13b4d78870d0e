"""The drop-in swap: verl's example GRPO config shapes, ``mode=sync`` vs ``mode=thundersync``, one step, same data.

verl's GRPO examples train with several mini-batches per batch, the KL loss on and (often) an entropy
bonus; rloo and reinforce_plus_plus are their other estimators. Here each shape runs through stock
``python -m verl.trainer.main_ppo`` on the CPU recipe twice in Sync and once in ThunderSync, all on one
replayed recording, and the learner's first weight push is compared:
- Sync runs in verl's bypass mode (the rollout's log-probs are the old ones, as ThunderSync's fused
  forward takes them), so both modes see the same old log-probs;
- the floor is the largest gap between Sync's update and Sync's own with another micro-batch size (8 or 2
  rows instead of 16: the same update summed in other pieces; a streamed step sums in pieces of one to a
  few trajectories, so the 2-row run is the nearer summation order);
- ThunderSync's update must sit within 2x that floor of Sync's, and the update must be far larger.
Slow: nine ``main_ppo`` launches (about 15 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import main_ppo_runs as runs

pytestmark = pytest.mark.slow
ACTOR = "actor_rollout_ref.actor"
BYPASS = "algorithm.rollout_correction.bypass_mode=true"
SHAPES = {  # verl's example shapes (coefficients raised so each term moves a tiny model's one step)
    "rloo_2_minibatches_kl_entropy": ["algorithm.adv_estimator=rloo", f"{ACTOR}.ppo_mini_batch_size=4",
                                      f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=low_var_kl",
                                      f"{ACTOR}.kl_loss_coef=0.1", f"{ACTOR}.entropy_coeff=0.01"],
    "reinforce_plus_plus_kl_entropy": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=1.0",
                                       f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_type=k1",
                                       f"{ACTOR}.kl_loss_coef=0.1", f"{ACTOR}.entropy_coeff=0.01"],
}
COMMON = ["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
MICRO = f"{ACTOR}.ppo_micro_batch_size_per_gpu"


@pytest.fixture(scope="module")
def recording(tmp_path_factory, tiny_random_lm):
    work = tmp_path_factory.mktemp("drop_in")
    return work, runs.record(work, tiny_random_lm, steps=1)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_thundersync_update_equals_sync_within_the_floor(recording, tiny_random_lm, shape):
    work, rec = recording
    extra = COMMON + SHAPES[shape]
    rows_a, w_a = runs.replayed(work, tiny_random_lm, rec, f"{shape}_sync_a", "sync", extra + [BYPASS, f"{MICRO}=16"])
    others = [runs.replayed(work, tiny_random_lm, rec, f"{shape}_sync_micro{m}", "sync", extra + [BYPASS, f"{MICRO}={m}"])[1]
              for m in (8, 2)]
    rows_t, w_t = runs.replayed(work, tiny_random_lm, rec, f"{shape}_thundersync", "thundersync", extra)
    start, a, t = runs.start_weights(tiny_random_lm), runs.pushed(w_a, 1), runs.pushed(w_t, 1)
    moved = runs.distance(a, start)
    floors = [runs.distance(runs.pushed(w, 1), a) / moved for w in others]
    floor, gap = max(floors), runs.distance(t, a) / moved
    print(f"{shape}: update {moved:.3e}, floor {floor:.3e} (micro 8: {floors[0]:.3e}, micro 2: {floors[1]:.3e}), "
          f"gap {gap:.3e}, gap/floor {gap / max(floor, 1e-12):.2f}")
    assert moved > 1e-3
    assert gap <= 2 * max(floor, 1e-7), (gap, floor)
    assert rows_t[0]["critic/score/mean"] == rows_a[0]["critic/score/mean"]  # the same replayed trajectories
    assert rows_t[0]["training/off_policy/trajectory_staleness/max"] == 0
    if "minibatches" in shape:
        assert rows_t[0]["thundersync/optimizer_steps"] == 2
