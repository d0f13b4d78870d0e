"""The plugin's config rules run on verl's driver, before ``ray.init``, in every mode (``launch_check.py``,
``verl_adapter.patches`` patch 9).

Configs are composed from the CPU recipe with hydra's compose API, as ``main_ppo --config-path ... mode=...``
composes them; each refusal must be one ``StreamingConfigError`` in rule / why / fix form naming the key and
its fix. The driver's own ``main`` (hydra's wrapper removed) is run with ``run_ppo`` replaced, so a refused
config is shown never to reach ``ray.init`` and an accepted one to reach it. The real launch is
``tests/e2e/test_launch_refusal_main_ppo_on_cpu.py``.
"""

from __future__ import annotations

import pytest

from thundersync_verl.core import StreamingConfigError
from thundersync_verl.demo import recipe_dir
from thundersync_verl.verl_adapter.launch_check import check_run_config

MODES = sorted(p.stem for p in (recipe_dir() / "mode").glob("*.yaml"))
BAD = [  # (override, the key the refusal names, text of its fix)
    ("thundersync.chunk_size=0", "thundersync.chunk_size", "thundersync.chunk_size=8"),
    ("thundersync.env.max_tool_turns=-1", "thundersync.env.max_tool_turns", "thundersync.env.max_tool_turns=3"),
    ("thundersync.opd.granularity=group", "thundersync.opd.granularity", "set thundersync.opd.granularity to one of"),
    ("+thundersync.chunk_sise=4", "thundersync.chunk_sise", "rename thundersync.chunk_sise to thundersync.chunk_size"),
    ("+thundersync.env.max_tool_turn=2", "thundersync.env.max_tool_turn", "to thundersync.env.max_tool_turns"),
]
NOT_STREAMABLE = [  # settings verl's sync trainer takes but the streaming trainer cannot stream: (overrides, key, fix)
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov"], "actor_rollout_ref.actor.policy_loss.loss_mode",
     "set actor_rollout_ref.actor.policy_loss.loss_mode to one of"),
    (["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_batch_normalize=true"],
     "algorithm.rollout_correction.rollout_is_batch_normalize", "rollout_is_batch_normalize"),
    (["actor_rollout_ref.rollout.calculate_log_probs=false"], "thundersync.learner_forward=fused",
     "set actor_rollout_ref.rollout.calculate_log_probs=true"),
    (["thundersync.deterministic=true", "distillation.enabled=true"], "thundersync.deterministic",
     "set thundersync.deterministic=false"),
]


def compose(*overrides: str, recipe: str = "grpo", mode: str = "sync"):
    from hydra import compose as hydra_compose, initialize_config_dir

    folder = recipe_dir() / recipe if (recipe_dir() / recipe).is_dir() else recipe_dir()
    base = ["data.train_files=x", "data.val_files=y", "actor_rollout_ref.model.path=z", f"mode={mode}"]
    with initialize_config_dir(config_dir=str(folder), version_base=None):
        return hydra_compose(config_name=recipe, overrides=base + list(overrides))


def refusal(config) -> str:
    with pytest.raises(StreamingConfigError) as refused:
        check_run_config(config)
    return str(refused.value)


def assert_names(message: str, key: str, fix: str) -> None:
    rule, why, fix_line = message.split("\n")  # ONE error: rule, why, fix
    assert key in rule, message
    assert why.startswith("  why: ") and fix_line.startswith("  fix: "), message
    assert fix in fix_line, message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("override, key, fix", BAD, ids=[b[0] for b in BAD])
def test_a_bad_or_unknown_thundersync_key_is_refused_in_every_mode(mode, override, key, fix):
    assert_names(refusal(compose(override, mode=mode)), key, fix)


@pytest.mark.parametrize("overrides, key, fix", NOT_STREAMABLE, ids=[n[1] for n in NOT_STREAMABLE])
def test_a_setting_the_streaming_trainer_cannot_stream_is_refused_in_thundersync_mode_only(overrides, key, fix):
    recipe = "opd" if "distillation.enabled=true" in overrides else "grpo"
    overrides = [o for o in overrides if o != "distillation.enabled=true"]
    assert_names(refusal(compose(*overrides, recipe=recipe, mode="thundersync")), key, fix)
    check_run_config(compose(*overrides, recipe=recipe, mode="sync"))  # verl's sync trainer takes it


