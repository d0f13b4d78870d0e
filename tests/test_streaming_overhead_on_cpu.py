"""benchmarks/streaming_overhead.py: the product's split of a streamed step (the driver's ``StreamPlanner``, a
learner running its ops as the FSDP2 worker does) reproduces the batched gradient, and the coalescing policy
gives a busy learner fewer, larger calls."""

from __future__ import annotations

import pytest
import torch

from thundersync_harness import tiny_lm as C
from thundersync_harness.benchmarks import load_benchmark
from thundersync_verl.core.call_cost import CallCost

S = load_benchmark("streaming_overhead")


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    model = C.tiny_qwen2(0, torch.float32, hidden=32, layers=1, vocab=64)
    spec = C.LossSpec(estimator="grpo", loss_agg_mode="token-mean")
    trajs = C.make_batch(0, [4] * 4, "binary", prompt_len=(3, 6), response_len=(2, 9), vocab=64)
    S.batched(model, spec, trajs)
    return model, spec, trajs, [p.grad.clone() for p in model.parameters()]


def _grad_error(model, reference) -> float:
    return C.relative_error([p.grad for p in model.parameters()], reference)


@pytest.mark.parametrize("wake_every", [1, 3, 16])
def test_the_worker_split_reproduces_the_batched_gradient(setting, wake_every):
    model, spec, trajs, reference = setting
    out = S.worker_stream(model, spec, trajs, S.arrival_order(trajs, seed=1), wake_every, 4)
    assert _grad_error(model, reference) <= 1e-5
    assert out["calls"] >= 16 // 4 and out["learner"] > 0.0 and out["planner"] > 0.0


def test_a_busy_learner_coalesces_and_an_idle_one_streams(setting):
    model, spec, trajs, reference = setting
    fractions = S.arrival_fractions(trajs, seed=1)
    at_once = S.coalescing_stream(model, spec, trajs, fractions, 0.0, 8)
    assert _grad_error(model, reference) <= 1e-5
    assert at_once["calls"] == 2  # everything landed: closed groups, chunks of 8
    assert at_once["rows_after_last_landing"] == len(trajs)  # all of it after the (only) landing
    spread = S.coalescing_stream(model, spec, trajs, fractions, 1e6, 8)  # landings far apart: a call each
    assert _grad_error(model, reference) <= 1e-5
    # counted in rows, not seconds (CPU times move when other jobs share the machine): with landings far
    # apart the learner has backpropagated everything but the last landing's trajectory when it lands
    assert spread["calls"] > at_once["calls"] and spread["rows_after_last_landing"] == 1


def test_the_product_policy_waits_for_efficient_calls_and_reproduces_the_batched_gradient(setting):
    """Point 8: with a call-cost model whose fixed cost is half a row of work (an efficient call: 4.5 rows), the free
    learner waits while less than that is ready and more is to land; without a fixed cost it takes what landed, a
    call per landing when landings are far apart. The same gradient either way."""
    model, spec, trajs, reference = setting
    fractions = S.arrival_fractions(trajs, seed=1)
    row = sum(len(t.prompt) + len(t.response) for t in trajs) / len(trajs)  # tokens

    class Fixed(CallCost):  # the model as given: this machine's real call times are not what is tested
        def observe(self, kind, tokens, seconds):
            pass

    def model_of(fixed_rows: float) -> CallCost:
        cost = Fixed()
        for rows in (1, 4, 16):
            CallCost.observe(cost, "backward", rows * row, 1e-3 * (fixed_rows + rows))
        return cost

    waited = S.coalescing_stream(model, spec, trajs, fractions, 1e6, len(trajs), model_of(0.5), 0.9)
    assert _grad_error(model, reference) <= 1e-5
    eager = S.coalescing_stream(model, spec, trajs, fractions, 1e6, len(trajs), model_of(0.0), 0.9)
    assert _grad_error(model, reference) <= 1e-5
    # landings far apart (deterministic): 16 calls against 10 (the rest of a call waits for its group to close)
    assert eager["calls"] >= len(trajs) - 1 and waited["calls"] <= eager["calls"] - 4, (waited["calls"], eager["calls"])


def test_the_call_cost_line_is_fitted_on_one_call_backwards(setting):
    line = S.cost_line([1, 2, 4, 8, 16], [0.002 + 0.0005 * k for k in (1, 2, 4, 8, 16)])
    assert line == pytest.approx({"call_fixed_ms": 2.0, "row_ms": 0.5, "fixed_cost_rows": 4.0})
    assert S.cost_line([1, 2], [0.003, 0.003])["fixed_cost_rows"] == float("inf")  # no row cost seen
    model, spec, trajs, _ = setting
    costs = S.call_costs(model, spec, trajs, repeats=1)  # the real calls: shape only (timings are not asserted)
    assert set(costs) == {"call_fixed_ms", "row_ms", "fixed_cost_rows", "samples"} and len(costs["samples"]) == 5


@pytest.mark.parametrize("argv, message", [
    (["--hidden", "12"], "multiple of 8"),
    (["--layers", "0"], "--layers must be at least 1"),
    (["--response-len", "0"], "--response-len must be at least 1"),
])
def test_bad_model_sizes_get_a_usage_line(monkeypatch, capsys, argv, message):
    monkeypatch.setattr("sys.argv", ["streaming_overhead.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        S.main()
    assert exit_.value.code == 2 and message in capsys.readouterr().err
