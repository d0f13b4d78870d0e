"""Stream chunks are padded to the data-parallel size of verl's actor mesh, not to the worker count.

Under Megatron, the tensor/pipeline-parallel peers of one data-parallel rank receive the same rows
(verl's ``make_nd_compute_dataproto_dispatch_fn("actor")`` cuts a batch into max(dp rank) + 1 parts).
Padding to the worker count added zero-weight rows to every chunk under TP/PP. These tests cut the chunk
``stream_exec`` builds with verl's own splitter, for a group whose workers report a TP2 x DP2 layout, and
hand each worker its part as verl's dispatch does (``arg[dp_rank_mapping[i]]``; the rest of verl's dispatch
only puts the parts in Ray's object store). The streaming calls' own dispatch (``va.actor_mesh_dispatch``) hands
the workers the same rows, without verl's split: one data-parallel part is the chunk itself, several are built part
by part on the driver (``chunk_layout.build_stream_parts``) and sent as built, with one put per part that peers
share. No processes, no GPU.
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.step import stream_exec
from thundersync_verl.step.chunk_layout import COEF_KEY, on_arrival
from thundersync_verl.step.stream_plan import BackwardOp

ROWS = {f"t{i}": {"prompt": [11, 12 + i], "response": [20 + i] * (2 + i), "mask": [1] * (2 + i)} for i in range(5)}


def _group(dp_ranks: list[int]):
    """verl's ``WorkerGroup`` whose workers report these actor-mesh data-parallel ranks."""
    from verl.single_controller.base.worker_group import WorkerGroup

    class LayoutGroup(WorkerGroup):
        def __init__(self):
            super().__init__(resource_pool=None)
            self._workers = [None] * len(dp_ranks)
            self.queries = 0

        def _query_dispatch_info(self, mesh_name: str):
            assert mesh_name == "actor"
            self.queries += 1
            return list(dp_ranks)

    return LayoutGroup()


def _op(n_rows: int) -> BackwardOp:
    return BackwardOp(tuple((0, f"t{i}") for i in range(n_rows)), tuple(0.5 + i for i in range(n_rows)), "direct",
                      tuple(len(ROWS[f"t{i}"]["response"]) for i in range(n_rows)))


def _chunk(group, n_rows: int):
    """What ``stream_exec`` sends: one chunk, or with several data-parallel ranks one part per rank."""
    method, (chunk,) = stream_exec._request(group, _op(n_rows), ROWS, pad_token_id=0, temperature=1.0, queued=False)
    assert method == "stream_backward"
    return chunk


def _whole_split(group, n_rows: int) -> list:
    """verl's split of the whole padded chunk into the group's data-parallel parts (what verl's dispatch sends)."""
    from verl.single_controller.base.decorator import _split_args_kwargs_data_proto

    dp = va.actor_dp_size(group)
    whole = stream_exec._grpo_chunk(_op(n_rows), ROWS, dp_size=dp, pad_token_id=0, temperature=1.0)
    (split,), _ = _split_args_kwargs_data_proto(dp, whole)
    return split


@pytest.mark.parametrize("dp_ranks, want", [([0, 0, 1, 1], 2), ([0, 0, 0, 0], 1), ([0, 1, 2, 3], 4)])
def test_actor_dp_size_is_the_number_of_parts_verl_dispatches(dp_ranks, want):
    group = _group(dp_ranks)
    assert va.actor_dp_size(group) == want
    assert va.actor_dp_size(group) == want and group.queries == 1  # asked once, cached as verl caches it


