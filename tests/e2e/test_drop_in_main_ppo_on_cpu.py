"""The drop-in swap: verl's example GRPO config shapes, ``mode=sync`` vs ``mode=thundersync``, one step, same data.

verl's GRPO examples train with several mini-batches per batch, the KL loss on and (often) an entropy
bonus; rloo and reinforce_plus_plus are their other estimators. Each shape runs through stock
``python -m verl.trainer.main_ppo`` on the CPU recipe in both modes on one replayed recording.

- One step per batch (reinforce_plus_plus + KL + entropy): the learner's first weight push is compared.
  Sync runs in verl's bypass mode (the rollout's log-probs are the old ones, as ThunderSync's fused
  forward takes them). The floor is the largest gap among three Sync runs at micro-batch sizes 16, 8
  and 2 (the same update summed in other pieces; a streamed step sums in pieces of one to a few
  trajectories). Every pair counts: verl's batch order follows TransferQueue arrival, so each Sync run
  also sums in its own order (measured against micro 16 alone the floor moved from 1.9e-6 to 3.2e-5
  between runs). Runs so far gave gap/floor 0.78, 1.35, 2.24 and 2.77 (the last: gap 4.5e-5, floor
  1.6e-5 over all pairs; k1's streamed KL term rounds differently from verl's, as
  ``benchmarks/equivalence.py --kl --kl-type k1`` shows on the engine). A wrong coefficient moves the
  update by 1e-3 or more; the test asks ThunderSync to sit within 4x the floor or below 1e-4
  (``main_ppo_runs.within_floor``: a later run drew a floor of 1.45e-6 against a gap of 7.5e-6, 5.2x, where
  another run of the same test gave 3.3e-6 against 6.0e-6), and the <= 2 figure stays the engine
  benchmark's, where both sides sum in a fixed order.
- Several mini-batches (rloo + KL + entropy, 2 mini-batches): both modes take two optimizer steps on the
  same trajectories, but their partitions differ (verl's follows its batch order, which follows arrival
  in the TransferQueue and changes from run to run; ThunderSync's is the order groups complete), so the
  updates are not comparable here: measured Sync against Sync at another micro-batch size they differ by
  ~1.2x the update itself. The same-partition comparison is ``benchmarks/equivalence.py --mini-batches K
  --kl --entropy`` on the engine; this test checks the swap runs: two steps, staleness 0, the same rewards.
Slow: seven ``main_ppo`` launches (about 10 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import main_ppo_runs as runs

pytestmark = pytest.mark.slow
ACTOR = "actor_rollout_ref.actor"
BYPASS = "algorithm.rollout_correction.bypass_mode=true"
MICRO = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
TERMS = [f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_coef=0.1", f"{ACTOR}.entropy_coeff=0.01",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]  # coefficients raised: each term moves one step
ONE_STEP = ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=1.0", f"{ACTOR}.kl_loss_type=k1", *TERMS]
MINI_BATCHES = ["algorithm.adv_estimator=rloo", f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.kl_loss_type=low_var_kl",
                *TERMS]


@pytest.fixture(scope="module")
def recording(tmp_path_factory, tiny_random_lm):
    work = tmp_path_factory.mktemp("drop_in")
    return work, runs.record(work, tiny_random_lm, steps=1)


@pytest.mark.timeout(1800)
def test_one_step_shape_thundersync_update_equals_sync_within_the_floor(recording, tiny_random_lm):
    work, rec = recording
    rows_a, w_a = runs.replayed(work, tiny_random_lm, rec, "one_sync_a", "sync", ONE_STEP + [BYPASS, f"{MICRO}=16"])
    others = [runs.replayed(work, tiny_random_lm, rec, f"one_sync_micro{m}", "sync", ONE_STEP + [BYPASS, f"{MICRO}={m}"])[1]
              for m in (8, 2)]
    rows_t, w_t = runs.replayed(work, tiny_random_lm, rec, "one_thundersync", "thundersync", ONE_STEP)
    start, a, t = runs.start_weights(tiny_random_lm), runs.pushed(w_a, 1), runs.pushed(w_t, 1)
    moved = runs.distance(a, start)
    syncs = [a] + [runs.pushed(w, 1) for w in others]  # micro 16, 8, 2: equally valid sums, each in verl's arrival order
    floors = [runs.distance(x, y) / moved for i, x in enumerate(syncs) for y in syncs[i + 1:]]
    floor, gap = max(floors), runs.distance(t, a) / moved  # floor: the spread of the Sync runs among themselves
    print(f"reinforce_plus_plus + k1 + entropy: update {moved:.3e}, floor {floor:.3e} (16-8, 16-2, 8-2: "
          f"{', '.join(f'{f:.3e}' for f in floors)}), gap {gap:.3e}, gap/floor {gap / max(floor, 1e-12):.2f}")
    assert moved > 1e-3 and floor < 1e-3  # a real update; the floor is rounding, not another step
    assert runs.within_floor(gap, floor), (gap, floor)
    assert rows_t[0]["critic/score/mean"] == rows_a[0]["critic/score/mean"]  # the same replayed trajectories
    assert rows_t[0]["training/off_policy/trajectory_staleness/max"] == 0


@pytest.mark.timeout(1200)
def test_mini_batch_shape_swaps_in_with_two_steps_and_zero_staleness(recording, tiny_random_lm):
    work, rec = recording
    rows_s, w_s = runs.replayed(work, tiny_random_lm, rec, "mb_sync", "sync", MINI_BATCHES + [BYPASS])
    rows_t, w_t = runs.replayed(work, tiny_random_lm, rec, "mb_thundersync", "thundersync", MINI_BATCHES)
    assert rows_t[0]["thundersync/optimizer_steps"] == 2 and rows_t[0]["thundersync/minibatch_policy_lag/max"] == 1
    assert rows_t[0]["training/off_policy/trajectory_staleness/max"] == 0
    assert rows_t[0]["critic/score/mean"] == rows_s[0]["critic/score/mean"]
    start = runs.start_weights(tiny_random_lm)
    assert runs.distance(runs.pushed(w_t, 1), start) > 1e-3 and runs.distance(runs.pushed(w_s, 1), start) > 1e-3
