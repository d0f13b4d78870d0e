"""The learner-level refusals, as ONE table: evaluated by the streaming learner at its first step (facts read
from the live engine) and by ``thundersync recipes check`` before a launch (facts read from the composed config).

Why:
1. The streaming learner refuses settings it cannot stream exactly (``engines/megatron.py`` point 4) and verl's
   Megatron engine refuses its per-token-loss regime without ``use_remove_padding``; both used to surface only
   on a GPU node, minutes into a run, after Ray, the engines and the rollout pool had started. One table, two
   sources of facts: the learner reads them from the engine (``va.megatron_streaming_blockers``), the recipe
   check from the config (``facts_from_config``), and both print the same rule / why / fix message.
2. A rule is ``(name, engine, owner, refused(facts), rule, why, fix)``; ``rule``, ``why`` and ``fix`` are
   ``str.format`` templates over the facts. ``engine``: the learner kind it applies to (``any``: every one).
   ``owner``: ``STREAM`` rules are the streaming learner's (they apply where it runs: ``thundersync`` mode);
   ``VERL`` rules are verl's own engine rules (every mode), restated here with their source because verl raises
   them inside a live engine (the first training micro-batch), where nothing can call them earlier.
3. The facts are a plain dict (keys: ``FACTS``), so the table needs no engine, no verl and no GPU.
4. The streaming worker's actor-config validation (``actor_config_settings``) is the function the worker's
   ``stream_begin_batch`` calls, with the batch meta the trainer sends (``step.algorithm.begin_batch_meta``
   gives it for a config); the recipe check calls the same function with the composed config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from thundersync_verl.core.config_validation import balancing_loss_coeffs
from thundersync_verl.core.config_validation import config_value as _get
from thundersync_verl.core.errors import StreamingConfigError, rule_message

LEARNERS = {"fsdp": "fsdp", "fsdp2": "fsdp", "megatron": "megatron"}  # verl's engine key -> streaming learner
STREAM, VERL = "streaming learner", "verl engine"
FACTS = ("strategy", "virtual_pipeline_model_parallel_size", "model_chunks", "param_offload", "use_megatron_fsdp",
         "dynamic_context_parallel", "auxiliary_losses", "overlap_grad_reduce", "per_token_loss", "use_remove_padding")


@dataclass(frozen=True)
class EngineRule:
    name: str
    engine: str  # "any", or the learner kind (LEARNERS' values) it applies to
    owner: str  # STREAM (thundersync mode) or VERL (every mode)
    refused: Callable[[Mapping[str, Any]], bool]
    rule: str
    why: str
    fix: str

    def message(self, facts: Mapping[str, Any]) -> str:
        facts = dict(facts)
        return rule_message(self.rule.format_map(facts), self.why.format_map(facts), self.fix.format_map(facts))


def _vpp(f) -> bool:
    return f["virtual_pipeline_model_parallel_size"] not in (None, 1) or int(f.get("model_chunks", 1)) > 1


RULES: tuple[EngineRule, ...] = (
    EngineRule(
        "learner", "any", STREAM, lambda f: f["strategy"] not in LEARNERS,
        "no streaming learner for actor engine {strategy!r}",
        "the learner must know where the engine keeps the gradient and how it finalises a step",
        "use model_engine=dp (actor strategy fsdp/fsdp2) or model_engine=megatron; engines: " + str(sorted(LEARNERS))),
    EngineRule(
        "virtual_pipeline_model_parallel_size", "megatron", STREAM, _vpp,
        "streaming on Megatron does not support virtual pipeline stages (virtual_pipeline_model_parallel_size="
        "{virtual_pipeline_model_parallel_size})",
        "interleaved schedules split each call's micro-batches into groups per stage; streamed calls of any size "
        "have not been verified exact against verl's update here",
        "set actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=null (plain PP is supported)"),
    EngineRule(
        "param_offload", "megatron", STREAM, lambda f: bool(f["param_offload"]),
        "streaming on Megatron needs megatron.param_offload=false (got {param_offload})",
        "verl's engine context releases the grad buffer when it offloads parameters after each call, "
        "which would erase the gradient streamed so far",
        "set actor_rollout_ref.actor.megatron.param_offload=false (optimizer_offload may stay on)"),
    EngineRule(
        "use_megatron_fsdp", "megatron", STREAM, lambda f: bool(f["use_megatron_fsdp"]),
        "streaming on Megatron does not support use_megatron_fsdp={use_megatron_fsdp}",
        "Megatron-FSDP shards the grad buffer during backward; the streamed buckets assume DDP's flat buffer",
        "set actor_rollout_ref.actor.megatron.use_megatron_fsdp=false"),
    EngineRule(
        "dynamic_context_parallel", "megatron", STREAM, lambda f: bool(f["dynamic_context_parallel"]),
        "streaming on Megatron does not support dynamic_context_parallel={dynamic_context_parallel}",
        "verl's dynamic-CP scheduler re-deals every call's rows over the whole DP x CP plane and counts tokens per "
        "scheduled slot; streamed calls of any size have not been verified exact against verl's update",
        "set actor_rollout_ref.actor.megatron.dynamic_context_parallel=false (static context_parallel_size streams)"),
    EngineRule(
        "auxiliary_losses", "megatron", STREAM, lambda f: bool(f["auxiliary_losses"]),
        "streaming on Megatron does not support losses the schedule scales per call ({auxiliary_losses})",
        "Megatron scales the MoE router's aux / z loss and the MTP loss by the CALL's micro-batch count (or, per "
        "token, by the batch's token total at finalize), so in a streamed call they take the deferred normaliser "
        "and the fold coefficients instead: with this refusal lifted the streamed update misses the router term "
        "almost whole, 1400-9800x verl's fp32 floor (benchmarks/moe_aux_loss.py: tiny Qwen3-MoE, coefficient "
        "1e-3). aux_loss and global_aux_loss also balance the experts over ONE micro-batch's tokens, so a row's "
        "gradient depends on which rows share its micro-batch: regrouping the same rows moves verl's own update "
        "614-660x the floor (the router term alone by 26-80%), which no streamed grouping reproduces",
        "set moe_aux_loss_coeff=0 or moe_router_load_balancing_type=none (verl's default) and moe_z_loss_coeff=null "
        "(override_transformer_config), and actor_rollout_ref.model.mtp.enable_train=false"),
    EngineRule(
        "overlap_grad_reduce", "megatron", STREAM, lambda f: bool(f["overlap_grad_reduce"]),
        "streaming on Megatron needs override_ddp_config.overlap_grad_reduce=false (got {overlap_grad_reduce})",
        "overlapped reduction expects the same number of backward calls in every step; streamed steps vary",
        "remove overlap_grad_reduce from actor_rollout_ref.actor.megatron.override_ddp_config"),
    EngineRule(  # verl 0.9.1 workers/engine/megatron/transformer_impl.py: MegatronEngine.postprocess_micro_batch_func
        # raises this ValueError at the first training micro-batch (and _check_dcp_unsupported_features, at engine
        # build, its dynamic-CP twin); the engine's flag is set from actor_rollout_ref.model (engine_workers.py)
        "use_remove_padding", "megatron", VERL, lambda f: bool(f["per_token_loss"]) and not f["use_remove_padding"],
        "verl's Megatron engine: calculate_per_token_loss=True requires use_remove_padding=True (got "
        "use_remove_padding={use_remove_padding}; the per-token-loss regime is on at context_parallel_size > 1 "
        "and with dynamic_context_parallel)",
        "verl does not pass a padding_mask to the MoE router, so in BSHD it normalizes the aux/z loss by the "
        "padding-inclusive token count (B*S) while gradients are divided by the real token count",
        "set actor_rollout_ref.model.use_remove_padding=true (THD), or context_parallel_size=1 and "
        "dynamic_context_parallel=false"),
)


def refusals(facts: Mapping[str, Any], *, engine: str, owners: tuple[str, ...] = (STREAM, VERL)) -> list[EngineRule]:
    """The rules of ``engine`` (and ``any``) owned by ``owners`` that ``facts`` break, in table order."""
    return [r for r in RULES if r.engine in ("any", engine) and r.owner in owners and r.refused(facts)]


def raise_first(facts: Mapping[str, Any], *, engine: str, owners: tuple[str, ...] = (STREAM, VERL)) -> None:
    """Raise the first refusal as a ``StreamingConfigError`` (rule / why / fix)."""
    for rule in refusals(facts, engine=engine, owners=owners):
        raise StreamingConfigError(rule.message(facts))


# ----- facts from a composed config (the recipe check) -------------------------------------------------------
def facts_from_config(config: Any) -> dict:
    """The table's facts for a verl config (plain dict or DictConfig), as the engine would report them."""
    actor, model = _get(config, "actor_rollout_ref.actor"), _get(config, "actor_rollout_ref.model")
    m = _get(actor, "megatron", {}) or {}
    vpp = _get(m, "virtual_pipeline_model_parallel_size")
    otc, ddp = _get(m, "override_transformer_config", {}) or {}, _get(m, "override_ddp_config", {}) or {}
    dcp = bool(_get(m, "dynamic_context_parallel", False))
    return {
        "strategy": str(_get(actor, "strategy", "")),
        "virtual_pipeline_model_parallel_size": vpp,
        "model_chunks": int(vpp) if vpp is not None and int(vpp) > 1 else 1,  # one DDP chunk per virtual stage
        "param_offload": bool(_get(m, "param_offload", False)),
        "use_megatron_fsdp": bool(_get(m, "use_megatron_fsdp", False)),
        "dynamic_context_parallel": dcp,
        "auxiliary_losses": _auxiliary_losses(m, otc, model),
        "overlap_grad_reduce": bool(_get(ddp, "overlap_grad_reduce", False)),  # verl's DDP default: False
        "per_token_loss": int(_get(m, "context_parallel_size", 1)) > 1 or dcp
                          or bool(_get(otc, "calculate_per_token_loss", False)),
        "use_remove_padding": bool(_get(model, "use_remove_padding", False)),  # HFModelConfig.get(..., False)
    }


