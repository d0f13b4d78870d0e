"""LoRA on the CPU rollout backends (``hf_cpu``, ``replay``): the adapter verl pushes, merged into the served weights.

Why:
1. verl 0.9.1 trains LoRA (``actor_rollout_ref.model.lora_rank > 0``) with peft on its FSDP2 engine and pushes a
   LoRA actor's weights under peft's names, not the model's. Its naive sync (Sync mode) sends the adapter's tensors
   (``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight``) with the peft config, after the base weights
   under ``<module>.base_layer.weight`` when the rollout started from dummy weights; its checkpoint-engine push
   sends the base weights under the ``base_layer`` names and drops the adapter (ThunderSync's learner sends the
   adapter there instead: ``learner/streaming_worker.py``). A server that copies tensors by name into its HF model
   failed at the first of them (``KeyError``).
2. ``LoraMerger.translate`` turns any such push into the model's own tensors: a ``base_layer`` tensor is the
   module's base weight (kept), an adapter tensor replaces the module's ``A`` or ``B``, and every module whose base
   or adapter changed is sent as ``W = W_base + s * (B @ A)``, ``s = lora_alpha / r`` (``/ sqrt(r)`` with rslora),
   computed in float32: the layer peft runs on the learner (``base(x) + s * B(A(x))``) with the adapter folded in.
   Names the model already has pass through unchanged (full weights, or verl's merged ones with ``lora.merge``).
3. A module's base is copied from the model the first time its adapter arrives (no merge has written into it yet),
   or taken from a base push; every push re-merges from it, so no rounding of earlier versions accumulates.
   Memory: one copy of each adapted module's base weight.
4. The scale comes from the peft config verl passes with a naive push, else from verl's model config the server was
   built with (``lora_rank`` / ``lora_alpha``, or the ``adapter_config.json`` of ``lora_adapter_path``): the
   settings verl builds the learner's adapter from. What a merge into a linear weight cannot express (DoRA, per-module
   rank or alpha patterns, ``fan_in_fan_out`` layers, an adapter bias, embedding adapters) is refused with the rule,
   why and fix.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from thundersync_verl.core.errors import StreamingConfigError, StreamingInputError, rule_message

CPU_ROLLOUTS = ("hf_cpu", "replay")  # the rollout backends that merge a pushed adapter (hf_cpu, replay servers)
PEFT_PREFIX = "base_model.model."  # peft's wrapper prefix on every adapter name
BASE_LAYER = ".base_layer."
ADAPTER_PARTS = {"lora_A": "A", "lora_B": "B"}
REFUSED_NAME_PARTS = ("lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", ".lora_bias")


@dataclass(frozen=True)
class LoraSpec:
    """What the merge needs from the adapter's config: ``W + scaling * (B @ A)``."""

    rank: int
    alpha: float
    use_rslora: bool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @classmethod
    def from_peft_config(cls, config: dict) -> "LoraSpec":
        """A peft ``LoraConfig`` as a dict (what verl passes with a push, or ``adapter_config.json``); refuses what a
        merge cannot express (point 4)."""
        refused = {"use_dora": bool(config.get("use_dora")), "rank_pattern": bool(config.get("rank_pattern")),
                   "alpha_pattern": bool(config.get("alpha_pattern")), "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
                   "lora_bias": bool(config.get("lora_bias")), "modules_to_save": bool(config.get("modules_to_save"))}
        found = sorted(k for k, on in refused.items() if on)
        if found:
            raise StreamingConfigError(rule_message(
                f"the CPU rollout merges plain LoRA adapters only; this adapter sets {', '.join(found)}",
                "the rollout folds each adapter into its module's weight as W + lora_alpha / r * B @ A; these settings "
                "change that layer (or add weights outside it), so the served model would not be the trained one",
                "train a plain LoRA adapter (verl's FSDP engine builds one from model.lora_rank / lora_alpha), or "
                "serve it with rollout.name=vllm"))
        rank = int(config.get("r") or 0)
        if rank <= 0:
            raise StreamingConfigError(rule_message(
                f"a LoRA push needs the adapter's rank r > 0, got {config.get('r')!r}",
                "the merge scales B @ A by lora_alpha / r", "pass verl's peft config (its LoraConfig as a dict)"))
        return cls(rank=rank, alpha=float(config.get("lora_alpha", 8)), use_rslora=bool(config.get("use_rslora")))

    @classmethod
    def from_model_config(cls, model_config: Any) -> "LoraSpec | None":
        """The adapter verl's FSDP engine builds from ``actor_rollout_ref.model`` (None without LoRA): r = ``lora_rank``,
        alpha = ``lora_alpha``, or the ``adapter_config.json`` of ``lora_adapter_path`` (verl loads that adapter)."""
        rank = int(_field(model_config, "lora_rank", 0) or 0)
        if rank <= 0:
            return None
        path = _field(model_config, "lora_adapter_path", None)
        if path and os.path.isfile(os.path.join(str(path), "adapter_config.json")):
            with open(os.path.join(str(path), "adapter_config.json")) as fh:
                return cls.from_peft_config(json.load(fh))
        return cls(rank=rank, alpha=float(_field(model_config, "lora_alpha", 16)))


