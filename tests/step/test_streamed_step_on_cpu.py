"""The one streamed step (``step/streamed_step.py``) on GRPO, without Ray.

The TransferQueue is a small in-memory stand-in whose records become visible at a given poll; the
learner records what each call received. What is under test is the real step: arrival polling, the
real ``StreamPlanner`` (buckets, folds, the deferred normaliser), the real ``OpPipeline`` and chunk
building, the timeout and the failure paths (no optimizer step on part of a batch).
"""

from __future__ import annotations

import pytest
import torch

from thundersync_verl.run.step_record import StepRecorder
from thundersync_verl.step.stream_plan import FoldOp, StreamPlanner
from thundersync_verl.step import streamed_step
from thundersync_verl.step.streamed_step import GRPOArrivals, StepContext, StreamedStep
from thundersync_verl.step.trajectory_source import TrajectoryNeverArrived
from thundersync_harness.stream_fakes import FakeLearner, FakeTQ, effective_coefficients, grpo_advantages, grpo_step


REWARDS = {"a": [1.0, 0.0, 1.0], "b": [0.0, 0.0, 1.0]}


@pytest.mark.parametrize("coalesce,budget_buckets", [(True, None), (False, None), (True, 3)])
def test_grpo_step_backpropagates_every_trajectory_once_then_steps_once(coalesce, budget_buckets):
    tq, learner = FakeTQ(), FakeLearner()
    for uid, rewards in REWARDS.items():
        for s, r in enumerate(rewards):
            tq.add(f"{uid}_{s}_0", r, visible_at=1 + 2 * s + (uid == "b"))  # the groups' members land interleaved
    step = grpo_step(tq, learner, ["a", "b"], 3, coalesce=coalesce, budget_buckets=budget_buckets)
    out, state = step.run()
    metrics = step.metrics(out)
    assert sorted(state.keys) == sorted(f"{u}_{s}_0" for u in REWARDS for s in range(3))
    # each trajectory's effective coefficient: a direct row carries A_i; a bucket row carries 1 and its
    # bucket is folded with A(r) when the group closes
    effective = effective_coefficients(learner.calls)
    folds = sum(c[0] == "fold" for c in learner.calls)
    assert folds > 0  # open groups streamed into buckets
    if budget_buckets is not None:  # room for one open group's buckets: the other group's rows waited
        assert metrics["thundersync/budget_waits"] > 0
        assert learner.meta["memory_budget_bytes"] == 4 * budget_buckets
        assert step.planner.memory()["peak_bytes"] <= 4 * (budget_buckets + 1)
    assert sorted(effective) == pytest.approx(grpo_advantages(REWARDS), abs=1e-6)  # every trajectory once, right weight
    assert learner.steps == [pytest.approx(1 / 6)]  # seq-mean-token-sum: one step, divided by the 6 sequences
    assert learner.calls[0] == ("begin", "seq-mean-token-sum")
    assert metrics["thundersync/chunks"] == 0 and metrics["actor/grad_norm"] == 1.0  # the learner's own figures
    assert metrics["thundersync/listings"] == tq.polls > 0  # every controller listing the driver made is counted
    assert state.rows["a_0_0"]["rollout_lp"] == [-0.5, -0.5, -0.5]  # fused: the chunk carries the rollout's
    assert torch.equal(tq.records["a_0_0"][1]["old_log_probs"], torch.tensor([-0.5, -0.5, -0.5]))


def test_fused_step_reads_each_arrival_once_and_writes_old_log_probs_once():
    """The TransferQueue serves the agent loops too: one read per landed trajectory (its row and its rollout
    log-probs together) and ONE write of verl's old_log_probs for the whole batch, before the optimizer step."""
    tq, learner = FakeTQ(), FakeLearner()
    for uid, rewards in REWARDS.items():
        for s, r in enumerate(rewards):
            tq.add(f"{uid}_{s}_0", r, visible_at=1 + 2 * s + (uid == "b"))
    grpo_step(tq, learner, ["a", "b"], 3, coalesce=False).run()
    row_reads = [keys for keys, fields in tq.gets if "responses" in fields]
    assert all("rollout_log_probs" in fields for _, fields in tq.gets)
    assert sorted(k for keys in row_reads for k in keys) == sorted(tq.records)  # each trajectory read once
    assert len(tq.gets) == len(row_reads) + 1  # plus the one read for the write-back
    assert tq.puts == [(list(tq.gets[-1][0]), ["old_log_probs"])] and sorted(tq.puts[0][0]) == sorted(tq.records)
    assert len(row_reads) > 1  # the batch landed over several polls, and still one write