def _auxiliary_losses(megatron: Any, otc: Any, model: Any) -> str | None:
    """What ``va.megatron_auxiliary_losses`` would report. The router applies a load-balancing coefficient only for
    the loss ``moe_router_load_balancing_type`` names: verl 0.9.1 sets it to ``none`` on its Megatron-Bridge path
    (``provider_overrides`` in ``transformer_impl.py``) unless the recipe sets it; on the mbridge path
    (``vanilla_mbridge``) the model's bridge picks it (``none`` for Qwen-MoE, Mixtral and DeepSeek-V3,
    ``seq_aux_loss`` for GLM-4.5), so an MoE recipe there that names no type counts as on. The coefficient comes
    from the checkpoint (``router_aux_loss_coef``, 0.001 for Qwen3-MoE) unless the recipe sets it: unset counts as
    on wherever a balancing loss is. MoE recipe: expert parallel > 1, experts or ``moe_*`` keys in
    override_transformer_config."""
    found = []
    moe = int(_get(megatron, "expert_model_parallel_size", 1) or 1) > 1 or any(str(k).startswith(("moe_", "num_moe"))
                                                                               for k in otc)
    if moe:
        kinds = _get(otc, "moe_router_load_balancing_type")
        if kinds is None and not _get(megatron, "vanilla_mbridge", False):
            kinds = "none"  # verl's Megatron-Bridge provider_overrides
        aux = _get(otc, "moe_aux_loss_coeff")
        if kinds is not None:  # the type is known: only the loss it names takes a coefficient
            on = bool(balancing_loss_coeffs(kinds, 1.0 if aux is None else aux))
        else:  # the bridge's type, unknown here: any coefficient counts
            on = aux is None or any(float(c) != 0.0 for c in ([aux] if isinstance(aux, (int, float, str)) else aux))
        if on:
            found.append("moe_aux_loss_coeff=the checkpoint's router_aux_loss_coef (the recipe does not set it)"
                         if aux is None else f"moe_aux_loss_coeff={aux}")
        if _get(otc, "moe_z_loss_coeff"):
            found.append(f"moe_z_loss_coeff={_get(otc, 'moe_z_loss_coeff')}")
    if _get(model, "mtp.enable", False) and _get(model, "mtp.enable_train", False):
        found.append("mtp.enable_train=True")
    return ", ".join(found) or None


