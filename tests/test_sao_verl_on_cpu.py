"""SAO's verl registrations (thundersync_verl/algos/sao/sao_verl.py) called through verl's own registries and trainer code.

1. ``import verl`` (the plugin) registers estimator ``sao`` and policy loss ``sao`` in verl's registries.
2. The estimator from verl's registry equals the core math; verl's own GAE agrees with it where it
   should: with no observation tokens (advantages for any lambda; returns at lambda = 1) and, on the
   agent tokens, with observations too (verl's recursion also skips masked tokens).
3. verl's trainer-side ``compute_advantage`` (as the V1 trainer calls it) hands the critic's values to
   ``sao``; without values it refuses with the rule; other estimators are untouched.
4. The policy loss from verl's registry, with the recipe's actor config, equals the core loss under
   verl's ``agg_loss`` and its gradient is -A r m / N.
5. The recipe composes to grpo's config plus exactly the SAO keys, in each of its modes.

GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

from pathlib import Path

import re

import pytest
import torch

from thundersync_verl.core.errors import StreamingConfigError
from thundersync_verl.core.sao import sao_advantages_and_returns, sao_policy_loss, token_mean

RECIPES = Path(__file__).resolve().parents[1] / "recipes" / "cpu_tiny"
LAUNCHER = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z"]
SAO_KEYS = ("actor_rollout_ref.rollout.n", "actor_rollout_ref.actor.policy_loss.loss_mode",
            "actor_rollout_ref.actor.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_high", "algorithm.",
            "critic.", "trainer.critic_warmup", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",  # micro-batches: rows = prompts x 1
            "actor_rollout_ref.actor.optim.lr")  # fully_async: one step per 2-prompt mini-batch, lr / 4


def _batch(seed: int, observations: bool, b: int = 4, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = [t, t - 2, t - 4, 3][:b]
    agent = torch.zeros(b, t)
    rewards = torch.zeros(b, t)
    for i, n in enumerate(lengths):
        agent[i, :n] = 1
        if observations and n > 4:
            agent[i, 1:3] = 0  # a tool reply inside the response
        rewards[i, n - 1] = float(torch.rand(1, generator=g) > 0.5)
    values = torch.randn(b, t, generator=g)
    return rewards, values, agent


def test_plugin_registers_estimator_and_loss_in_verl():
    import verl  # noqa: F401  (loads the plugin)
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

    from thundersync_verl.algos.sao import sao_verl as sao

    assert get_adv_estimator_fn("sao") is sao.compute_sao_advantage_return
    assert get_policy_loss_fn("sao") is sao.compute_sao_policy_loss


@pytest.mark.parametrize("lam", [1.0, 0.95])
def test_verl_gae_agrees_without_observation_tokens(lam):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return, get_adv_estimator_fn

    rewards, values, agent = _batch(0, observations=False)
    adv, ret = get_adv_estimator_fn("sao")(token_level_rewards=rewards, response_mask=agent, values=values,
                                            gamma=1.0, lam=lam)
    core_adv, core_ret = sao_advantages_and_returns(rewards, values, agent, gamma=1.0, lam=lam)
    assert torch.equal(adv, core_adv) and torch.equal(ret, core_ret)
    v_adv, v_ret = compute_gae_advantage_return(rewards, values, agent, gamma=1.0, lam=lam)
    m = agent.bool()
    assert torch.allclose(adv[m], v_adv[m], atol=1e-5)
    if lam == 1.0:  # verl's returns are lambda-returns; SAO's are Monte-Carlo: equal at lambda = 1 only
        assert torch.allclose(ret[m], v_ret[m], atol=1e-5)
    else:
        assert not torch.allclose(ret[m], v_ret[m], atol=1e-3)


def test_verl_gae_agrees_on_agent_tokens_with_observations():
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    rewards, values, agent = _batch(1, observations=True)
    assert (agent[:, 1:3] == 0).any()
    adv, ret = sao_advantages_and_returns(rewards, values, agent, gamma=0.9, lam=1.0)
    v_adv, v_ret = compute_gae_advantage_return(rewards, values, agent, gamma=0.9, lam=1.0)
    m = agent.bool()
    assert torch.allclose(adv[m], v_adv[m], atol=1e-5) and torch.allclose(ret[m], v_ret[m], atol=1e-5)
    assert torch.all(adv[~m] == 0) and torch.all(ret[~m] == 0)  # observations: no advantage, no value target
    assert not torch.all(v_adv[~m] == 0)  # verl carries values onto them (masked later in its losses)


def _data(rewards, values, agent, with_values=True):
    from thundersync_verl import verl_adapter as va

    tensors = {"token_level_rewards": rewards, "response_mask": agent}
    if with_values:
        tensors["values"] = values
    return va.data_proto_cls().from_dict(tensors=tensors)


def test_trainer_compute_advantage_hands_values_to_sao():
    from omegaconf import OmegaConf

    from thundersync_verl import verl_adapter as va

    compute_advantage = va.compute_advantage_fn()
    assert getattr(compute_advantage, "_thundersync_patched", False)
    rewards, values, agent = _batch(2, observations=True)
    algo = OmegaConf.create({"gamma": 1.0, "lam": 0.9})
    out = compute_advantage(_data(rewards, values, agent), adv_estimator="sao", gamma=1.0, lam=0.9, config=algo)
    core_adv, core_ret = sao_advantages_and_returns(rewards, values, agent, gamma=1.0, lam=0.9)
    assert torch.equal(out.batch["advantages"], core_adv) and torch.equal(out.batch["returns"], core_ret)
    with pytest.raises(StreamingConfigError, match="critic.enable=true"):
        compute_advantage(_data(rewards, values, agent, with_values=False), adv_estimator="sao", config=algo)
    gae = compute_advantage(_data(rewards, values, agent), adv_estimator="gae", gamma=1.0, lam=0.9, config=algo)
    v_adv, _ = va.gae_advantage_return()(rewards, values, agent, gamma=1.0, lam=0.9)
    assert torch.equal(gae.batch["advantages"], v_adv)  # other estimators: verl's own result


def _compose(mode: str, *extra: str, recipe: str = "sao"):
    from hydra import compose, initialize_config_dir

    folder = RECIPES / "sao" if recipe == "sao" else RECIPES
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        return compose(config_name=recipe, overrides=LAUNCHER + [f"mode={mode}", *extra])


def test_policy_loss_through_verl_registry_equals_core():
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass

    actor = omega_conf_to_dataclass(_compose("sync").actor_rollout_ref.actor)
    g = torch.Generator().manual_seed(3)
    rollout = -torch.rand(3, 6, generator=g, dtype=torch.float64) * 2
    log_prob = (rollout + torch.randn(3, 6, generator=g, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 6, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[2, 4:] = False
    loss, metrics = get_policy_loss_fn("sao")(rollout, log_prob, adv, mask, "token-mean", actor, None)
    loss_mat, stats = sao_policy_loss(log_prob, rollout, adv, mask, eps_low=0.3, eps_high=5.0)
    assert 0 < stats["masked_frac"] < 1  # both kept and masked tokens occur
    assert metrics["actor/sao_masked_frac"] == stats["masked_frac"]
    assert torch.allclose(loss, token_mean(loss_mat, mask))
    (grad,) = torch.autograd.grad(loss, log_prob)
    ratio = torch.exp(log_prob.detach() - rollout)
    keep = (ratio > 0.7) & (ratio < 6.0) & mask
    assert torch.allclose(grad, -adv * ratio * keep / mask.sum())


@pytest.mark.parametrize("mode", ["sync", "async", "fully_async", "thundersync"])
def test_sao_recipe_is_grpo_plus_the_sao_keys(mode):
    from omegaconf import OmegaConf

    def flat(cfg):
        out = {}

        def walk(node, path):
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{path}.{k}" if path else str(k))
            else:
                out[path] = node
        walk(OmegaConf.to_container(cfg, resolve=True), "")
        return out

    same_name = "trainer.experiment_name=run"  # the run name (and the paths derived from it) differs by design
    grpo, sao = flat(_compose(mode, same_name, recipe="grpo")), flat(_compose(mode, same_name))
    changed = sorted(k for k in set(grpo) | set(sao) if grpo.get(k, "<absent>") != sao.get(k, "<absent>"))
    derived = [k for k in changed if k.endswith(".rollout_n")]  # verl copies rollout.n into its sections
    assert [k for k in changed if not k.startswith(SAO_KEYS) and k not in derived] == [], "sao.yaml drifted from grpo.yaml"
    assert sao["actor_rollout_ref.rollout.n"] == 1 and sao["algorithm.adv_estimator"] == "sao"
    assert sao["actor_rollout_ref.actor.policy_loss.loss_mode"] == "sao"
    assert sao["algorithm.rollout_correction.bypass_mode"] is True  # old_log_probs = the rollout's
    assert sao["critic.enable"] is True and sao["critic.model.path"] == "z"
    assert sao["critic.ppo_epochs"] > sao["actor_rollout_ref.actor.ppo_epochs"]
    assert sao["trainer.critic_warmup"] >= 1
    assert sao["thundersync.mode"] == mode
    assert _compose(mode).trainer.experiment_name == f"sao_{mode}"  # the run is named after its mode


def test_sao_recipe_thundersync_mode_validates_and_broken_variants_are_refused_naming_the_key():
    from thundersync_verl.step.thundersync_trainer import validate_thundersync_config

    assert sorted(p.stem for p in (RECIPES / "sao" / "mode").glob("*.yaml")) == ["async", "fully_async", "sync",
                                                                                "thundersync"]
    for mode in ("sync", "async", "fully_async", "thundersync"):  # verl asserts micro | rows; rows = prompts x 1
        actor = _compose(mode).actor_rollout_ref.actor
        assert actor.ppo_mini_batch_size % actor.ppo_micro_batch_size_per_gpu == 0
    ts = validate_thundersync_config(_compose("thundersync"))
    assert ts.learner_forward == "fused"
    broken = {
        "actor_rollout_ref.rollout.n=4": "rollout.n=1",
        "critic.enable=false": "critic.enable=true",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla": "loss_mode=sao",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4": "ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.use_kl_loss=true": "use_kl_loss=false",
        "algorithm.rollout_correction.bypass_mode=false": "bypass_mode=true",
        "thundersync.learner_forward=separate": "learner_forward=fused",
    }
    for override, key in broken.items():
        with pytest.raises(StreamingConfigError, match=re.escape(key)):
            validate_thundersync_config(_compose("thundersync", override))
    # the GRPO recipe with only the estimator switched lacks the critic and the loss: refused, both named
    with pytest.raises(StreamingConfigError, match="critic.enable=true.*loss_mode=sao"):
        validate_thundersync_config(_compose("thundersync", "algorithm.adv_estimator=sao",
                                             "actor_rollout_ref.rollout.n=1", recipe="grpo"))


def test_the_critic_value_model_loads_on_cpu_through_verl(tmp_path):
    """verl's ``load_valuehead_model`` asks for flash_attention_2; the CPU patch loads it with sdpa."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from verl.utils import model as verl_model

    from thundersync_verl.verl_adapter.patches import APPLIED

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    config.num_labels = 1  # what verl's FSDP engine sets for a value model
    assert "valuehead_sdpa_on_cpu" in APPLIED
    critic = verl_model.load_valuehead_model(str(tmp_path), torch.float32, config, False)
    values = critic(input_ids=torch.tensor([[1, 2, 3, 4]])).logits  # [B, T, 1]
    assert values.shape == (1, 4, 1) and critic.config._attn_implementation == "sdpa"


def test_the_benchmark_command_composes():
    """benchmarks/sao.py launches main_ppo with these overrides: they compose into the SAO settings asked for."""
    import importlib.util

    from hydra import compose, initialize_config_dir

    spec = importlib.util.spec_from_file_location("sao_bench", RECIPES.parents[1] / "benchmarks" / "sao.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cmd = bench.sao_command({"train": "t.parquet", "val": "v.parquet", "student": "m"}, mode="fully_async", steps=12,
                            warmup=4, critic_epochs=3, extra=["critic.optim.lr=0.01"])
    config_path = next(a.split("=", 1)[1] for a in cmd if a.startswith("--config-path="))
    with initialize_config_dir(config_dir=config_path, version_base=None):
        cfg = compose(config_name="sao", overrides=[a for a in cmd[3:] if not a.startswith("--")])
    assert (cfg.trainer.critic_warmup, cfg.critic.ppo_epochs, cfg.trainer.total_training_steps) == (4, 3, 12)
    assert cfg.trainer.v1.trainer_mode == "separate_async" and cfg.critic.optim.lr == 0.01
    assert cfg.critic.model.path == "m" and cfg.actor_rollout_ref.rollout.n == 1
