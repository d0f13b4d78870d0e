"""The learner-level rule table (``learner/engine_rules.py``): one table, evaluated by the learner and by the recipes.

1. Every rule of the table fires from a composed SWE-smith recipe variant that breaks it (hydra overrides, as a
   launch would pass them), through ``thundersync recipes check``; the shipped variant itself passes.
2. For the same fact the streaming learner (facts from a stand-in engine) and the recipe check (facts from the
   config) give the same message; verl's own row restates the ValueError verl 0.9.1 raises, read from its source.
3. The worker's actor-config validation runs on the composed config in thundersync mode only.
4. The JSON line counts every variant checked at learner level: ``learner_checked == recipes == valid`` (here for
   the MoE shape's four modes; every shipped variant in ``tests/test_recipes_check_on_cpu.py``).
GPUs needed: 0 (CPU only).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import verl  # noqa: F401  (the plugin installs the CPU patches, as in every verl process)
from thundersync_verl.core import StreamingConfigError
from thundersync_verl.learner import engine_rules
from thundersync_verl.recipes import check as rc
from thundersync_verl.recipes.rules import one_line

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
SWE = RECIPES / "swe_smith"
MEGATRON = "actor_rollout_ref.actor.megatron"

# rule name -> (shape, overrides that break it, the stand-in engine's settings for the same fact)
BREAKS = {
    "learner": ("qwen3_8b", ["actor_rollout_ref.actor.strategy=veomni"], {"strategy": "veomni"}),
    "virtual_pipeline_model_parallel_size": ("qwen3_8b", [f"{MEGATRON}.virtual_pipeline_model_parallel_size=2"],
                                             {"vpp": 2}),
    "param_offload": ("qwen3_8b", [f"{MEGATRON}.param_offload=true"], {"param_offload": True}),
    "use_megatron_fsdp": ("qwen3_8b", [f"{MEGATRON}.use_megatron_fsdp=true"], {"use_megatron_fsdp": True}),
    "dynamic_context_parallel": ("qwen3_8b", [f"{MEGATRON}.dynamic_context_parallel=true"], {"dcp": True}),
    "auxiliary_losses": ("qwen3_30b_a3b", [f"{MEGATRON}.override_transformer_config.moe_aux_loss_coeff=0.01",
                                           f"++{MEGATRON}.override_transformer_config.moe_router_load_balancing_type"
                                           "=aux_loss"], {"moe": 128, "aux": 0.01, "balancing": "aux_loss"}),
    "overlap_grad_reduce": ("qwen3_8b", [f"++{MEGATRON}.override_ddp_config.overlap_grad_reduce=true"],
                            {"overlap_grad_reduce": True}),
    "use_remove_padding": ("qwen3_8b", ["actor_rollout_ref.model.use_remove_padding=false"], None),  # CP 4: per-token
}


def _variant(shape: str, mode: str = "thundersync", *extra: str) -> rc.Variant:
    return rc.Variant(SWE / "grpo.yaml", (("shape", shape), ("layout", "1node"), ("mode", mode)), tuple(extra))


@pytest.fixture(scope="module")
def verdicts() -> dict:
    """Each rule's breaking variant, the shipped variants they start from, and one in sync mode: composed once."""
    names = list(BREAKS)
    variants = [_variant(BREAKS[n][0], "thundersync", *BREAKS[n][1]) for n in names]
    variants += [_variant("qwen3_8b"), _variant("qwen3_30b_a3b"),
                 _variant("qwen3_8b", "sync", *BREAKS["param_offload"][1]),
                 _variant("qwen3_8b", "sync", *BREAKS["use_remove_padding"][1])]
    found = rc.check_variants(variants)
    return {**dict(zip(names, found)), "shipped": found[len(names):len(names) + 2], "sync_offload": found[-2],
            "sync_padding": found[-1]}


def test_the_table_names_every_rule_once_and_every_fact_it_reads():
    assert [r.name for r in engine_rules.RULES] == list(BREAKS)
    facts = engine_rules.facts_from_config({"actor_rollout_ref": {"actor": {"strategy": "megatron"}}})
    assert set(facts) == set(engine_rules.FACTS)
    for rule in engine_rules.RULES:  # every template formats from the facts alone
        rule.message(facts)


@pytest.mark.parametrize("name", list(BREAKS))
def test_every_learner_rule_fires_from_a_composed_config_that_breaks_it(name, verdicts):
    rule = next(r for r in engine_rules.RULES if r.name == name)
    verdict = verdicts[name]
    assert verdict.facts.get("learner_checked"), verdict.problems
    expected = one_line(rule.message(engine_rules.facts_from_config(_composed(verdict.variant))))
    assert expected in verdict.problems, f"{name}: {verdict.problems}"


def test_the_shipped_variants_pass_every_learner_rule(verdicts):
    for verdict in verdicts["shipped"]:
        assert verdict.valid and verdict.facts["learner_checked"], verdict.problems


def test_streaming_rules_apply_in_thundersync_mode_and_verls_engine_rules_in_every_mode(verdicts):
    assert verdicts["sync_offload"].valid, verdicts["sync_offload"].problems  # the streaming learner does not run
    assert any("calculate_per_token_loss=True requires use_remove_padding=True" in p
               for p in verdicts["sync_padding"].problems), verdicts["sync_padding"].problems