def _field(config: Any, key: str, default: Any) -> Any:
    """``config.key`` of verl's HFModelConfig or the raw (struct) DictConfig or a dict; ``default`` when absent."""
    if isinstance(config, dict):
        return config.get(key, default)
    try:
        value = getattr(config, key)
    except Exception:  # a struct DictConfig raises for a key it lacks
        return default
    return default if value is None else value


def split_name(name: str) -> tuple[str, str, str]:
    """``(kind, module or weight name, part)`` of a pushed tensor's name: kind ``adapter`` (part ``A``/``B``), ``base``
    (the module's own weight or bias name, part ``weight``/``bias``) or ``plain`` (the name itself)."""
    if any(p in name for p in REFUSED_NAME_PARTS):
        raise StreamingInputError(rule_message(
            f"pushed tensor {name!r} belongs to an adapter the CPU rollout cannot merge into a linear weight",
            "embedding adapters, DoRA magnitudes and adapter biases change the layer beyond W + s * B @ A",
            "target linear modules only (verl's default target_modules=all-linear), or use rollout.name=vllm"))
    bare = name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name
    for part, short in ADAPTER_PARTS.items():
        for tail in (f".{part}.weight", f".{part}.default.weight"):
            if bare.endswith(tail):
                return "adapter", bare[: -len(tail)], short
    if BASE_LAYER in bare:
        module, _, leaf = bare.rpartition(BASE_LAYER)
        return "base", f"{module}.{leaf}", leaf
    return "plain", name, ""


class LoraMerger:
    """The adapter state of one rollout server, and the translation of a push into its model's tensors (point 2).

    ``current(name)`` returns the model's tensor of that name as it is now (the base of a module not merged yet).
    """

    def __init__(self, spec: LoraSpec | None, current: Callable[[str], torch.Tensor | None]):
        self.spec = spec
        self._current = current
        self.base: dict[str, torch.Tensor] = {}  # "<module>.weight" -> base weight (point 3)
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}  # module -> {"A": [r, in], "B": [out, r]}
        self.merged_modules: set[str] = set()

    def translate(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                  peft_config: dict | None = None) -> list[tuple[str, torch.Tensor]]:
        """The model's tensors for one push (point 2), in push order, merged modules last."""
        if peft_config is not None:
            self.spec = LoraSpec.from_peft_config(peft_config)
        out, dirty = [], []
        for name, tensor in named_tensors:
            kind, key, part = split_name(name)
            if kind == "plain":
                module = key.rsplit(".", 1)[0]
                if module in self.adapters and key == f"{module}.weight":
                    raise StreamingInputError(rule_message(
                        f"pushed full weight {name!r} for a module that holds a LoRA adapter",
                        "a push either carries the adapter (merged here) or merged weights, never both in one run",
                        "keep actor_rollout_ref.model.lora.merge the same for the whole run"))
                out.append((name, tensor))
                continue
            module = key.rsplit(".", 1)[0] if kind == "base" else key
            if kind == "base":
                if part != "weight":
                    out.append((key, tensor))  # a base bias is the layer's own bias: the adapter adds none
                    continue
                self.base[key] = tensor.detach().to("cpu", torch.float32, copy=True)
            else:
                self._keep_base(module)
                self.adapters.setdefault(module, {})[part] = tensor.detach().to("cpu", torch.float32, copy=True)
            if module not in dirty:
                dirty.append(module)
        for module in dirty:
            out.append((f"{module}.weight", self._merged(module)))
        return out

    def _keep_base(self, module: str) -> None:
        key = f"{module}.weight"
        if key in self.base:
            return
        current = self._current(key)
        if current is None:
            raise StreamingInputError(rule_message(
                f"LoRA adapter for {module!r}, which the rollout model lacks",
                "the adapter is folded into that module's weight", "serve the model the learner trains (model.path)"))
        self.base[key] = current.detach().to("cpu", torch.float32, copy=True)

    def _merged(self, module: str) -> torch.Tensor:
        key = f"{module}.weight"
        adapter = self.adapters.get(module, {})
        if "A" not in adapter or "B" not in adapter:
            if adapter:  # half an adapter: the other half arrives later in this push or the next
                raise StreamingInputError(rule_message(
                    f"LoRA push for {module!r} carries only lora_{'A' if 'A' in adapter else 'B'}",
                    "the merge needs both factors of one version", "push every adapter tensor each time"))
            return self.base[key]
        if self.spec is None:
            raise StreamingConfigError(rule_message(
                f"LoRA adapter pushed for {module!r}, but the rollout knows no lora_rank / lora_alpha",
                "the merge scales B @ A by lora_alpha / r",
                "set actor_rollout_ref.model.lora_rank (and lora_alpha) for the run; the rollout reads the same model config"))
        a, b = adapter["A"], adapter["B"]
        base = self.base[key]
        if a.shape[0] != self.spec.rank or b.shape[1] != self.spec.rank or (b.shape[0], a.shape[1]) != tuple(base.shape):
            raise StreamingInputError(rule_message(
                f"LoRA factors of {module!r} have shapes A {tuple(a.shape)}, B {tuple(b.shape)} for a weight "
                f"{tuple(base.shape)} at rank {self.spec.rank}",
                "the merge adds scaling * B @ A to the weight", "push the adapter of the model the rollout serves"))
        self.merged_modules.add(module)
        return base + self.spec.scaling * (b @ a)  # [out, in]
