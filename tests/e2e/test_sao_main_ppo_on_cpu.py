"""SAO through stock ``python -m verl.trainer.main_ppo`` in ThunderSync mode: the same update as verl's Sync.

1. One recording (``replay`` backend, the ``sao`` recipe: one rollout per prompt) is replayed by every run,
   so Sync and ThunderSync train on identical trajectories and rewards; every run's critic starts from the
   same value-model checkpoint (``models/value_model.py``: verl would draw the value head anew per run).
2. Step 1 is a critic warm-up (``trainer.critic_warmup=2``): in both modes the actor does not move (the
   pushed weights of version 1 are the start weights, bit for bit); verl's critic is updated.
3. Steps 2 and 3 stream: the critic values each trajectory on arrival, its GAE and whitening rows are
   backpropagated at once and so is its critic row (c_t = V_t - G_t); the fold and one optimizer step close
   the actor's batch, then the critic's streamed first epoch steps and verl runs its second
   (``critic.ppo_epochs=2``). Step 3's values come from that critic, so step 3's actor update checks the
   streamed critic end to end. Each update equals Sync's within 4x the spread of verl's own Sync runs at
   micro-batch 8, 4 and 2 (the largest of the three pairwise gaps), or below rounding's measured range (the
   drop-in test's rule, ``within_floor``), at staleness 0, with verl's critic metrics reported. One pair is
   not enough: a CI run with the 8-vs-2 pair alone drew a floor of 4.4e-5 against a gap of 2.2e-4 at step 2,
   where runs here give 3e-6 and 1.3e-5; the spread of three runs is the steadier yardstick.
4. The actor steps with SGD at lr 1 (``runs.linear_sgd``), not the recipe's AdamW: Adam's first step moves a weight
   by lr x g / (|g| + 1e-8), which multiplies a rounding-sized difference in a gradient near 1e-8 by up to
   lr / 4e-8 = 5e3. With AdamW the gap was dominated by a few dozen such weights (differences of 1e-7 to 3e-7 in
   updates of 2e-4 each) and went from 7e-6 here to 1.2e-4 (10x its floor) in a CI run. SGD's update is the
   gradient times lr, so the gap measures the gradients: 4.5e-7 against a floor of 1.8e-7 at step 2 and 8.9e-7
   against 4.0e-7 at step 3 (updates of norm 0.86 and 0.79, the gradient's own, below verl's clip at 1).
"""

from __future__ import annotations

import pytest

from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.models.value_model import write_value_model

pytestmark = pytest.mark.slow
ACTOR = "actor_rollout_ref.actor"
# The actor's optimizer is SGD (point 4): its update is linear in the gradient.
BASE = ["trainer.critic_warmup=2", "critic.ppo_epochs=2", "data.max_response_length=64", *runs.linear_sgd(1.0)]


@pytest.mark.timeout(1800)
def test_thundersync_sao_update_equals_sync_within_the_floor_after_a_critic_warmup(tmp_path, tiny_random_lm):
    critic = write_value_model(tiny_random_lm, tmp_path / "critic_init")
    SAO = BASE + [f"critic.model.path={critic}"]
    rec = runs.record(tmp_path, tiny_random_lm, steps=3, recipe="sao", extra=SAO)
    rows_a, w_a = runs.replayed(tmp_path, tiny_random_lm, rec, "sao_sync8", "sync", SAO, steps=3, recipe="sao")
    others = [runs.replayed(tmp_path, tiny_random_lm, rec, f"sao_sync{m}", "sync",
                            SAO + [f"{ACTOR}.ppo_micro_batch_size_per_gpu={m}"], steps=3, recipe="sao")[1] for m in (4, 2)]
    rows_t, w_t = runs.replayed(tmp_path, tiny_random_lm, rec, "sao_thundersync", "thundersync", SAO, steps=3,
                                recipe="sao")
    start = runs.start_weights(tiny_random_lm)
    for w in (w_a, w_t):  # the warm-up step trains the critic only
        assert runs.distance(runs.pushed(w, 1), start) == 0.0
    assert rows_t[0].get("thundersync/chunks", 0) == 0 and "critic/vf_loss" in rows_t[0]
    for version in (2, 3):
        a, t = runs.pushed(w_a, version), runs.pushed(w_t, version)
        moved = runs.distance(a, runs.pushed(w_a, version - 1))
        syncs = [a] + [runs.pushed(w, version) for w in others]
        floors = [runs.distance(x, y) / moved for i, x in enumerate(syncs) for y in syncs[i + 1:]]
        floor, gap = max(floors), runs.distance(t, a) / moved
        print(f"SAO step {version}: update {moved:.3e}, floor {floor:.3e} ({', '.join(f'{f:.3e}' for f in floors)}), "
              f"gap {gap:.3e}, gap/floor {gap / max(floor, 1e-12):.2f}")
        assert moved > 1e-3 and floor < 1e-3  # a real update; the floor is rounding
        assert runs.within_floor(gap, floor), (version, gap, floor)
    for step in rows_t[1:]:
        assert step["training/off_policy/trajectory_staleness/max"] == 0
        assert step["thundersync/chunks"] >= 2 and step["thundersync/critic_chunks"] >= 1  # actor and critic rows
        assert 0.0 <= step["actor/sao_masked_frac"] < 1.0 and "critic/vf_loss" in step
    assert [r["critic/score/mean"] for r in rows_t] == [r["critic/score/mean"] for r in rows_a]  # the same trajectories
    # the recording's log-probs are those of the start weights, which step 2 still has (the warm-up moved no weight)
    assert rows_t[1]["training/rollout_logprob_diff_max"] < 1e-4