SCHEDULES = {  # two timings of the same batch: poll at which each trajectory becomes visible
    "groups_in_order": {"a_0_0": 1, "a_1_0": 1, "a_2_0": 2, "b_0_0": 2, "b_1_0": 3, "b_2_0": 3},
    "reversed_interleaved": {"b_2_0": 1, "a_2_0": 1, "b_1_0": 2, "a_1_0": 4, "b_0_0": 6, "a_0_0": 9},
}


def _learner_calls(schedule: dict, names: dict | None = None, **kw) -> list:
    """The learner's calls for one arrival ``schedule``; ``names`` renames the prompts (verl's uids are random)."""
    names = names or {"a": "a", "b": "b"}
    tq, learner = FakeTQ(), FakeLearner()
    for key, at in schedule.items():
        uid, s, i = key.split("_")
        tq.add(f"{names[uid]}_{s}_{i}", REWARDS[uid][int(s)], visible_at=at)
    grpo_step(tq, learner, [names["a"], names["b"]], 3, **kw).run()
    return learner.calls + [("step", learner.steps)]


@pytest.mark.parametrize("budget_buckets", [None, 3])
def test_deterministic_step_sends_the_same_chunks_and_folds_whatever_the_timing(budget_buckets):
    """thundersync.deterministic: every chunk, fold and their order follow the batch, not arrival: the sums agree bitwise."""
    runs = [_learner_calls(sched, deterministic=True, budget_buckets=budget_buckets) for sched in SCHEDULES.values()]
    renamed = _learner_calls(SCHEDULES["groups_in_order"], {"a": "zz", "b": "b0"}, deterministic=True,
                             budget_buckets=budget_buckets)  # the prompts' ids sort the other way round
    assert runs[0] == runs[1] == renamed
    backwards = [c for c in runs[0] if c[0] == "backward"]
    assert backwards and any(c[0] == "fold" for c in runs[0])  # streamed chunks and group folds both ran
    free = [_learner_calls(sched) for sched in SCHEDULES.values()]  # the control: arrival order shapes the step
    assert free[0] != free[1]


def test_batch_order_gate_hands_on_whole_blocks_in_batch_order():
    from thundersync_verl.step.trajectory_source import BatchOrderGate

    gate = BatchOrderGate(["p", "q"], 2, block=3)
    gate.add([("q_0_0", {}), ("p_1_0", {})])
    assert gate.take() == []  # p_0 has not landed: the block is not whole
    gate.add([("p_0_0", {})])
    assert gate.take() == []  # group q is not complete: its members' order is not known yet
    gate.add([("q_1_0", {})])
    assert [k for k, _ in gate.take()] == ["p_0_0", "p_1_0", "q_0_0"] and not gate.empty
    assert [k for k, _ in gate.take()] == ["q_1_0"] and gate.empty  # the last block may be shorter
    with pytest.raises(ValueError, match="q_1_0: not an expected sample of this batch, or landed twice"):
        gate.add([("q_1_0", {})])


def test_batch_order_gate_orders_a_groups_members_by_content_not_sample_index():
    """The same answers dealt to other sample indices (a replay serves identical first requests in call order)."""
    from thundersync_verl.step.trajectory_source import BatchOrderGate

    def released(answer_of: dict) -> list:
        gate = BatchOrderGate(["p"], 3, block=2, content=lambda keys: {k: answer_of[k] for k in keys})
        gate.add([(k, {}) for k in answer_of])
        return [answer_of[k] for k, _ in gate.take() + gate.take()]

    assert released({"p_0_0": "b", "p_1_0": "c", "p_2_0": "a"}) == released({"p_0_0": "c", "p_1_0": "a", "p_2_0": "b"}) \
        == ["a", "b", "c"]


