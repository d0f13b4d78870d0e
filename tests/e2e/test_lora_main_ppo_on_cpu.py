"""LoRA through stock ``python -m verl.trainer.main_ppo`` in thundersync mode: the adapter streams and reaches the
rollout every step.

One ThunderSync run with ``model.lora_rank=8`` and verl's packing and token-budgeted micro-batches
(``use_remove_padding``, ``use_dynamic_bsz``) replays the shared recording (``main_ppo_runs.shared_recording``,
made by verl's Sync), two steps. The replay server keeps every push as the model it would serve (the checkpoint
with the pushed adapter merged, ``backends/replay/server.py`` point 5), so the push after each step shows the
trained adapter arrived: the adapted linear weights moved, the rest did not, and step 2's push is not step 1's.
Staleness is verl's own ``training/off_policy/trajectory_staleness`` (rollout weight versions); the rewards are the
recording's, the ones verl's Sync scored. Rollout-vs-learner log-probs with the adapter (``hf_cpu``) are measured by
``benchmarks/equivalence.py --lora-rank 8`` (``rollout_adapter_staleness``).
"""

from __future__ import annotations

import json

import pytest

from thundersync_harness import main_ppo_runs as runs

pytestmark = pytest.mark.slow  # one main_ppo launch (about 70 s on 2 cores) and the shared recording
LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=1024"]
ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_BYTES = 4 * 8192  # rank 8 on the tiny model's 14 linear modules: one bucket holds the adapter, fp32


def recorded_sync_rows(recording) -> list[dict]:
    """The step metrics of the Sync run that made ``recording`` (``main_ppo_runs.record``: run folder ``record``)."""
    lines = (recording.parent / "record" / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return [r["data"] if "data" in r else r for r in rows if "timing_s/step" in r.get("data", r)]


@pytest.mark.timeout(900)
def test_thundersync_lora_streams_the_adapter_to_the_rollout_every_step(tmp_path, tmp_path_factory, tiny_random_lm):
    rec = runs.shared_recording(tmp_path_factory, tiny_random_lm, steps=2)
    rows, weights = runs.replayed(tmp_path, tiny_random_lm, rec, "lora", "thundersync", LORA, steps=2)
    sync = recorded_sync_rows(rec)
    assert len(rows) == 2 and len(sync) >= 2
    for step, (row, sync_row) in enumerate(zip(rows, sync), start=1):
        assert row["training/off_policy/trajectory_staleness/max"] == 0, step
        assert row["critic/score/mean"] == sync_row["critic/score/mean"], step  # the same replayed trajectories
        assert row["thundersync/chunks"] >= 1
        assert row["thundersync/peak_bucket_bytes"] % ADAPTER_BYTES == 0  # buckets of the adapter's size
    assert max(row["thundersync/peak_bucket_bytes"] for row in rows) > 0
    start = runs.start_weights(tiny_random_lm)
    served = [runs.pushed(weights, version) for version in (1, 2)]
    for kept in served:
        assert kept.keys() == start.keys()  # the served model, every tensor of the checkpoint
        for name, value in kept.items():
            moved = float((value.double() - start[name].double()).abs().max())
            if any(f".{m}." in name for m in ADAPTED) and name.endswith(".weight"):
                assert moved > 0, name  # the trained adapter, merged
            else:
                assert moved == 0, name  # embeddings, norms and biases are not adapted
    assert runs.distance(served[1], served[0]) > 0  # step 2's adapter, not step 1's
