"""The trainer side of tail batching (``step/tail_rounds.py``) on verl's own batches, without Ray: each round's
prompts, the queue and the leftovers across many rounds, the TransferQueue sweep and a resume of the queue."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from thundersync_verl.config import TailConfig
from thundersync_verl.step.tail_rounds import TailRounds

P = 4


class Dataloader:
    """verl's batches of ``P`` prompts (``_next_train_batch``'s TensorDicts), dataset indices 0, 1, 2, ..."""

    def __init__(self):
        self.next = 0

    def rows(self, indices: list[int]):
        from verl.utils import tensordict_utils as tu

        batch = tu.get_tensordict({"input_ids": torch.tensor([[i, i + 1] for i in indices]),
                                   "index": np.array(indices, dtype=object),
                                   "uid": np.array([f"draw{i}" for i in indices], dtype=object)})
        tu.assign_non_tensor_data(batch, "global_steps", -1)
        return batch

    def __call__(self):
        self.next += P
        return self.rows(list(range(self.next - P, self.next)))


class RecordingTQ:
    """``kv_list`` / ``kv_clear`` of the TransferQueue: what aborted groups left there."""

    def __init__(self):
        self.records: dict[str, dict] = {}

    def kv_list(self, partition):
        return {partition: dict(self.records)}

    def kv_clear(self, keys, partition_id):
        for key in keys:
            self.records.pop(key)


def _indices(batch) -> list[int]:
    return [int(x[0]) for x in batch["input_ids"].tolist()]


@pytest.mark.parametrize("rounds", ["dedicated", "mixed"])
def test_every_drawn_prompt_is_trained_once_or_still_waiting_and_a_resume_keeps_the_queue(rounds):
    from verl.utils import tensordict_utils as tu

    rng, draw = random.Random(0), Dataloader()
    tail = TailRounds(TailConfig(eta=1.5, max_deferrals=1, rounds=rounds), P)
    trained, tq = [], RecordingTQ()
    for step in range(1, 25):
        batch, round_ = tail.next_round(draw, step)
        uids = [str(u) for u in batch["uid"]]
        assert len(set(uids)) == len(uids) and round_.pinned == uids[:len(round_.pinned)]
        assert tu.get(batch, "global_steps") == step  # stamped as verl's _next_train_batch stamps it
        order = list(round_.pinned) + rng.sample([u for u in uids if u not in round_.pinned],
                                                 len(uids) - len(round_.pinned))
        kept = order[:P]  # the pinned groups and the first free groups to complete
        dropped = [u for u in uids if u not in kept]
        for uid in dropped:  # an aborted group left a trajectory and its prompt record (its loops ended)
            tq.records[f"{uid}_0_0"] = {"status": "success"}
            tq.records[uid] = {"status": "failure"}
        tail.abort(dropped)
        index = dict(zip(uids, _indices(batch)))
        figures = tail.settle({u: f"{i:08d}" for i, u in enumerate(kept)}, dropped, step, tq)
        trained += [index[u] for u in kept]
        assert figures["thundersync/tail/kept"] == P and figures["thundersync/tail/dropped"] == len(dropped)
        assert tq.records == {} and tail.to_clear == set()  # swept, and forgotten once their loops ended
        if step == 12:  # a resume: the queue and leftovers come back, their rows read again by dataset index
            state = json.loads(json.dumps(tail.state_dict()))
            tail = TailRounds(TailConfig(eta=1.5, max_deferrals=1, rounds=rounds), P)
            tail.load_state_dict(state, lambda idx: [draw.rows([i]) for i in idx])
    waiting = [tail.index_of[e.prompt] for e in tail.queue.items] + [tail.index_of[k] for k in tail.leftover]
    assert sorted(trained + waiting) == list(range(draw.next))  # none lost, none trained twice
    assert len(trained) == 24 * P


def test_a_round_of_pinned_prompts_alone_and_the_figures_it_reports():
    draw = Dataloader()
    tail = TailRounds(TailConfig(eta=2.0, max_deferrals=0, rounds="dedicated"), P)  # K=0: a queued prompt is pinned
    batch, round_ = tail.next_round(draw, 1)
    uids = [str(u) for u in batch["uid"]]
    assert len(uids) == 2 * P and round_.pinned == [] and _indices(batch) == list(range(8))
    tail.settle({u: "" for u in uids[:P]}, uids[P:], 1)
    batch, round_ = tail.next_round(draw, 2)
    assert _indices(batch) == [4, 5, 6, 7] and len(round_.pinned) == P  # the queue alone, every prompt pinned
    figures = tail.settle({str(u): "" for u in batch["uid"]}, [], 2)
    assert figures["thundersync/tail/deferred_kept_share"] == 1.0 and figures["thundersync/tail/delay_steps_max"] == 1
