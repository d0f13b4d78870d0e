"""SAO through stock ``python -m verl.trainer.main_ppo`` in ThunderSync mode: the same update as verl's Sync.

1. One recording (``replay`` backend, the ``sao`` recipe: one rollout per prompt) is replayed by every run,
   so Sync and ThunderSync train on identical trajectories and rewards; every run's critic starts from the
   same value-model checkpoint (``models/value_model.py``: verl would draw the value head anew per run).
2. Step 1 is a critic warm-up (``trainer.critic_warmup=2``): in both modes the actor does not move (the
   pushed weights of version 1 are the start weights, bit for bit); verl's critic is updated.
3. Step 2 streams: the critic values each trajectory on arrival, its GAE and whitening rows are
   backpropagated at once, the fold and one optimizer step close the batch. Its update equals Sync's
   within the spread of verl's own Sync runs with other micro-batches (the drop-in test's floor), at
   staleness 0, with verl's critic metrics and the band-mask share reported.
"""

from __future__ import annotations

import pytest

from thundersync_harness import main_ppo_runs as runs
from thundersync_verl.models.value_model import write_value_model

pytestmark = pytest.mark.slow
ACTOR = "actor_rollout_ref.actor"
BASE = ["trainer.critic_warmup=2", "critic.ppo_epochs=1", "data.max_response_length=64"]


@pytest.mark.timeout(1800)
def test_thundersync_sao_update_equals_sync_within_the_floor_after_a_critic_warmup(tmp_path, tiny_random_lm):
    critic = write_value_model(tiny_random_lm, tmp_path / "critic_init")
    SAO = BASE + [f"critic.model.path={critic}"]
    rec = runs.record(tmp_path, tiny_random_lm, steps=2, recipe="sao", extra=SAO)
    rows_a, w_a = runs.replayed(tmp_path, tiny_random_lm, rec, "sao_sync8", "sync", SAO, steps=2, recipe="sao")
    others = [runs.replayed(tmp_path, tiny_random_lm, rec, f"sao_sync{m}", "sync",
                            SAO + [f"{ACTOR}.ppo_micro_batch_size_per_gpu={m}"], steps=2, recipe="sao")[1] for m in (4, 2)]
    rows_t, w_t = runs.replayed(tmp_path, tiny_random_lm, rec, "sao_thundersync", "thundersync", SAO, steps=2,
                                recipe="sao")
    start = runs.start_weights(tiny_random_lm)
    for w in (w_a, w_t):  # the warm-up step trains the critic only
        assert runs.distance(runs.pushed(w, 1), start) == 0.0
    assert rows_t[0].get("thundersync/chunks", 0) == 0 and "critic/vf_loss" in rows_t[0]
    a, t = runs.pushed(w_a, 2), runs.pushed(w_t, 2)
    moved = runs.distance(a, start)
    syncs = [a] + [runs.pushed(w, 2) for w in others]
    floors = [runs.distance(x, y) / moved for i, x in enumerate(syncs) for y in syncs[i + 1:]]
    floor, gap = max(floors), runs.distance(t, a) / moved
    print(f"SAO step 2: update {moved:.3e}, floor {floor:.3e} ({', '.join(f'{f:.3e}' for f in floors)}), "
          f"gap {gap:.3e}, gap/floor {gap / max(floor, 1e-12):.2f}")
    assert moved > 1e-3 and floor < 1e-3  # a real update; the floor is rounding
    assert gap <= 4 * max(floor, 1e-7), (gap, floor)
    step2 = rows_t[1]
    assert step2["critic/score/mean"] == rows_a[1]["critic/score/mean"]  # the same replayed trajectories
    assert step2["training/off_policy/trajectory_staleness/max"] == 0
    assert step2["thundersync/chunks"] >= 2  # GAE and whitening rows
    assert step2["training/rollout_logprob_diff_max"] < 1e-4
    assert 0.0 <= step2["actor/sao_masked_frac"] < 1.0 and "critic/vf_loss" in step2