# ----- the streaming worker's actor-config validation --------------------------------------------------------
def actor_config_settings(actor_rollout_ref: Any, meta: Mapping[str, Any]):
    """``(settings, terms)``: what ``stream_begin_batch`` validates in the worker's ``actor_rollout_ref`` config
    for a batch ``meta``; raises ``StreamingConfigError`` naming the key."""
    from thundersync_verl.algos.sao.sao_loss import sao_settings
    from thundersync_verl.step.chunk_layout import IndependentTerms
    from thundersync_verl.step.stream_plan import settings_from_verl_config

    if meta.get("adv_estimator") == "sao":  # SAO's band mask is not a ratio-1 loss: its own check (sao_stream.py)
        settings = sao_settings(actor_rollout_ref, dict(meta))
    else:
        settings = settings_from_verl_config(actor_rollout_ref, **{k: meta[k] for k in SETTING_KEYS if k in meta})
    terms = IndependentTerms.from_actor_config(_get(actor_rollout_ref, "actor"))  # KL / entropy, as verl's ppo_loss
    return settings, terms


SETTING_KEYS = ("loss_agg_mode", "train_batch_size", "adv_estimator", "norm_adv_by_std_in_grpo", "rollout_is",
                "rollout_is_threshold", "rollout_is_batch_normalize")


def config_refusals(config: Any, *, batch_meta: Mapping[str, Any] | None) -> list[str]:
    """Every learner-level refusal of a composed config: verl's engine rules, and where the run streams (a
    ``batch_meta``: what the trainer sends ``stream_begin_batch``, ``step.algorithm.begin_batch_meta``) the
    streaming learner's rules and the worker's actor-config validation."""
    facts = facts_from_config(config)
    kind = LEARNERS.get(facts["strategy"], facts["strategy"])
    streams = batch_meta is not None
    out = [r.message(facts) for r in refusals(facts, engine=kind, owners=(STREAM, VERL) if streams else (VERL,))]
    if streams:
        try:
            actor_config_settings(_get(config, "actor_rollout_ref"), batch_meta)
        except StreamingConfigError as err:
            out.append(str(err))
    return out
