"""OPD turn streaming on verl's real FSDP2 engine (a 1-process Ray worker group on the CPU).

Needs no GPU. The worker is built with verl's ``distillation_config`` (as verl's trainer builds
it for OPD), so its own ``update_actor`` runs verl's distillation loss: the oracle. Per-turn
prefix rows streamed in a random order must give the same step as the whole trajectories
streamed as single rows, and as verl's update. Starts Ray once (~20-40 s on 2 cores).
"""

from __future__ import annotations

import pytest
import torch

from thundersync_harness.engine_setup import make_turn_trajectories, score_turns, turn_arrival
from thundersync_harness.engine_steps import OPDSpec, relative_gap, stream_step, sync_step, train
from thundersync_verl.core import StreamingInputError
from thundersync_verl.step.chunk_layout import TEACHER_KEY, build_stream_chunk, build_token_chunk

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 engine with a teacher, started once per module, then real steps
GROUPS = 2


@pytest.fixture(scope="module")
def harness(start_engine):
    engine = start_engine(groups=GROUPS, opd=True)
    trajs = make_turn_trajectories(7, GROUPS, engine.vocab)
    turns, rows, _, diff = score_turns(engine.teacher, trajs, 8)
    return {"wg": engine.wg, "pad": engine.pad_id, "trajs": trajs, "turns": turns, "rows": rows, "teacher_diff": diff}


def _whole_rows_step(h) -> dict:
    """Each trajectory as ONE row scoring all its turns: the whole-trajectory loss, streamed."""
    wg, trajs = h["wg"], h["trajs"]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    for i in range(0, len(trajs), 3):
        part = trajs[i : i + 3]
        wg.stream_token_backward(build_token_chunk([t.prompt for t in part], [t.response for t in part],
                                                   [list(t.mask) for t in part], dp_size=1, pad_token_id=h["pad"],
                                                   teacher_log_probs=[h["rows"][t.tid] for t in part]))
    return wg.finalize_step(1.0 / sum(sum(t.mask) for t in trajs))[0]


def test_per_turn_streaming_equals_the_whole_trajectory_loss_and_verls_update(harness):
    h = harness
    wg, trajs, turns = h["wg"], h["trajs"], h["turns"]
    arrival = turn_arrival(turns, 9)
    assert any(arrival.index((tid, len(ts) - 1)) < arrival.index((tid, 0)) for tid, ts in turns.items())  # out of order
    spec = OPDSpec(teacher_rows=h["rows"], turns=turns)
    [d_turns], [info] = train(wg, [lambda: stream_step(wg, trajs, arrival, h["pad"], spec)])
    [d_whole], [info_whole] = train(wg, [lambda: _whole_rows_step(h)])
    [d_verl], [info_verl] = train(wg, [lambda: sync_step(wg, trajs, list(range(len(trajs))), h["pad"], spec)])
    assert float(d_verl.norm()) > 1e-3  # verl's distillation loss moved the weights (zero task advantages)
    assert info["turns"] == sum(len(ts) for ts in turns.values()) > len(trajs)
    assert relative_gap(d_turns, d_whole) < 1e-5  # fp32: recompute-the-prefix is exact up to rounding
    assert relative_gap(d_turns, d_verl) < 1e-5
    assert info["grad_norm"] == pytest.approx(info_verl["grad_norm"], rel=1e-5)
    assert info_whole["grad_norm"] == pytest.approx(info_verl["grad_norm"], rel=1e-5)
    assert h["teacher_diff"] < 1e-5  # per-turn teacher scores vs whole-sequence scores


def test_bad_token_chunks_are_refused_and_leave_the_weights_unchanged(harness):
    wg, pad = harness["wg"], harness["pad"]
    wg.reset_actor()
    theta0 = wg.gather_flat_params()[0]
    wg.stream_begin_batch({"loss_agg_mode": "token-mean", "train_batch_size": GROUPS})
    with pytest.raises(StreamingInputError, match="per-token chunk needs"):  # a GRPO chunk sent to the token path
        wg.stream_token_backward(build_stream_chunk([[11, 12]], [[13, 14]], [1.0], "direct", dp_size=1, pad_token_id=pad))
    chunk = build_token_chunk([[11, 12]], [[13, 14]], [[1.0, 1.0]], dp_size=1, pad_token_id=pad,
                              teacher_log_probs=[[-1.0, -2.0]])
    chunk[TEACHER_KEY][0, 1] = float("nan")  # bypasses the driver-side check
    with pytest.raises(StreamingInputError, match="must be finite"):
        wg.stream_token_backward(chunk)
    assert torch.equal(wg.gather_flat_params()[0], theta0)