class _BusyPipe:
    """``OpPipeline``'s surface with queued calls that finish ``latency`` driver polls after they are sent (a busy
    learner); each call then runs on the recording learner. Counts backward submits that found the pipeline full."""

    def __init__(self, learner, on_done, *, depth: int = 2, latency: int = 6):
        from collections import deque

        self.learner, self.on_done, self.depth, self.latency = learner, on_done, depth, latency
        self._inflight, self.max_in_flight, self.blocked_submits, self.polls_while_full = deque(), 0, 0, 0

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def submit(self, op, rows, tokens=None, t_plan=None) -> None:
        if len(self._inflight) >= self.depth:
            self.blocked_submits += not isinstance(op, FoldOp)  # a fold (no rows, no compute) may wait for a slot
            self.collect(keep=self.depth - 1)
        self._inflight.append([op, rows, self.latency])
        self.max_in_flight = max(self.max_in_flight, len(self._inflight))

    def collect(self, keep: int | None = None) -> None:
        from thundersync_verl.step.stream_exec import execute_op

        self.polls_while_full += len(self._inflight) >= self.depth
        if self._inflight:
            self._inflight[0][2] -= 1  # the head call computes while the driver polls
        while self._inflight and (self._inflight[0][2] <= 0 or (keep is not None and len(self._inflight) > keep)):
            op, rows, _ = self._inflight.popleft()
            execute_op(self.learner, op, rows, pad_token_id=0, temperature=1.0)
            self.on_done(op, {}, 0.0, 0.0)

    def drain(self) -> None:
        self.collect(keep=0)


def test_a_busy_learner_gets_no_more_calls_than_it_has_slots_and_late_rows_share_chunks():
    """Coalescing into a pipeline of depth 2: a plan fills the free slots only, so the driver never blocks on a full
    pipeline (it polls on), and rows that land meanwhile join later chunks instead of queueing as small calls."""
    tq, learner = FakeTQ(), FakeLearner()
    rewards = {u: [1.0, 0.0] for u in "abcdef"}
    tq.add("a_0_0", 1.0, visible_at=1)  # the learner's first call: one open-group row
    for i, uid in enumerate("bcdef"):
        tq.add(f"{uid}_0_0", 1.0, visible_at=2 + i)  # one row per poll while the learner is busy
        tq.add(f"{uid}_1_0", 0.0, visible_at=4 + i)
    tq.add("a_1_0", 0.0, visible_at=12)
    pipes = []
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum", max_chunk_size=4)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: pipes.append(_BusyPipe(learner, on_done)) or pipes[-1],
        forward_at_theta_k=lambda keys, tags: {}, uids=list(rewards), n=2, timeout_s=30.0, poll_s=0.001,
        coalesce=True, fused_forward=True)
    StreamedStep(ctx, GRPOArrivals(planner)).run()
    pipe = pipes[0]
    assert pipe.blocked_submits == 0 and pipe.max_in_flight >= 2  # filled, never waiting to queue a backward
    assert pipe.polls_while_full > 0  # the driver kept listing arrivals while the learner had its next call
    assert sorted(effective_coefficients(learner.calls)) == pytest.approx(grpo_advantages(rewards), abs=1e-6)
    backwards = [c for c in learner.calls if c[0] == "backward"]
    assert len(backwards) <= 6  # 12 rows landing one or two a poll: the late ones shared chunks
    assert learner.steps == [pytest.approx(1 / 12)]


class _ClockedTQ(FakeTQ):
    """A record is listed from ``visible_at`` seconds after the first listing on (real time)."""

    def kv_list(self, partition):
        import time

        self.polls += 1
        self.t0 = getattr(self, "t0", None) or time.time()
        now = time.time() - self.t0
        return {partition: {k: t for k, (v, _, t) in self.records.items() if v <= now}}