@pytest.mark.parametrize("n_rows", [1, 3, 5])
def test_tp2_dp2_chunks_are_padded_to_dp_and_tp_peers_receive_the_same_rows(n_rows):
    mapping = [0, 0, 1, 1]  # workers 0, 1: TP peers of DP rank 0; workers 2, 3: of DP rank 1
    group = _group(mapping)
    parts = _chunk(group, n_rows)
    assert isinstance(parts, va.DataParallelParts) and len(parts) == 2  # one per DP rank, not per worker
    assert sum(p.batch_size[0] for p in parts) == n_rows + n_rows % 2  # a multiple of DP=2, not of the 4 workers
    coefs = [parts[mapping[worker]][COEF_KEY] for worker in range(len(mapping))]  # verl's rank -> part mapping
    assert torch.equal(coefs[0], coefs[1]) and torch.equal(coefs[2], coefs[3])  # TP peers: the same rows
    assert all(c.shape[0] == (n_rows + n_rows % 2) // 2 for c in coefs)  # every DP rank runs as many rows
    real = sorted(float(c) for c in torch.cat([coefs[0], coefs[2]]) if c != 0)
    assert real == [0.5 + i for i in range(n_rows)]  # every trajectory exactly once over the DP ranks


def test_a_layout_without_data_parallelism_adds_no_padding_row():
    chunk = _chunk(_group([0, 0]), 3)  # TP2 (or PP2) with DP=1: 3 rows stay 3, in one chunk
    assert chunk.batch_size[0] == 3 and bool((chunk[COEF_KEY] != 0).all())
    parts = _chunk(_group([0, 1]), 3)  # plain DP2: one zero-weight row, as verl needs
    assert [p.batch_size[0] for p in parts] == [2, 2] and parts[1][COEF_KEY].tolist() == [2.5, 0.0]


def test_a_group_without_verls_dispatch_query_pads_to_its_worker_count():
    class PlainGroup:  # e.g. a stand-in learner in the trainer's tests
        world_size = 3

    assert va.actor_dp_size(PlainGroup()) == 3


def test_the_streaming_dispatch_hands_one_part_over_as_it_is():
    group = _group([0])
    chunk = _chunk(group, 3)
    args, kwargs = va.actor_mesh_dispatch()["dispatch_fn"](group, chunk)
    assert kwargs == {} and len(args) == 1 and len(args[0]) == 1
    assert args[0][0] is chunk  # no split, no copy, no put: it travels inside the call


@pytest.mark.parametrize("n_rows", [1, 4])
def test_the_streaming_dispatch_gives_each_data_parallel_rank_verls_part(n_rows):
    group = _group([0, 1])
    parts = _chunk(group, n_rows)
    (args,), _ = va.actor_mesh_dispatch()["dispatch_fn"](group, parts)
    verls = _whole_split(group, n_rows)
    assert len(args) == 2 and all(a is p for a, p in zip(args, parts))  # sent as built: no split, no copy
    assert all(torch.equal(a[COEF_KEY], v[COEF_KEY]) for a, v in zip(args, verls))  # the rows verl's split gives
    for a, v in zip(args, verls):  # and the same tokens and positions, row by row, as the learner reads them
        a, v = on_arrival(a.copy()), on_arrival(v.copy())  # both travel padded (chunk_layout point 5)
        assert [r.tolist() for r in a["input_ids"].unbind()] == [r.tolist() for r in v["input_ids"].unbind()]
        assert [r.tolist() for r in a["position_ids"].unbind()] == [r.tolist() for r in v["position_ids"].unbind()]


def test_the_streaming_dispatch_puts_a_shared_part_once_for_its_tensor_parallel_peers(monkeypatch):
    import ray

    puts = []
    monkeypatch.setattr(ray, "put", lambda value: puts.append(value) or ("ref", len(puts) - 1))
    group = _group([0, 0, 1, 1])
    (args,), _ = va.actor_mesh_dispatch()["dispatch_fn"](group, _chunk(group, 3))
    assert len(puts) == 2  # one object per data-parallel part, not per worker
    assert args == [("ref", 0), ("ref", 0), ("ref", 1), ("ref", 1)]
    assert sorted(float(c) for p in puts for c in p[COEF_KEY] if c != 0) == [0.5, 1.5, 2.5]


def _row_chunk(padded: bool):
    from thundersync_verl.step.chunk_layout import build_stream_chunk

    return build_stream_chunk([[3, 4, 5], [6], [7, 8]], [[9, 10], [11, 12, 13, 14], [15]], [0.5, -1.0, 2.0], "g=1|r=1.0",
                              dp_size=2, pad_token_id=0, temperature=0.7, response_masks=[[1, 1], [1, 0, 1, 1], [1]],
                              rollout_log_probs=[[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6], [-0.7]], padded=padded)


def _token_chunk(padded: bool):  # an OPD turn chunk
    from thundersync_verl.step.chunk_layout import build_token_chunk

    return build_token_chunk([[3, 4, 5], [6]], [[9, 10, 11], [12, 13]], [[0, 1, 1], [1, 0]], dp_size=1, pad_token_id=0,
                             teacher_log_probs=[[0.0, -0.5, -0.6], [-0.2, 0.0]], temperature=0.7,
                             rollout_log_probs=[[-0.1, -0.2, -0.3], [-0.4, -0.5]], distill_loss="k3", padded=padded)


@pytest.mark.parametrize("build", [_row_chunk, _token_chunk])
def test_a_chunk_sent_padded_reaches_the_learner_in_verls_no_padding_layout(build):
    from thundersync_verl.step.chunk_layout import PADDED_KEY

    nested, padded = build(False), build(True)
    assert not padded["input_ids"].is_nested and va.non_tensor(padded, PADDED_KEY) is True
    arrived = on_arrival(padded)
    assert va.non_tensor(arrived, PADDED_KEY) is False
    assert sorted(k for k in arrived.keys() if k != PADDED_KEY) == sorted(nested.keys())
    for key in nested.keys(include_nested=False, leaves_only=True):
        a, b = arrived[key], nested[key]
        if not isinstance(b, torch.Tensor):
            continue  # non-tensor data: compared below
        if getattr(b, "is_nested", False):
            assert [x.tolist() for x in a.unbind()] == [x.tolist() for x in b.unbind()], key
        else:
            assert torch.equal(a, b), key
    for key in ("max_seq_len", "max_response_len", "temperature", "ts_dest"):
        assert va.non_tensor(arrived, key) == va.non_tensor(nested, key), key
    assert torch.equal(va.non_tensor(arrived, "indices"), va.non_tensor(nested, "indices"))
    assert on_arrival(nested) is nested  # a chunk built in the no-padding layout passes as it is
