"""ThunderSync's update against verl's Sync through stock ``python -m verl.trainer.main_ppo``: the drop-in swap.

verl's GRPO examples train with the KL loss on, often an entropy bonus, and several mini-batches per batch;
rloo and reinforce_plus_plus are their other estimators. Each shape runs in both modes on one replayed
recording (``main_ppo_runs.shared_recording``), so both train on identical trajectories and rewards.

Why the measurement looks like this:
1. SGD at lr 1e4 makes the pushed update 1e4 x the (clipped) gradient. At lr 1 a weight's update is often
   below its float32 spacing, and the gap between two runs then counts the weights whose rounding flipped,
   not how far the gradients differ (``benchmarks/emulated_rollout.py`` point 5).
2. In verl's ``token-sum`` each row's policy, KL and entropy coefficients are exact in verl's Sync (own
   old-log-prob forward, so every ratio is 1) and in ThunderSync alike. Only the order of the sums differs,
   so the update must sit within 2x the spread of verl's own Sync at micro-batch 16 vs 2 (the floor), or
   below 1e-6 (``within_sums_order``).
3. In ``token-mean`` verl rounds advantage / token count per row, and ThunderSync scales the summed gradient
   once at the barrier: the looser drop-in rule ``within_floor`` applies (4x the floor or below 1e-4).
4. A wrong coefficient, normaliser, fold or missing term moves the update by 1e-3 or more; the KL and entropy
   coefficients are raised so that each term moves the step.
5. Several mini-batches: both modes take two optimizer steps on the same trajectories, but their partitions
   differ (verl's follows its batch order, the prompts' order on the CPU platform (``verl_adapter.patches``
   point 10); ThunderSync's is the order groups complete), so those updates are not comparable here (Sync
   against Sync at another micro-batch size differ by ~1.2x the update itself). The same-partition comparison is ``benchmarks/equivalence.py
   --mini-batches K --kl --entropy`` on the engine; this test checks that the swap runs: two optimizer steps,
   staleness 0, the same rewards, with verl's reference worker group and ``low_var_kl`` + entropy in the loss (a
   streamed chunk without reference log-probs is refused, so a run that finishes has used them).
Measured (token-sum GRPO + k1 + entropy, token-mean reinforce_plus_plus + k1 + entropy): see ``docs/design.md``.
Slow: seven ``main_ppo`` launches and the shared recording (about 6 minutes on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import main_ppo_runs as runs

pytestmark = pytest.mark.slow
ACTOR = "actor_rollout_ref.actor"
BYPASS = "algorithm.rollout_correction.bypass_mode=true"
MICRO = f"{ACTOR}.ppo_micro_batch_size_per_gpu"
TERMS = [f"{ACTOR}.use_kl_loss=true", f"{ACTOR}.kl_loss_coef=0.1", f"{ACTOR}.entropy_coeff=0.01",
         "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8"]
K1 = [f"{ACTOR}.kl_loss_type=k1", *TERMS, *runs.RESOLVING_SGD]
# rollout correction's IS weights in the learner's loss: a replayed rollout's log-probs are the learner's at step 1,
# so every weight is 1 within rounding and the update stays Sync's; what runs is the wiring (the rows' rollout
# log-probs fetched into every chunk, the settings in the batch meta: a chunk without them is refused). The weights
# away from 1 are compared with verl's in tests/learner/test_rollout_correction_engine_on_cpu.py.
ROLLOUT_IS = "algorithm.rollout_correction.rollout_is=token"
# (estimator settings, loss aggregation, rule); token-sum's reference runs give the floor both rules use
SHAPES = {
    "grpo-token-sum": (["algorithm.adv_estimator=grpo", *runs.TOKEN_SUM], runs.within_sums_order),
    "rpp-token-mean": (["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.gamma=1.0", ROLLOUT_IS], runs.within_floor),
}
MINI_BATCHES = ["algorithm.adv_estimator=rloo", f"{ACTOR}.ppo_mini_batch_size=4", f"{ACTOR}.kl_loss_type=low_var_kl",
                *TERMS]


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_random_lm):
    return tmp_path_factory.mktemp("exact_update"), runs.shared_recording(tmp_path_factory, tiny_random_lm)


@pytest.fixture(scope="module")
def floor(work, tiny_random_lm):
    """verl's Sync on the token-sum shape at micro-batch 16 and 2: (its rows and update at 16, their relative gap)."""
    folder, rec = work
    token_sum = SHAPES["grpo-token-sum"][0] + K1
    rows, w_16 = runs.replayed(folder, tiny_random_lm, rec, "sync_sum16", "sync", token_sum + [f"{MICRO}=16"])
    _, w_2 = runs.replayed(folder, tiny_random_lm, rec, "sync_sum2", "sync", token_sum + [f"{MICRO}=2"])
    start = runs.start_weights(tiny_random_lm)
    a, b = runs.update(start, w_16), runs.update(start, w_2)
    return rows, a, runs.distance(a, b) / runs.norm(a)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("shape", SHAPES)
def test_thundersync_update_equals_sync_within_the_floor(shape, work, floor, tiny_random_lm):
    folder, rec = work
    settings, rule = SHAPES[shape]
    sync_rows, sync, floor_gap = floor
    if shape != "grpo-token-sum":  # token-sum's Sync is the floor's micro-16 run; others run their own (bypass mode)
        sync_rows, w_s = runs.replayed(folder, tiny_random_lm, rec, f"sync_{shape}", "sync",
                                       settings + K1 + [BYPASS, f"{MICRO}=16"])
        sync = runs.update(runs.start_weights(tiny_random_lm), w_s)
    rows, w_t = runs.replayed(folder, tiny_random_lm, rec, f"thundersync_{shape}", "thundersync", settings + K1)
    ts = runs.update(runs.start_weights(tiny_random_lm), w_t)
    moved = runs.norm(sync)
    gap = runs.distance(ts, sync) / moved
    print(f"{shape} + k1 + entropy at lr 1e4: update {moved:.3e}, floor (Sync micro 16 vs 2) {floor_gap:.3e}, "
          f"gap {gap:.3e}, gap/floor {gap / max(floor_gap, 1e-12):.2f}")
    assert moved > 1.0  # a real step: lr 1e4 times a clipped gradient
    assert rule(gap, floor_gap), (gap, floor_gap)
    assert rows[0]["critic/score/mean"] == sync_rows[0]["critic/score/mean"]  # the same replayed trajectories
    assert rows[0]["training/off_policy/trajectory_staleness/max"] == 0


@pytest.mark.timeout(1200)
def test_mini_batch_shape_swaps_in_with_two_steps_and_zero_staleness(work, tiny_random_lm):
    folder, rec = work
    rows_s, w_s = runs.replayed(folder, tiny_random_lm, rec, "mb_sync", "sync", MINI_BATCHES + [BYPASS])
    rows_t, w_t = runs.replayed(folder, tiny_random_lm, rec, "mb_thundersync", "thundersync", MINI_BATCHES)
    assert rows_t[0]["thundersync/optimizer_steps"] == 2 and rows_t[0]["thundersync/minibatch_policy_lag/max"] == 1
    assert rows_t[0]["training/off_policy/trajectory_staleness/max"] == 0
    assert rows_t[0]["critic/score/mean"] == rows_s[0]["critic/score/mean"]
    start = runs.start_weights(tiny_random_lm)
    assert runs.distance(runs.pushed(w_t, 1), start) > 1e-3 and runs.distance(runs.pushed(w_s, 1), start) > 1e-3
