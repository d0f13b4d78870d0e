"""The rules ``thundersync recipes check`` applies to one composed recipe (a plain, resolved dict).

Why this module exists:
1. Each rule below is one a launch would hit late or never: verl's dataclass constructors and
   ``validate_config`` run inside Ray workers minutes into a job; a misspelt key is never reported
   at all (verl's untyped sections ignore it); parallel sizes that do not tile the GPUs fail when
   Megatron builds its process groups. Checked here, they fail in a second, naming the key.
2. Rules are owned where they are defined: verl's are called, not copied (its dataclasses through
   ``verl_adapter.config_check_api``), ThunderSync's come from ``config.py`` and the trainer. The
   few verl trainer asserts that need a live trainer are restated here, each citing its source. The learner's
   refusals (and verl's engine rules it meets at its first step) come from ``learner/engine_rules.py``, the table
   the streaming learner itself runs.
3. Every problem is one line: ``key: rule (why: ...; fix: ...)``, so the checker prints one line
   per invalid variant and a test can match the key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import importlib
import io
import re
import types
import typing
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

MISSING = "???"
PASS_THROUGH = {  # untyped sections whose keys verl hands on or reads without declaring them in its yaml
    "ray_kwargs.ray_init",  # ray.init(**ray_init)
    "reward.custom_reward_function.reward_kwargs",  # verl.trainer.ppo.reward: reward_fn_config.get("reward_kwargs")
}
LAUNCHER_KEYS = ("path", "files")  # a ??? value is allowed only for keys a launcher fills (paths, data files)
MODE_TRAINERS = {"sync": "sync", "async": "separate_async", "fully_async": "separate_async", "thundersync": "thundersync"}


def one_line(err: BaseException | str) -> str:
    """An exception (hydra, verl, ThunderSync rule/why/fix) as one line."""
    return re.sub(r"\s*\n\s*", " ", str(err)).strip()


def problem(key: str, rule: str, why: str, fix: str) -> str:
    return f"{key}: {rule} (why: {why}; fix: {fix})"


def _get(raw: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def check(raw: dict, facts: dict) -> list[str]:
    """Every rule, in the order a launch would meet them; ``facts`` collects sizes for the report."""
    found: list[str] = []
    for rule in (_missing_values, _unknown_keys_and_types, _verl_sections, _parallel_sizes, _batch_sizes,
                 _registered_names, _thundersync, _learner):
        try:
            found += [p for p in rule(raw, facts) if p not in found]  # the worker re-runs some trainer rules
        except Exception as err:  # a value an earlier rule refused (a str where an int goes) trips a later one
            if not found:
                found.append(f"{rule.__name__.strip('_')}: could not check ({type(err).__name__}: {one_line(err)})")
            break
    return found


def describe(facts: dict) -> str:
    keys = ("learner_gpus", "learner_dp", "rollout_gpus", "teacher_gpus", "gpus_per_node")
    return ", ".join(f"{k}={facts[k]}" for k in keys if k in facts)


# ----- values and keys -------------------------------------------------------------------------
def _missing_values(raw: dict, facts: dict) -> list[str]:
    """A ``???`` the recipe introduced (verl's own, in sections a run does not enable, are verl's business)."""
    base, out = _base_tree(str(raw.get("model_engine", "dp"))), []

    def walk(node: Any, verl: Any, path: str) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, verl.get(k) if isinstance(verl, Mapping) else None, f"{path}.{k}" if path else str(k))
        elif node == MISSING and verl != MISSING and not path.endswith(LAUNCHER_KEYS):
            out.append(problem(path, "has no value (???)", "verl reads it and no launcher fills it",
                               f"set {path} in the recipe"))
    walk(raw, base, "")
    return out


@lru_cache(maxsize=None)
def _base_tree(model_engine: str) -> dict:
    """verl's own ppo_trainer config for this model engine, resolved: the keys verl knows."""
    from omegaconf import OmegaConf

    from thundersync_verl import verl_adapter as va

    cfg = va.compose_ppo_config([f"model_engine={model_engine}"])
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
    except Exception:  # an interpolation of verl's that needs a recipe value: compare unresolved
        return OmegaConf.to_container(cfg, resolve=False)


@lru_cache(maxsize=None)
def _target_class(target: str):
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if dataclasses.is_dataclass(cls) else None