class _ClockedPipe(_BusyPipe):
    """A learner that computes in real time: a call starts once the learner is free and ends ``per_row`` seconds a
    row later (a fold: 5 ms). ``learner_idle_at`` knows when; ``cost.lead_s`` is the time a plan takes to reach it.
    ``queued_ahead``: backwards submitted while the previous call still ran and rows were still to land."""

    class _Cost:
        lead_s = margin_s = 0.06

    def __init__(self, learner, on_done, tq: _ClockedTQ, *, per_row: float, knows_its_queue: bool):
        super().__init__(learner, on_done)
        self.tq, self.done = tq, []
        self.per_row, self.cost, self.free_at, self.queued_ahead, self.backwards = per_row, self._Cost(), 0.0, 0, 0
        if knows_its_queue:
            self.learner_idle_at = lambda: max([self.free_at] + [c[2] for c in self._inflight])

    def submit(self, op, rows, tokens=None, t_plan=None) -> None:
        import time

        now = time.time()
        end_prev = max([self.free_at] + [c[2] for c in self._inflight])
        if not isinstance(op, FoldOp):
            self.backwards += 1
            landing = now - self.tq.t0 < max(v for v, _, _ in self.tq.records.values())
            self.queued_ahead += self.backwards > 1 and end_prev > now and landing
        seconds = 0.005 if isinstance(op, FoldOp) else self.per_row * len(op.items)
        self._inflight.append([op, rows, max(end_prev, now) + seconds])
        self.max_in_flight = max(self.max_in_flight, len(self._inflight))

    def collect(self, keep: int | None = None) -> None:
        import time

        while self._inflight:
            op, rows, end = self._inflight[0]
            if end > time.time():
                if keep is None or len(self._inflight) <= keep:
                    return
                time.sleep(end - time.time())
            self._inflight.popleft()
            self.free_at = end
            self.done.append((op, rows))
            self.on_done(op, {}, end - 0.01, end)

    def drain(self) -> None:
        """The ops run on the recording learner once all are done (building the first chunk warms torch up for
        seconds, which would stall the clock)."""
        from thundersync_verl.step.stream_exec import execute_op

        self.collect(keep=0)
        for op, rows in self.done:
            execute_op(self.learner, op, rows, pad_token_id=0, temperature=1.0)
        self.done = []


def _clocked_step(knows_its_queue: bool):
    tq, learner = _ClockedTQ(), FakeLearner()
    rewards = {u: [1.0, 0.0, 0.0, 1.0] for u in "abc"}
    for i, (uid, s) in enumerate((u, s) for s in range(4) for u in rewards):
        tq.add(f"{uid}_{s}_0", rewards[uid][s], visible_at=0.06 * i)  # 12 rows over 0.72 s; the learner needs 1.44 s
    pipes = []
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum", max_chunk_size=16)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: pipes.append(
            _ClockedPipe(learner, on_done, tq, per_row=0.12, knows_its_queue=knows_its_queue)) or pipes[-1],
        forward_at_theta_k=lambda keys, tags: {}, uids=list(rewards), n=4, timeout_s=30.0, poll_s=0.002,
        coalesce=True, fused_forward=True)
    step = StreamedStep(ctx, GRPOArrivals(planner))
    out, state = step.run()
    assert sorted(effective_coefficients(learner.calls)) == pytest.approx(grpo_advantages(rewards), abs=1e-6)
    return pipes[0], step.metrics(out)["thundersync/planned_ahead"]


def test_the_next_call_is_queued_before_the_learner_goes_idle():
    """Rows landing faster than the learner computes: with the expected end of the queued calls known, the driver
    plans each next call just before the learner finishes the last one, and lists the TransferQueue only then;
    without it (no estimate yet), it plans while the learner computes only to fill both slots of an idle learner.
    Same advantages either way."""
    ahead, ahead_planned = _clocked_step(knows_its_queue=True)
    blind, blind_planned = _clocked_step(knows_its_queue=False)
    assert ahead.queued_ahead >= 4 and ahead_planned >= 4  # 6 calls while rows land (0.72 s at 0.12 s a row)
    assert blind_planned == 0 and blind.queued_ahead <= ahead.queued_ahead - 2
    # while the learner is busy until a known plan moment, only that moment's listing is made (47 before, for 8
    # calls: every landing restarted the short pause); without the estimate the pause schedule lists on
    assert ahead.tq.polls <= ahead.backwards < blind.tq.polls


