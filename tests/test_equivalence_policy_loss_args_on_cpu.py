"""benchmarks/equivalence.py --policy-loss: a loss defined for one loss_agg_mode runs with that mode (no Ray).

The comparison itself is the benchmark's (``equivalence_policy_<name>_seeds.json``); here the argument check and
what the flag changes: verl's actor config and every path's spec carry the loss's own ``loss_agg_mode``.
"""

from __future__ import annotations

import argparse

import pytest

from thundersync_harness import policy_loss
from thundersync_harness.engine_steps import PolicySpec


@pytest.fixture(scope="module")
def bench(equivalence_bench):
    return equivalence_bench


def test_sapo_without_its_loss_agg_mode_is_a_usage_error_naming_the_flag(bench, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--policy-loss", "sapo", "--results-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--loss-agg-mode seq-mean-token-mean" in err and "Traceback" not in err and not list(tmp_path.iterdir())


def test_sapo_sets_its_mode_on_verls_config_and_on_the_spec_of_every_path():
    from omegaconf import OmegaConf

    args = argparse.Namespace(policy_loss="sapo", loss_agg_mode="seq-mean-token-mean")
    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean",
                                                               "policy_loss": {"loss_mode": "vanilla"}}}})
    policy_loss.apply_policy_loss(config, args)
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == "sapo"
    assert config.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-mean"
    assert policy_loss.policy_loss_spec(args, None) == PolicySpec(loss_agg_mode="seq-mean-token-mean")
    vanilla = argparse.Namespace(policy_loss="gspo", loss_agg_mode="token-mean")
    assert policy_loss.policy_loss_spec(vanilla, None) is None  # gspo follows actor.loss_agg_mode