@lru_cache(maxsize=None)
def _field_types(cls) -> dict[str, Any]:
    """{field: annotation}; an annotation that cannot be evaluated counts as Any."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(cls)}


def _accepts(value: Any, ann: Any) -> bool:
    """Whether a yaml value fits a dataclass annotation; types this does not model are left to verl."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is Any or value == MISSING:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, a) for a in args)
    if ann is type(None):
        return value is None
    simple = {bool: lambda v: isinstance(v, bool), int: lambda v: isinstance(v, int) and not isinstance(v, bool),
              float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), str: lambda v: isinstance(v, str)}
    if ann in simple:
        return simple[ann](value)
    if ann in (list, tuple) or origin in (list, tuple, Sequence):
        return isinstance(value, (list, tuple))
    if ann is dict or origin in (dict, Mapping) or dataclasses.is_dataclass(ann):
        return isinstance(value, Mapping)
    if origin is typing.Literal:
        return value in args
    if isinstance(ann, type) and issubclass(ann, enum.Enum):
        return value in {m.value for m in ann} or value in ann.__members__
    return True


def _type_name(ann: Any) -> str:
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def _dataclass_in(ann: Any):
    """The dataclass an annotation names (``X``, ``Optional[X]``), and for ``dict[str, X]`` the value class."""
    if dataclasses.is_dataclass(ann):
        return ann, False
    args = [a for a in typing.get_args(ann) if a is not type(None)]
    if typing.get_origin(ann) in (dict, Mapping) and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1], True
    if len(args) == 1 and dataclasses.is_dataclass(args[0]):
        return args[0], False
    return None, False


def _unknown_keys_and_types(raw: dict, facts: dict) -> list[str]:
    """Keys verl does not know (typed sections: the dataclass's fields; untyped: verl's own yaml tree)."""
    from thundersync_verl.verl_adapter.launch_check import OWN_SECTIONS

    base = _base_tree(str(raw.get("model_engine", "dp")))
    out: list[str] = []
    _walk({k: v for k, v in raw.items() if k not in OWN_SECTIONS}, base, None, "", out)
    return out