class _FixedCostPipe(_ClockedPipe):
    """A clocked learner whose call costs ``fixed`` seconds plus ``per_row`` a row, with the run's real call-cost model
    (``core/call_cost.py``), fitted on earlier steps' calls and fed by this step's."""

    def __init__(self, learner, on_done, tq, *, fixed: float, per_row: float):
        super().__init__(learner, on_done, tq, per_row=per_row, knows_its_queue=False)
        from thundersync_verl.core.call_cost import CallCost

        self.fixed, self.cost, self.rows_per_call = fixed, CallCost(), []
        for rows in (1, 2, 4, 8):  # the earlier steps' calls (5 tokens a row)
            self.cost.observe("backward", 5 * rows, fixed + per_row * rows)

    def submit(self, op, rows, tokens=None, t_plan=None) -> None:
        super().submit(op, rows, tokens, t_plan)
        if not isinstance(op, FoldOp):
            self._inflight[-1][2] += self.fixed
            self.rows_per_call.append(len(op.items))


def _rows_per_call(efficiency: float) -> list[int]:
    """A call's fixed cost (30 ms) is 6 rows of work (5 ms each); 64 rows land one every 20 ms, group after group.
    With ``call_efficiency`` 0.9 the idle learner's call waits for a full chunk (8 rows) while 8 or more are still
    to land: about 64 / 8 calls. Eagerly (0) each call takes the one or two rows that landed during the last one.
    The same advantages either way."""
    tq, learner = _ClockedTQ(), FakeLearner()
    rewards = {u: [1.0, 0.0] * 4 for u in "abcdefgh"}
    for i, (uid, s) in enumerate((u, s) for u in rewards for s in range(8)):
        tq.add(f"{uid}_{s}_0", rewards[uid][s], visible_at=0.02 * i)  # 64 rows over 1.28 s
    pipes = []
    planner = StreamPlanner(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum", max_chunk_size=8)
    ctx = StepContext(
        worker_group=learner, tq=tq, recorder=StepRecorder(None, mode="thundersync"),
        make_pipeline=lambda on_done: pipes.append(
            _FixedCostPipe(learner, on_done, tq, fixed=0.03, per_row=0.005)) or pipes[-1],
        forward_at_theta_k=lambda keys, tags: {}, uids=list(rewards), n=8, timeout_s=30.0, poll_s=0.002,
        coalesce=True, fused_forward=True, call_efficiency=efficiency)
    StreamedStep(ctx, GRPOArrivals(planner)).run()
    assert sorted(effective_coefficients(learner.calls)) == pytest.approx(grpo_advantages(rewards), abs=1e-6)
    return pipes[0].rows_per_call


def test_an_idle_learner_with_a_large_fixed_cost_waits_for_a_full_chunk_while_rows_are_still_to_land():
    efficient, eager = _rows_per_call(0.9), _rows_per_call(0.0)
    assert efficient[0] == 8 and eager[0] <= 2
    # here 12 calls (seven of 8 rows, then the last group's as they land) against 22-24
    assert len(efficient) <= 14 and len(eager) >= len(efficient) + 4, (efficient, eager)


def test_a_trajectory_that_never_lands_fails_the_step_without_stepping():
    tq, learner = FakeTQ(), FakeLearner()
    tq.add("a_0_0", 1.0, visible_at=1)  # a_1_0 never comes
    step = grpo_step(tq, learner, ["a"], 2, timeout_s=0.2)
    with pytest.raises(TrajectoryNeverArrived, match=r"1 trajectories of this batch did not arrive within 0s.*"
                                                     r"optimizer step was NOT taken.*trajectory_timeout_s"):
        step.run()
    assert learner.steps == []


def test_a_node_that_leaves_while_the_step_waits_stops_it_long_before_the_timeout(monkeypatch):
    """Point 6: an agent loop that died with its node reports nothing; the watch names the node within a few polls
    of the head declaring it dead, not at ``trajectory_timeout_s``, and the optimizer does not step."""
    monkeypatch.setattr(streamed_step, "NODE_WATCH_S", 0.02)
    tq, learner, asked = FakeTQ(), FakeLearner(), []
    tq.add("a_0_0", 1.0, visible_at=1)  # a_1_0's agent loop ran on the lost node: it never lands

    def lost_nodes():
        asked.append(1)
        return ["n2 at 10.0.0.2 (GPU, thundersync_rollout)"] if len(asked) >= 3 else []

    step = grpo_step(tq, learner, ["a"], 2, timeout_s=600.0, lost_nodes=lost_nodes)
    with pytest.raises(streamed_step.NodeLeft, match=r"n2 at 10.0.0.2 .*thundersync_rollout.* left the cluster"):
        step.run()
    assert len(asked) == 3  # asked until the head said so, then stopped at once (the timeout is 600 s)
    assert learner.steps == []


def test_a_failed_agent_loop_fails_the_step_naming_the_prompt():
    tq, learner = FakeTQ(), FakeLearner()
    tq.add("a_0_0", 1.0, visible_at=1)
    tq.add("a", 0.0, visible_at=2, status="failure", is_prompt=True)
    with pytest.raises(TrajectoryNeverArrived, match=r"prompt a: its agent loop failed"):
        grpo_step(tq, learner, ["a"], 2).run()
    assert learner.steps == []


def test_a_refused_backward_fails_the_step_before_the_optimizer():
    tq, learner = FakeTQ(), FakeLearner(fail_on_chunk=1)
    for s, r in enumerate([1.0, 0.0, 1.0, 0.0]):
        tq.add(f"a_{s}_0", r, visible_at=1 + 3 * s)  # four separate arrivals, four chunks
    with pytest.raises(RuntimeError, match="learner refused the chunk"):
        grpo_step(tq, learner, ["a"], 4).run()
    assert learner.steps == []


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_finished_step_frees_its_rows_without_the_cycle_collector(deterministic):
    """A long run's driver must not keep a step's rows (every token and log-prob of the batch) past the step:
    once the step and its state are dropped, reference counting alone frees them (no cycle left for Python's
    rare full collection; benchmarks/soak.py measured ~160 KB a step of driver growth with the cycles)."""
    import gc
    import weakref

    class Row(dict):  # a dict that can be weakly referenced, in place of one of the step's rows
        pass

    tq, learner = FakeTQ(), FakeLearner()
    for uid, rewards in REWARDS.items():
        for s, r in enumerate(rewards):
            tq.add(f"{uid}_{s}_0", r, visible_at=1 + s)
    step = grpo_step(tq, learner, ["a", "b"], 3, deterministic=deterministic)
    enabled = gc.isenabled()
    gc.disable()
    try:
        out, state = step.run()
        step.metrics(out)
        state.rows["a_0_0"] = Row(state.rows["a_0_0"])
        row = weakref.ref(state.rows["a_0_0"])
        del step, state, out
        assert row() is None
    finally:
        if enabled:
            gc.enable()


def test_row_lists_splits_every_layout_verl_stores_a_field_in_like_indexing_row_by_row():
    from thundersync_verl.step.stream_exec import row_lists

    rows = [torch.tensor([0.5, -1.0, 2.0]), torch.tensor([3.0]), torch.tensor([-0.25, 4.0])]
    expected = [r.tolist() for r in rows]
    jagged = torch.nested.nested_tensor(rows, layout=torch.jagged)
    assert row_lists(jagged) == expected == [jagged[i].tolist() for i in range(3)]
    tail = torch.nested.narrow(torch.arange(12.0).reshape(3, 4), 1, torch.tensor([1, 0, 2]), torch.tensor([2, 3, 1]),
                               layout=torch.jagged)  # a view with holes: offsets alone would be wrong
    assert row_lists(tail) == [[1.0, 2.0], [4.0, 5.0, 6.0], [10.0]]
    assert row_lists(torch.nested.nested_tensor(rows)) == expected  # strided nested layout
    assert row_lists(torch.tensor([[1, 2], [3, 4]])) == [[1, 2], [3, 4]]
    assert row_lists(rows) == expected  # a plain list of tensors
