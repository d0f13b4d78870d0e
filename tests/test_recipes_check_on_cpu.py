"""``thundersync recipes check`` on the shipped recipes (GPU recipes included) and on broken ones. CPU only.

1. Every variant of every shipped recipe composes with verl's config tree and passes every rule, the learner's
   included (``learner_checked``); the SWE-smith GPU recipes cover GRPO/OPD x 8B/30B-MoE x 1/2/4 nodes x the
   four modes.
2. A broken variant is refused and the message names the key: parallel sizes that do not tile the
   GPUs, unknown keys (typed and untyped sections), wrong types, bad ThunderSync / SWE values, the
   trainer's thundersync rules, unregistered names.
3. The launch script's overrides (run.sh, its hardware toggles included) compose and pass too.
4. Bad command-line arguments give a one-line usage error (exit 2); a broken recipe file gives exit 1
   and a one-line reason naming the key; a stray yaml is reported.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from thundersync_verl.recipes import check as rc

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SWE = RECIPES / "swe_smith"
SHAPES, LAYOUTS, MODES = {"qwen3_8b", "qwen3_30b_a3b"}, {"1node", "2nodes", "4nodes"}, {"sync", "async", "fully_async", "thundersync"}


def _run(argv: list[str], capsys) -> tuple[int, dict | None, list[str]]:
    code = rc.main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) <= 1, f"stdout must be one JSON line, got {lines}"
    return code, json.loads(lines[0]) if lines else None, [line for line in err.splitlines() if line.strip()]


@pytest.mark.slow
def test_every_shipped_recipe_variant_is_valid(capsys):
    code, report, err = _run(["check"], capsys)
    assert code == 0, "\n".join(err)
    assert report["recipes"] >= 8 and report["valid"] == report["recipes"] and report["invalid"] == 0
    assert report["learner_checked"] == report["recipes"]  # the learner's refusals ran on every variant
    assert report["unclassified"] == []
    for algo in ("grpo", "opd"):  # 2 shapes x 3 layouts x 4 modes each
        assert report["by_recipe"][f"swe_smith/{algo}"] == {"variants": 24, "valid": 24}
    assert {"cpu_tiny/grpo", "cpu_tiny/opd"} <= set(report["by_recipe"])
    assert {"MODEL_PATH", "DATA_DIR", "TEACHER_PATH"} <= set(report["env"])


def test_the_gpu_recipes_expand_to_every_shape_layout_and_mode():
    variants, unclassified = rc.find_variants(RECIPES)
    assert unclassified == []
    for algo in ("grpo", "opd"):
        choices = [dict(v.choices) for v in variants if v.recipe == SWE / f"{algo}.yaml"]
        assert {(c["shape"], c["layout"], c["mode"]) for c in choices} == \
            {(s, l, m) for s in SHAPES for l in LAYOUTS for m in MODES}


def _variant(algo="grpo", shape="qwen3_8b", layout="1node", mode="thundersync", *extra):
    return rc.Variant(SWE / f"{algo}.yaml", (("shape", shape), ("layout", layout), ("mode", mode)), tuple(extra))


BROKEN = [  # (variant, a key the refusal must name)
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3"),
     "actor_rollout_ref.actor.megatron: TP x PP x CP"),
    (_variant("grpo", "qwen3_8b", "2nodes", "sync", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=8",
              "actor_rollout_ref.actor.megatron.context_parallel_size=1"), "megatron.tensor_model_parallel_size"),
    (_variant("grpo", "qwen3_30b_a3b", "1node", "async", "actor_rollout_ref.actor.megatron.expert_model_parallel_size=3"),
     "actor_rollout_ref.actor.megatron.expert_model_parallel_size"),
    (_variant("opd", "qwen3_30b_a3b", "1node", "thundersync", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"),
     "actor_rollout_ref.rollout.n_gpus_per_node"),
    (_variant("grpo", "qwen3_8b", "1node", "sync", "+actor_rollout_ref.actor.megatron.tensor_parallel_size=2"),
     "actor_rollout_ref.actor.megatron.tensor_parallel_size: is not a key verl knows"),
    (_variant("grpo", "qwen3_8b", "1node", "sync", "+trainer.n_gpu_per_node=4"), "trainer.n_gpu_per_node: is not a key"),
    (_variant("grpo", "qwen3_8b", "1node", "sync", "actor_rollout_ref.actor.megatron.context_parallel_size=four"),
     "actor_rollout_ref.actor.megatron.context_parallel_size: must be int"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "data.train_batch_size=30"), "actor_rollout_ref.actor.ppo_mini_batch_size"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "++thundersync.chunk_size=0"), "thundersync.chunk_size must be"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "+thundersync.chunk_sise=4"), "thundersync.chunk_sise"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "swe.sandbox=kubernetes"), "swe.sandbox must be one of"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "thundersync.mode=sync"), "thundersync.mode"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "actor_rollout_ref.rollout.calculate_log_probs=false"),
     "actor_rollout_ref.rollout.calculate_log_probs"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "actor_rollout_ref.hybrid_engine=true"), "actor_rollout_ref.hybrid_engine"),
    (_variant("opd", "qwen3_8b", "1node", "thundersync", "distillation.distillation_loss.loss_mode=forward_kl_topk"),
     "distillation.distillation_loss.loss_mode=forward_kl_topk"),
    (_variant("grpo", "qwen3_8b", "1node", "thundersync", "actor_rollout_ref.rollout.agent.default_agent_loop=swe_agnt"),
     "actor_rollout_ref.rollout.agent.default_agent_loop"),
    (_variant("grpo", "qwen3_8b", "1node", "async", "actor_rollout_ref.rollout.checkpoint_engine.backend=pigeon"),
     "actor_rollout_ref.rollout.checkpoint_engine.backend"),
    (_variant("grpo", "qwen3_8b", "1node", "fully_async", "trainer.v1.separate_async.parameter_sync_step=3"),
     "trainer.v1.separate_async.parameter_sync_step"),
    (_variant("grpo", "qwen3_30b_a3b", "2nodes", "thundersync", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384"),
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu: = 16384 x 4"),
    (_variant("grpo", "qwen3_8b", "1node", "sync", "actor_rollout_ref.rollout.max_model_len=65536"),
     "actor_rollout_ref.rollout.max_model_len"),
    (_variant("opd", "qwen3_8b", "1node", "sync", "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=4"),
     "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size: = 4 must divide"),
]


@pytest.mark.slow  # composes every broken variant with verl's config tree (about a minute on 2 cores)
def test_broken_variants_are_refused_naming_the_key():
    verdicts = rc.check_variants([variant for variant, _ in BROKEN])
    for (variant, key), verdict in zip(BROKEN, verdicts):
        assert not verdict.valid, f"{variant.name(RECIPES)} was accepted"
        assert any(key in p for p in verdict.problems), f"{variant.name(RECIPES)}: no problem names {key!r}: {verdict.problems}"
        assert all("\n" not in p and not p.startswith("composition:") for p in verdict.problems), verdict.problems


def _run_sh(*args: str, **env: str) -> rc.Variant:
    """The variant (and overrides) ``run.sh`` would launch, read from its dry run."""
    out = subprocess.run(["bash", str(SWE / "run.sh"), *args], check=True, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1", **env}).stdout
    words = shlex.split(out)
    rest = words[words.index(next(w for w in words if w.startswith("--config-name="))) + 1:]
    recipe = SWE / f"{args[0]}.yaml"
    choices = tuple(tuple(w.split("=", 1)) for w in rest if w.split("=")[0] in ("shape", "layout", "mode"))
    return rc.Variant(recipe, choices, tuple(w for w in rest if w.split("=")[0] not in ("shape", "layout", "mode")))


@pytest.mark.slow  # runs run.sh three times and composes each launch
def test_the_launch_scripts_overrides_compose_and_pass():
    launches = [_run_sh("grpo", "qwen3_30b_a3b", "2nodes", "thundersync", "trainer.total_training_steps=5"),
                _run_sh("opd", "qwen3_30b_a3b", "1node", "fully_async", DEEPEP="1", CUDA_GRAPHS="0", WANDB_API_KEY="x"),
                _run_sh("grpo", "qwen3_8b", "4nodes", "sync", ATTN_BACKEND="flash", CPU_ADAM="1")]
    assert any("optimizer_cpu_offload=true" in e for e in launches[0].extra)  # the MoE delta is on by default
    assert any("moe_enable_deepep=true" in e for e in launches[1].extra)
    assert "actor_rollout_ref.rollout.enforce_eager=true" in launches[1].extra
    for verdict in rc.check_variants(launches):
        assert verdict.valid, f"{verdict.variant.name(RECIPES)}: {verdict.problems}"
    bad = subprocess.run(["bash", str(SWE / "run.sh"), "grpo", "qwen3_9b", "1node", "sync"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")


@pytest.mark.parametrize("argv", [["check", "--bogus"], [], ["lint"], ["check", "--root"], ["check", "--root", "/no/such/dir"]])
def test_bad_arguments_give_a_one_line_usage_error(argv, capsys):
    from thundersync_verl.cli import main

    code = main(["recipes", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "usage: thundersync recipes check" in err


def test_a_broken_recipe_file_fails_the_command_with_a_reason_naming_the_key(tmp_path, capsys):
    root = tmp_path / "recipes"
    shutil.copytree(SWE, root / "swe_smith", ignore=shutil.ignore_patterns("cpu_synthetic.yaml", "cpu_base"))
    shape = root / "swe_smith" / "shape" / "qwen3_8b.yaml"
    shape.write_text(shape.read_text().replace("context_parallel_size: 4 ", "context_parallel_size: 3 "))
    (root / "swe_smith" / "notes.yaml").write_text("note: not a recipe\n")
    code, report, err = _run(["check", "--root", str(root), "--only", "grpo[shape=qwen3_8b,layout=1node,mode=thundersync]"],
                             capsys)
    assert code == 1 and report["recipes"] == 1 and report["invalid"] == 1
    assert report["unclassified"] == ["swe_smith/notes.yaml"]
    invalid = [line for line in err if line.startswith("invalid ")]
    assert len(invalid) == 1 and "actor_rollout_ref.actor.megatron: TP x PP x CP = 1 x 1 x 3" in invalid[0]
    assert any(line.startswith("unclassified swe_smith/notes.yaml") for line in err)


def test_a_variant_hydra_cannot_compose_is_refused_not_raised():
    verdict, = rc.check_variants([_variant(mode="warp")])
    assert not verdict.valid and verdict.problems[0].startswith("composition:") and "warp" in verdict.problems[0]
