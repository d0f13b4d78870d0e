"""Streamed critic update on verl's real FSDP2 critic engine (a 1-process Ray worker group on the CPU).

Needs no GPU. The critic worker group is built as verl's V1 trainer builds it (value model, verl's value loss
bound with its CriticConfig), so verl's own ``train_mini_batch`` on the same group is the oracle. Multi-turn
trajectories (observation tokens masked) valued on arrival, in a random order, streamed in chunks with
c_t = V_t - G_t and the 1/N normaliser at the barrier, must give verl's critic step within 2x the noise floor
(verl's own update with the rows regrouped into other micro-batches); leaving the normaliser off must not.
Starts Ray once (~20-40 s on 2 cores).
"""

from __future__ import annotations

import pytest

from thundersync_harness import engine_setup as setup
from thundersync_harness.critic_steps import (
    bind_critic_config, critic_config, make_critic_batch, run_critic_equivalence, start_critic, stream_critic_step,
    sync_critic_step, train_critic,
)
from thundersync_harness.engine_steps import relative_gap
from thundersync_harness.sao_steps import regrouped
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.models.value_model import write_value_model

pytestmark = pytest.mark.slow  # Ray and verl's FSDP2 critic engine, started once per module, then real steps
GROUPS, MICRO, EPOCHS = 2, 4, 3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with setup.ray_session():
        work = tmp_path_factory.mktemp("critic_engine")
        model, pad_id, vocab = setup.build_tiny_model(work / "model")
        value = write_value_model(model, work / "value", seed=0)
        wg = start_critic(critic_config(value, groups=GROUPS, micro=MICRO), dp=1)
        yield {"wg": wg, "pad": pad_id, "vocab": vocab, "config": lambda **kw: critic_config(value, groups=GROUPS,
                                                                                              micro=MICRO, **kw)}


def test_streamed_critic_step_equals_verls_critic_update(engine):
    result = run_critic_equivalence(engine["wg"], engine["pad"], engine["vocab"], groups=GROUPS, micro=MICRO, steps=2)
    for step in result["steps"]:
        assert step["update_norm"] > 1e-4  # verl's value loss moved the critic
        assert step["chunks"] >= 3  # several chunks before the barrier
        assert step["drift"] < 1e-4  # the values the coefficients came from are the step-start forward's
        assert step["floor"] > 0 and step["gap"] <= 2 * step["floor"], step
        assert step["grad_norm_stream"] == pytest.approx(step["grad_norm_sync"], rel=1e-5)
    assert result["control_gap"] > 1.0  # the normaliser left off: far from verl's step


def test_backwards_sent_without_waiting_give_the_same_step(engine):
    wg, pad = engine["wg"], engine["pad"]
    batch = make_critic_batch(17, GROUPS, engine["vocab"])
    n = len(batch["trajs"])
    [d_nowait], [info] = train_critic(wg, [lambda: stream_critic_step(wg, batch, pad, train_batch_size=GROUPS,
                                                                      wait=False)])
    [d_verl], _ = train_critic(wg, [lambda: sync_critic_step(wg, batch, list(range(n)), pad)])
    [d_floor], _ = train_critic(wg, [lambda: sync_critic_step(wg, batch, regrouped(n, MICRO), pad)])
    assert info["stream/chunks"] >= 3
    assert relative_gap(d_nowait, d_verl) <= 2 * relative_gap(d_floor, d_verl)


def test_later_epochs_by_verls_train_mini_batch_give_verls_multi_epoch_update(engine):
    """critic.ppo_epochs = E: the stream is epoch 1 (no LR step), verl's train_mini_batch(epochs=E-1) the rest."""
    wg, pad = engine["wg"], engine["pad"]
    batch = make_critic_batch(31, GROUPS, engine["vocab"])
    n = len(batch["trajs"])
    bind_critic_config(wg, engine["config"](epochs=EPOCHS))  # the trainer's critic.ppo_epochs=3
    try:
        [d_split], _ = train_critic(wg, [lambda: stream_critic_step(wg, batch, pad, train_batch_size=GROUPS,
                                                                    later_epochs=EPOCHS - 1)])
        with pytest.raises(StreamingConfigError, match="critic_later_epochs"):  # epochs 2.. must be acknowledged
            wg.stream_begin_batch({"train_batch_size": GROUPS})
    finally:
        bind_critic_config(wg, engine["config"]())
    [d_verl], _ = train_critic(wg, [lambda: sync_critic_step(wg, batch, list(range(n)), pad, epochs=EPOCHS)])
    [d_floor], _ = train_critic(wg, [lambda: sync_critic_step(wg, batch, regrouped(n, MICRO), pad, epochs=EPOCHS)])
    [d_one], _ = train_critic(wg, [lambda: sync_critic_step(wg, batch, list(range(n)), pad, epochs=1)])
    gap, floor = relative_gap(d_split, d_verl), relative_gap(d_floor, d_verl)
    assert relative_gap(d_one, d_verl) > 0.1  # the later epochs matter
    assert floor > 0 and gap <= 2 * floor, (gap, floor)


def test_what_cannot_stream_is_refused_with_the_key(engine):
    wg = engine["wg"]
    with pytest.raises(StreamingConfigError, match="critic.ppo_mini_batch_size"):
        wg.stream_begin_batch({"train_batch_size": GROUPS + 1})
    with pytest.raises(StreamingConfigError, match="critic.ppo_epochs=1"):
        wg.stream_begin_batch({"train_batch_size": GROUPS, "critic_later_epochs": 2})