def _walk(node: Mapping, base: Any, cls, path: str, out: list[str]) -> None:
    hints = _field_types(cls) if cls else {}
    free = (cls is None and isinstance(base, Mapping) and not base) or path in PASS_THROUGH or bool(cls and len(hints) <= 1)
    for key, value in node.items():
        where = f"{path}.{key}" if path else str(key)
        sub_base = base.get(key) if isinstance(base, Mapping) else None
        if key == "_target_" or free:
            continue
        known = key in hints or (isinstance(base, Mapping) and key in base) or (cls is None and base is None) \
            or where in PASS_THROUGH
        if not known:
            names = sorted(n for n in set(hints) | set(base if isinstance(base, Mapping) else ()) if n != "_target_")
            close = difflib.get_close_matches(str(key), names, n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else f"{path or 'the top level'} has: {', '.join(names[:12])}" \
                + (", ..." if len(names) > 12 else "")
            out.append(problem(where, "is not a key verl knows", "verl would ignore it and keep its default",
                               f"check the spelling ({hint})"))
            continue
        ann = hints.get(key, Any)
        if value != sub_base and not _accepts(value, ann):  # verl's own defaults are verl's business
            out.append(problem(where, f"must be {_type_name(ann)}, got {value!r}",
                               f"{cls.__name__}.{key} is typed {_type_name(ann)}", "write a value of that type"))
            continue
        if isinstance(value, Mapping):
            sub_cls, per_item = _dataclass_in(ann)
            if per_item:
                for name, item in value.items():
                    if isinstance(item, Mapping):
                        _walk(item, (sub_base or {}).get(name), _target_class(item.get("_target_", "")) or sub_cls,
                              f"{where}.{name}", out)
                continue
            if ann is not Any and sub_cls is None and hints:  # a dict-typed field is free-form
                continue
            own = _target_class(value["_target_"]) if isinstance(value.get("_target_"), str) else None
            _walk(value, sub_base, own or sub_cls, where, out)


# ----- verl's own rules ------------------------------------------------------------------------
def _verl_sections(raw: dict, facts: dict) -> list[str]:
    """verl's dataclasses built from the sections its workers build them from, and ``validate_config``."""
    from omegaconf import OmegaConf

    from thundersync_verl import verl_adapter as va

    api, cfg = va.config_check_api(), OmegaConf.create(raw)
    sections = ["actor_rollout_ref.actor", "actor_rollout_ref.rollout", "actor_rollout_ref.rollout.checkpoint_engine",
                "algorithm"] + (["distillation"] if _get(raw, "distillation.enabled") else [])
    out = []
    for key in sections:
        try:
            api.omega_conf_to_dataclass(OmegaConf.select(cfg, key))
        except Exception as err:
            out.append(f"{key}: {one_line(err)}")
    if out:
        return out
    if api.need_critic(cfg) and str(OmegaConf.select(cfg, "critic.model.path", default="")).startswith("<"):
        cfg.critic.model.pop("_target_", None)  # the critic's HF model loads at launch; its path is a placeholder here
        facts["critic_model_unloaded"] = True
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # validate_config prints a success line
            api.validate_config(cfg, use_reference_policy=bool(api.need_reference_policy(cfg)),
                                use_critic=bool(api.need_critic(cfg)))
    except Exception as err:
        out.append(f"verl validate_config: {one_line(err)}")
    return out


# ----- GPUs, parallel sizes, batches -----------------------------------------------------------
def _learner_grid(raw: dict, facts: dict) -> list[str]:
    """Megatron: TP x PP x CP tiles the learner GPUs, EP x ETP x PP tiles them for the MoE layers."""
    per_node, nodes = int(_get(raw, "trainer.n_gpus_per_node")), int(_get(raw, "trainer.nnodes"))
    learner = per_node * nodes
    facts["learner_gpus"] = learner
    actor, where = _get(raw, "actor_rollout_ref.actor"), "actor_rollout_ref.actor"
    gpus = f"the {learner} learner GPUs (trainer.n_gpus_per_node x trainer.nnodes = {per_node} x {nodes})"
    if actor.get("strategy") != "megatron":
        sp = int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
        facts["learner_dp"] = learner // sp if learner % sp == 0 else None
        return [] if learner % sp == 0 else [problem(
            f"{where}.ulysses_sequence_parallel_size", f"= {sp} must divide {gpus}",
            "each sequence-parallel group is a set of whole GPUs", "change the size or the learner GPU count")]
    m = actor["megatron"]
    tp, pp, cp = (int(m[k]) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    ep, etp = int(m.get("expert_model_parallel_size") or 1), int(m.get("expert_tensor_parallel_size") or tp)
    out = []
    if learner % (tp * pp * cp):
        out.append(problem(f"{where}.megatron", f"TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp} must divide {gpus}",
                           "each data-parallel replica of the learner is a whole TP x PP x CP grid of GPUs",
                           "change tensor/pipeline/context_parallel_size or the learner GPU count"))
    if per_node % tp:
        out.append(problem(f"{where}.megatron.tensor_model_parallel_size", f"= {tp} must divide trainer.n_gpus_per_node = {per_node}",
                           "a tensor-parallel group all-reduces every layer and must sit inside one node's NVLink domain",
                           "lower tensor_model_parallel_size or give each node more learner GPUs"))
    if learner % (ep * etp * pp):
        out.append(problem(f"{where}.megatron.expert_model_parallel_size", f"EP x ETP x PP = {ep} x {etp} x {pp} must divide {gpus}",
                           "Megatron lays the MoE layers' expert grid over the same GPUs as the dense grid",
                           "choose an expert_model_parallel_size that divides learner GPUs / (ETP x PP)"))
    facts["learner_dp"] = None if out else learner // (tp * pp * cp)
    return out


def _serving_pools(raw: dict, facts: dict) -> list[str]:
    """vLLM replicas (TP x DP x PP GPUs each) tile every pool that serves them, one node at a time."""
    rollout, out = _get(raw, "actor_rollout_ref.rollout"), []
    world = int(rollout["tensor_model_parallel_size"]) * int(rollout.get("data_parallel_size", 1)) * \
        int(rollout.get("pipeline_model_parallel_size", 1))
    pools = []
    hybrid = bool(_get(raw, "actor_rollout_ref.hybrid_engine", True)) or _get(raw, "trainer.v1.trainer_mode") == "sync"
    if hybrid:
        pools.append(("trainer.n_gpus_per_node", int(_get(raw, "trainer.n_gpus_per_node"))))
    standalone = int(rollout.get("nnodes") or 0) * int(rollout.get("n_gpus_per_node") or 0)
    facts["rollout_gpus"] = standalone
    if standalone:
        pools.append(("actor_rollout_ref.rollout.n_gpus_per_node", int(rollout["n_gpus_per_node"])))
    teacher = _get(raw, "distillation.teacher_models.teacher_model.inference") if _get(raw, "distillation.enabled") else None
    facts["teacher_gpus"] = int(_get(raw, "distillation.n_gpus_per_node", 0)) * int(_get(raw, "distillation.nnodes", 0)) \
        if teacher else 0
    for key, gpus in pools:
        if gpus % world:
            out.append(problem(key, f"= {gpus} GPUs per node is not a multiple of a rollout replica's TP x DP x PP = {world}",
                               "each vLLM replica needs whole GPUs of one node", "change actor_rollout_ref.rollout."
                               "tensor_model_parallel_size or the pool size"))
    if teacher and int(_get(raw, "distillation.n_gpus_per_node")) % int(teacher["tensor_model_parallel_size"]):
        out.append(problem("distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size",
                           f"= {teacher['tensor_model_parallel_size']} must divide distillation.n_gpus_per_node",
                           "each teacher replica needs whole GPUs of one node", "change either size"))
    facts["gpus_per_node"] = int(_get(raw, "trainer.n_gpus_per_node")) + int(rollout.get("n_gpus_per_node") or 0) * \
        (standalone > 0) + int(_get(raw, "distillation.n_gpus_per_node", 0)) * bool(teacher)
    return out


def _parallel_sizes(raw: dict, facts: dict) -> list[str]:
    return _learner_grid(raw, facts) + _serving_pools(raw, facts)


def _batch_sizes(raw: dict, facts: dict) -> list[str]:
    """Batches split evenly into mini-batches and over data-parallel ranks; the context fits the rollout."""
    actor, rollout = _get(raw, "actor_rollout_ref.actor"), _get(raw, "actor_rollout_ref.rollout")
    batch, mini, n, dp = int(_get(raw, "data.train_batch_size")), int(actor["ppo_mini_batch_size"]), int(rollout["n"]), \
        facts.get("learner_dp")
    out = []
    if batch % mini:
        out.append(problem("actor_rollout_ref.actor.ppo_mini_batch_size", f"= {mini} must divide data.train_batch_size = {batch}",
                           "every optimizer step of a batch must see the same number of prompts", "change either size"))
    if dp and (mini * n) % dp:
        out.append(problem("actor_rollout_ref.actor.ppo_mini_batch_size", f"x rollout.n = {mini * n} trajectories must split "
                           f"evenly over the learner's {dp} data-parallel ranks", "each rank trains an equal share of a "
                           "mini-batch", "change ppo_mini_batch_size, rollout.n or the learner layout"))
    if _get(raw, "trainer.v1.trainer_mode") == "separate_async":  # asserted in verl's PPOTrainerSeparateAsync.__init__
        step = int(_get(raw, "trainer.v1.separate_async.parameter_sync_step"))
        if batch != step * mini:
            out.append(problem("trainer.v1.separate_async.parameter_sync_step", f"x ppo_mini_batch_size = {step} x {mini} "
                               f"must equal data.train_batch_size = {batch}", "verl's separate_async trainer asserts it",
                               "set ppo_mini_batch_size = train_batch_size / parameter_sync_step"))
        if not facts.get("rollout_gpus"):
            out.append(problem("actor_rollout_ref.rollout.nnodes", "must be >= 1 with n_gpus_per_node >= 1",
                               "verl's separate_async trainer generates on a standalone rollout pool", "declare the pool"))
        if _get(raw, "actor_rollout_ref.rollout.checkpoint_engine.backend") == "naive":
            out.append(problem("actor_rollout_ref.rollout.checkpoint_engine.backend", "must not be naive",
                               "naive copies weights inside the learner process; separate_async pushes them to another pool",
                               "use nccl (or nixl) on GPUs, cpu_channel on CPUs"))
    context = int(_get(raw, "data.max_prompt_length")) + int(_get(raw, "data.max_response_length"))
    out += _longest_trajectory_fits(raw, context)
    limit = rollout.get("max_model_len")
    if limit is not None and context > int(limit):
        out.append(problem("actor_rollout_ref.rollout.max_model_len", f"= {limit} is below max_prompt_length + "
                           f"max_response_length = {context}", "a trajectory that reaches its length limit would not "
                           "fit the engine's context", "raise max_model_len or lower the data lengths"))
    return out


def _longest_trajectory_fits(raw: dict, context: int) -> list[str]:
    """With token-packed micro-batches, one micro-batch (per-GPU tokens x CP or SP) must hold the longest trajectory."""
    actor = _get(raw, "actor_rollout_ref.actor")
    if not actor.get("use_dynamic_bsz"):
        return []
    split = int(actor["megatron"]["context_parallel_size"]) if actor.get("strategy") == "megatron" else \
        int(actor.get("ulysses_sequence_parallel_size", 1) or 1)
    out = []
    for key in ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"):
        per_gpu = _get(raw, key)
        if per_gpu is not None and int(per_gpu) * split < context:
            out.append(problem(key, f"= {per_gpu} x {split} (context/sequence parallel) is below max_prompt_length + "
                               f"max_response_length = {context}", "verl packs micro-batches by tokens and asserts that "
                               "the longest sequence fits one", f"raise it to at least {-(-context // split)}"))
    return out


# ----- names and ThunderSync -------------------------------------------------------------------
def _registered_names(raw: dict, facts: dict) -> list[str]:
    """Names verl looks up in a registry at launch: trainer mode, rollout engine, agent loop, weight transport."""
    from thundersync_verl import verl_adapter as va

    api, out = va.config_check_api(), []
    names = [("trainer.v1.trainer_mode", api.trainer_modes()), ("actor_rollout_ref.rollout.name", api.rollouts()),
             ("actor_rollout_ref.rollout.agent.default_agent_loop", api.agent_loops())]
    if _get(raw, "distillation.enabled"):
        names.append(("distillation.teacher_models.teacher_model.inference.name", api.rollouts()))
    for key, known in names:
        if _get(raw, key) not in known:
            out.append(problem(key, f"= {_get(raw, key)!r} is not registered with verl", "verl looks it up by name at "
                               "launch", f"use one of {sorted(known)}, or import the module that registers it"))
    backend = _get(raw, "actor_rollout_ref.rollout.checkpoint_engine.backend")
    if backend not in api.checkpoint_engines() and f"{backend}_checkpoint_engine" not in api.checkpoint_engines_unimportable():
        out.append(problem("actor_rollout_ref.rollout.checkpoint_engine.backend", f"= {backend!r} is not a verl "
                           "checkpoint engine", "it moves the learner's weights to the rollout pool",
                           f"use one of {sorted(api.checkpoint_engines())} or nccl/nixl on GPU nodes"))
    return out


def _thundersync(raw: dict, facts: dict) -> list[str]:
    """The rules the driver runs before ``ray.init`` (``launch_check.check_run_config``: the project's sections
    in every mode, patch 8's refusal, the trainer's own rules in thundersync mode), and the mode flag's pair."""
    from thundersync_verl.verl_adapter import launch_check
    from thundersync_verl.config import ThunderSyncConfig

    own = [one_line(err) for err in launch_check.own_section_errors(raw)]
    if own:
        return own
    ts = ThunderSyncConfig.from_verl(raw)
    trainer_mode = _get(raw, "trainer.v1.trainer_mode")
    if MODE_TRAINERS[ts.mode] != trainer_mode:
        return [problem("thundersync.mode", f"= {ts.mode} but trainer.v1.trainer_mode = {trainer_mode}", "the reports and "
                        "trainers read thundersync.mode", f"select the mode with mode={ts.mode} (it sets both)")]
    try:
        return [one_line(err) for err in launch_check.run_config_errors(raw)]
    except Exception as err:
        return [one_line(err)]


def _learner(raw: dict, facts: dict) -> list[str]:
    """The learner-level refusals (``learner/engine_rules.py``, the table the streaming learner runs at its first
    step): verl's engine rules in every mode; in thundersync mode also the streaming learner's rules and the
    worker's actor-config validation (``stream_begin_batch``). ``facts["learner_checked"]``: they ran."""
    from omegaconf import OmegaConf

    from thundersync_verl.learner import engine_rules
    from thundersync_verl.step.algorithm import begin_batch_meta

    meta = begin_batch_meta(OmegaConf.create(raw)) if _get(raw, "trainer.v1.trainer_mode") == "thundersync" else None
    out = [one_line(message) for message in engine_rules.config_refusals(raw, batch_meta=meta)]
    facts["learner_checked"] = True
    return out