def _composed(variant: rc.Variant) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(variant.recipe.parent), version_base=None), \
            rc._placeholder_env({"MODEL_PATH", "DATA_DIR", "TEACHER_PATH"}):
        cfg = compose(config_name=variant.recipe.stem, overrides=variant.launcher_overrides() + variant.overrides)
        return OmegaConf.to_container(cfg, resolve=True)


# ----- the learner and the recipe check: one message per fact ---------------------------------------------
def _worker(strategy: str = "megatron", **engine):
    """A stand-in actor worker whose Megatron engine reports ``engine`` (what the learner reads of verl's engine)."""
    ddp = SimpleNamespace(overlap_grad_reduce=engine.pop("overlap_grad_reduce", False), use_distributed_optimizer=False)
    config = SimpleNamespace(strategy=strategy, virtual_pipeline_model_parallel_size=engine.pop("vpp", None),
                             use_megatron_fsdp=engine.pop("use_megatron_fsdp", False),
                             dynamic_context_parallel=engine.pop("dcp", False), use_remove_padding=True)
    tf_config = SimpleNamespace(calculate_per_token_loss=True, num_moe_experts=engine.pop("moe", None),
                                moe_aux_loss_coeff=engine.pop("aux", 0.0), moe_z_loss_coeff=None,
                                moe_router_load_balancing_type=engine.pop("balancing", "none"))  # verl's default
    eng = SimpleNamespace(engine_config=config, module=[SimpleNamespace(ddp_config=ddp)],
                          is_param_offload_enabled=engine.pop("param_offload", False), tf_config=tf_config)
    return SimpleNamespace(actor=SimpleNamespace(engine=eng, engine_config=config))


@pytest.mark.parametrize("name", [n for n, (_, _, engine) in BREAKS.items() if engine is not None])
def test_the_learner_and_the_recipe_check_give_the_same_message_for_the_same_fact(name, verdicts):
    from thundersync_verl.learner.engines import make_learner

    engine = dict(BREAKS[name][2])
    with pytest.raises(StreamingConfigError) as info:
        make_learner(_worker(engine.pop("strategy", "megatron"), **engine)).check()
    assert one_line(str(info.value)) in verdicts[name].problems, (str(info.value), verdicts[name].problems)
    make_learner(_worker()).check()  # the plain engine streams


def test_verls_row_restates_the_error_verls_megatron_engine_raises():
    source = Path(verl.__file__).parent / "workers" / "engine" / "megatron" / "transformer_impl.py"
    prefix = "calculate_per_token_loss=True requires use_remove_padding"
    texts = [n.value for n in ast.walk(ast.parse(source.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(prefix)]
    assert len(texts) == 1, texts
    rule = next(r for r in engine_rules.RULES if r.name == "use_remove_padding")
    assert rule.owner == engine_rules.VERL and rule.why in texts[0]
    assert "calculate_per_token_loss=True requires use_remove_padding=True" in rule.rule


def test_a_router_coefficient_without_the_balancing_loss_it_scales_is_not_refused():
    # verl 0.9.1 builds MoE models with moe_router_load_balancing_type=none (both bridges): Megatron's router then
    # computes no balancing loss whatever moe_aux_loss_coeff says (Qwen3-MoE checkpoints carry 0.001)
    from thundersync_verl.learner.engines import make_learner

    make_learner(_worker(moe=4, aux=0.001)).check()  # the live engine: type none
    recipe = {"actor_rollout_ref": {"actor": {"strategy": "megatron", "megatron": {
        "expert_model_parallel_size": 4, "override_transformer_config": {"moe_aux_loss_coeff": 0.001}}}}}
    assert engine_rules.facts_from_config(recipe)["auxiliary_losses"] is None  # Megatron-Bridge: verl sets none
    recipe["actor_rollout_ref"]["actor"]["megatron"]["vanilla_mbridge"] = True  # the bridge's own type: unknown
    assert engine_rules.facts_from_config(recipe)["auxiliary_losses"] == "moe_aux_loss_coeff=0.001"
    with pytest.raises(StreamingConfigError, match="moe_aux_loss_coeff=0.001"):
        make_learner(_worker(moe=4, aux=0.001, balancing="seq_aux_loss")).check()


# ----- the worker's actor-config validation ---------------------------------------------------------------
def test_the_workers_actor_config_validation_runs_on_the_composed_config_where_the_run_streams():
    raw = {"actor_rollout_ref": {"actor": {"strategy": "fsdp", "ppo_mini_batch_size": 4, "use_kl_loss": True,
                                           "kl_loss_type": "kl_of_the_moon"}, "rollout": {"n": 2}}}
    meta = {"loss_agg_mode": "token-mean", "adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True}
    with pytest.raises(StreamingConfigError) as info:
        engine_rules.actor_config_settings(raw["actor_rollout_ref"], meta)
    assert [one_line(str(info.value))] == [one_line(m) for m in engine_rules.config_refusals(raw, batch_meta=meta)]
    assert engine_rules.config_refusals(raw, batch_meta=None) == []  # not streamed: the worker does not run


# ----- the command's JSON line ----------------------------------------------------------------------------
def test_the_json_counts_the_variants_checked_at_learner_level(capsys):
    code = rc.main(["check", "--root", str(SWE), "--only", "grpo[shape=qwen3_30b_a3b,layout=1node"])
    report = json.loads(capsys.readouterr().out.strip())
    assert code == 0 and report["learner_checked"] == report["recipes"] == report["valid"] == 4  # the four modes