def test_a_reward_model_with_reward_in_agent_loop_is_refused_on_the_driver():
    config = compose("thundersync.reward_in_agent_loop=true", "reward.reward_model.enable=true", mode="async")
    assert_names(refusal(config), "thundersync.reward_in_agent_loop", "set thundersync.reward_in_agent_loop=false")


@pytest.mark.parametrize("mode", MODES)
def test_tail_batching_runs_in_thundersync_mode_and_is_refused_where_verls_trainer_would_ignore_it(mode):
    config = compose("thundersync.tail.eta=1.5", mode=mode)
    if mode == "thundersync":
        check_run_config(config)
    else:
        assert_names(refusal(config), "thundersync.tail.eta=1.5", "use mode=thundersync, or set thundersync.tail.eta=1")


@pytest.mark.parametrize("overrides, recipe, clash", [
    (["thundersync.deterministic=true"], "grpo", "thundersync.deterministic=true"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=4"], "grpo", "2 mini-batches x 1 epochs"),
    ([], "opd", "algorithm 'opd'"),
])
def test_tail_batching_refuses_what_it_cannot_keep_whole(overrides, recipe, clash):
    message = refusal(compose("thundersync.tail.eta=1.5", *overrides, recipe=recipe, mode="thundersync"))
    assert_names(message, clash, "set thundersync.tail.eta=1")


def test_settings_refused_by_several_rules_are_named_in_one_error():
    """launch_check point 6: tail batching outside thundersync mode and a LoRA adapter verl's push would drop are two
    rules' refusals; one launch names both, each with its key and fix."""
    config = compose("thundersync.tail.eta=1.5", "actor_rollout_ref.model.lora_rank=8", mode="async")
    message = refusal(config)
    head, *rest = message.split("\n")
    assert head.startswith("2 settings are refused")
    first = "\n".join(line[4:] for line in rest[:3])  # "[1] " / four spaces: each refusal's own three lines
    second = "\n".join(line[4:] for line in rest[3:])
    assert_names(first, "actor_rollout_ref.rollout.name=hf_cpu", "mode=sync or mode=thundersync")
    assert_names(second, "thundersync.tail.eta=1.5", "use mode=thundersync, or set thundersync.tail.eta=1")
    from omegaconf import OmegaConf

    from thundersync_verl.recipes.rules import _thundersync

    assert len(_thundersync(OmegaConf.to_container(config, resolve=True), {})) == 2  # the recipe check lists both


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rollout", ["hf_cpu", "replay"])
def test_lora_on_a_cpu_rollout_runs_where_the_adapter_is_pushed_and_is_refused_where_verl_drops_it(mode, rollout):
    """Sync (verl's naive sync) and ThunderSync (its learner's push) bring the adapter to the CPU rollout, which
    merges it; verl's checkpoint-engine push in async / fully_async sends the base weights only."""
    config = compose("actor_rollout_ref.model.lora_rank=8", f"actor_rollout_ref.rollout.name={rollout}", mode=mode)
    if mode in ("sync", "thundersync"):
        check_run_config(config)
    else:
        assert_names(refusal(config), "actor_rollout_ref.rollout.name=" + rollout, "mode=sync or mode=thundersync")


@pytest.mark.parametrize("overrides", [["actor_rollout_ref.model.lora.rank=8"],
                                       ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.strategy=megatron"]])
def test_lora_the_cpu_rollout_cannot_merge_is_refused_naming_the_fsdp_key(overrides):
    config = compose(*overrides, mode="sync")
    assert_names(refusal(config), "actor_rollout_ref.rollout.name=hf_cpu", "actor_rollout_ref.model.lora_rank=R")


def test_lora_in_thundersync_mode_on_another_rollout_needs_verls_merged_push():
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.rollout.name=vllm"]
    assert_names(refusal(compose(*lora, mode="thundersync")), "actor_rollout_ref.rollout.name=vllm",
                 "actor_rollout_ref.model.lora.merge=true")
    check_run_config(compose(*lora, "actor_rollout_ref.model.lora.merge=true", mode="thundersync"))
    check_run_config(compose(*lora, mode="async"))  # verl's own push to verl's own rollout: not this plugin's call


def test_lora_buckets_are_planned_at_the_adapters_size(tiny_random_lm):
    """Only the adapter carries a gradient (``bucket_check`` point 5): rank 8 on the tiny model's 14 linear modules."""
    from thundersync_verl.verl_adapter import bucket_check

    plans = []
    for lora in ([], ["actor_rollout_ref.model.lora_rank=8"]):
        config = compose(*lora, mode="thundersync")
        config.actor_rollout_ref.model.path = str(tiny_random_lm)
        plans.append(bucket_check.planned_buckets(config))
    assert plans[1].bucket_bytes == 4 * 8192 < plans[0].bucket_bytes


@pytest.mark.parametrize("recipe", ["grpo", "opd", "sao"])
@pytest.mark.parametrize("mode", MODES)
def test_every_cpu_recipe_passes_in_every_mode(recipe, mode):
    check_run_config(compose(recipe=recipe, mode=mode))


@pytest.fixture
def driver(monkeypatch):
    """verl's ``main_ppo.main`` without hydra's wrapper, and the configs it handed to ``run_ppo`` (which would
    call ``ray.init``; here it only records)."""
    from verl.trainer import main_ppo

    started = []
    monkeypatch.setattr(main_ppo, "run_ppo", lambda config, task_runner_class: started.append(config))
    return main_ppo.main.__wrapped__, started


def test_the_driver_refuses_before_run_ppo_with_one_unchained_error(driver):
    from thundersync_verl.verl_adapter.patches import APPLIED

    main, started = driver
    assert "launch_config_check" in APPLIED  # the plugin applied patch 9 on ``import verl``
    with pytest.raises(StreamingConfigError) as refused:
        main(compose("thundersync.chunk_size=0", mode="sync"))
    assert not started, "a refused config reached run_ppo (ray.init)"
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    assert_names(str(refused.value), "thundersync.chunk_size", "thundersync.chunk_size=8")


@pytest.mark.parametrize("mode", MODES)
def test_the_driver_hands_a_valid_config_to_run_ppo(driver, mode):
    main, started = driver
    main(compose(mode=mode))
    assert len(started) == 1


def test_the_recipe_check_calls_verls_own_validate_config():
    """``thundersync recipes check`` runs ``check_run_config`` itself; its verl rule stays verl's alone."""
    import verl.utils
    import verl.utils.config

    from thundersync_verl import verl_adapter as va

    patched = verl.utils.config.validate_config
    assert verl.utils.validate_config is patched
    assert va.config_check_api().validate_config is patched.__wrapped__


# ----- the learner's planned bucket peak (verl_adapter/bucket_check.py) ------------------------------------------
def test_a_budget_below_the_planned_bucket_peak_is_refused_at_launch(monkeypatch):
    from thundersync_verl.verl_adapter import bucket_check

    monkeypatch.setattr(bucket_check, "model_numel", lambda path: 1000)  # 4,000 B buckets on one CPU rank
    config = compose("thundersync.memory_budget_bytes=8000", mode="thundersync")  # rollout.n buckets do not fit
    n = int(config.actor_rollout_ref.rollout.n)
    assert_names(refusal(config), "thundersync.memory_budget_bytes=8000",
                 f"raise thundersync.memory_budget_bytes to at least {n * 4000}")
    check_run_config(compose(f"thundersync.memory_budget_bytes={n * 4000}", mode="thundersync"))  # one group fits


def test_host_buckets_beyond_the_host_memory_are_refused_at_launch(monkeypatch):
    from thundersync_verl.verl_adapter import bucket_check

    monkeypatch.setattr(bucket_check, "model_numel", lambda path: 1000)
    monkeypatch.setattr(bucket_check, "available_host_bytes", lambda: 10_000)
    config = compose("thundersync.bucket_device=host", mode="thundersync")  # unbudgeted: the whole batch's buckets
    assert_names(refusal(config), "thundersync.bucket_device=host", "lower thundersync.memory_budget_bytes")
    mem = bucket_check.planned_buckets(config)
    assert mem.storage == "host" and mem.peak_bytes > 10_000
    assert bucket_check.planned_buckets(compose(mode="thundersync")).storage == "device"  # auto on a CPU learner
