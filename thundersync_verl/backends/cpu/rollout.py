"""Rollout backend ``hf_cpu``: verl's replica / server / adapter contract on HF transformers.

1. ``HFCpuReplica`` is a verl ``RolloutReplica``: verl's LLMServerManager creates it
   from ``actor_rollout_ref.rollout.name=hf_cpu`` exactly as it creates vLLM
   replicas, in hybrid (colocated with the learner) or standalone mode.
2. ``HFCpuServer`` is the Ray actor the agent loop talks to
   (``generate(request_id, prompt_ids, sampling_params) -> TokenOutput``); it wraps
   :class:`HFGenerationEngine` and answers verl's control calls (wake_up, sleep,
   abort/resume, kv-cache release) with their CPU meaning.
3. ``HFCpuServerAdapter`` is the learner-side ``BaseRollout``: verl's checkpoint
   engine hands it the per-tensor weights after each optimizer step
   (resume -> update_weights -> resume kv), and it ships them to its server.
   Replica and adapter are built by ``backends/rollout_contract.py`` (shared with ``replay``).
   A LoRA actor's push (peft names: ``base_layer`` weights, ``lora_A`` / ``lora_B`` adapters) is merged into
   the served weights first (``backends/lora_weights.py``), so the rollout serves the adapted model.
4. As an on-policy-distillation teacher (verl's ``distillation.teacher_models``), the server
   answers ``sampling_params["prompt_logprobs"]`` like verl's vLLM server: per prompt position p
   the log-prob of token p+1 (or the top-k), a zero row for the last position.
5. With ``engine_kwargs.hf_cpu.record_path`` (or ``$THUNDERSYNC_RECORD_PATH``) set, every generate
   call is appended to a replay recording (``thundersync_verl/backends/replay/record.py``) that
   rollout ``replay`` serves back.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from thundersync_verl.run import faults
from thundersync_verl import verl_adapter as va
from thundersync_verl.backends import rollout_contract as contract
from thundersync_verl.backends.cpu.hf_engine import HFGenerationEngine
from thundersync_verl.backends.lora_weights import LoraMerger, LoraSpec
from thundersync_verl.backends.replay.record import GenerateRecorder
from thundersync_verl.envs.abort import ABORT_UID_KEY, abort_signal

logger = logging.getLogger(__name__)
ROLLOUT_NAME = "hf_cpu"


def server_actor_name(replica_rank: int, suffix: str = "") -> str:
    return f"hf_cpu_server_{replica_rank}{suffix}"


def load_hf_model(model_path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"rollout model folder '{model_path}' does not exist; build the tiny model with "
            "`thundersync build-model` or point actor_rollout_ref.model.path at an HF checkpoint folder"
        )
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return model, tokenizer


def eos_ids_of(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        eos = getattr(source, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return {int(i) for i in ids}


def _model_path(model_config) -> str:
    # verl hands replicas either an HFModelConfig or the raw (struct) DictConfig
    for key in ("local_path", "path"):
        try:
            value = getattr(model_config, key)
        except Exception:
            value = None
        if value:
            return os.path.expanduser(str(value))
    raise ValueError("actor_rollout_ref.model.path is not set: point it at an HF checkpoint folder")


def prompt_logprob_fields(model, prompt_ids: list[int], num: int) -> dict[str, list[list]]:
    """verl's teacher reply (``prompt_ids``, ``prompt_logprobs``), each [len(prompt_ids), max(num, 1)].

    Row p describes token p+1 given tokens <= p (temperature 1): with ``num`` = 0 its id and
    log-prob, with ``num`` > 0 the top-``num`` ids and log-probs by rank. The last row is zeros
    (no next token), as verl's vLLM server pads it.
    """
    check_prompt_logprobs(prompt_ids, num)
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, S]
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [S, V]
    return prompt_logprobs_from_logits(logits, prompt_ids, num)


def check_prompt_logprobs(prompt_ids: list[int], num: int) -> None:
    if num < 0 or len(prompt_ids) < 2:
        raise ValueError(f"prompt_logprobs needs num >= 0 and at least 2 prompt tokens (got num={num}, "
                         f"{len(prompt_ids)} tokens); verl's teacher asks for 0 (or top-k) over prompt+response")


def prompt_logprobs_from_logits(logits: torch.Tensor, prompt_ids: list[int], num: int) -> dict[str, list[list]]:
    """:func:`prompt_logprob_fields` from the sequence's logits ([S, V], every position)."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)  # [1, S]
    log_probs = torch.log_softmax(logits[:-1], dim=-1)  # [S - 1, V]
    if num == 0:
        next_ids = ids[0, 1:].unsqueeze(-1)  # [S - 1, 1]
        values = log_probs.gather(-1, next_ids)  # [S - 1, 1]
    else:
        values, next_ids = torch.topk(log_probs, k=num, dim=-1)  # [S - 1, num]
    width = max(num, 1)
    return {"prompt_ids": next_ids.tolist() + [[0] * width], "prompt_logprobs": values.tolist() + [[0.0] * width]}


class HFCpuServer(contract.ServerControl):
    """One rollout server (a Ray actor with high max_concurrency)."""

    def __init__(self, config, model_config, rollout_mode, replica_rank: int, threads: int = 1):
        torch.set_num_threads(max(1, int(threads)))
        self.config = config
        self.replica_rank = replica_rank
        self.rollout_mode = rollout_mode
        model_path = _model_path(model_config)
        model, tokenizer = load_hf_model(model_path, dtype=str(getattr(config, "dtype", "float32")).replace("torch.", ""))
        max_len = getattr(config, "max_model_len", None) or (config.prompt_length + config.response_length)
        self.engine = HFGenerationEngine(model, tokenizer, eos_token_ids=eos_ids_of(model, tokenizer), max_model_len=max_len)
        self.global_steps: Optional[int] = None
        self.requests_served = 0
        self.recorder = GenerateRecorder.from_config(config)  # None unless recording is asked for
        self.lora = LoraMerger(LoraSpec.from_model_config(model_config), self._model_tensor)

    def _model_tensor(self, name: str):
        """The served model's parameter ``name`` (what a LoRA merge starts from), None if it has none."""
        params = dict(self.engine.model.named_parameters())
        return params.get(name, params.get("model." + name))

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, **kwargs):
        params = dict(sampling_params or {})
        num_prompt_logprobs = params.pop("prompt_logprobs", None)
        if num_prompt_logprobs is not None:  # a teacher call: score the sequence, generate nothing
            return await self._score(list(prompt_ids), int(num_prompt_logprobs))
        if faults.ACTIVE:  # $THUNDERSYNC_FAULTS: rollout_kill
            faults.rollout_generate()
        start = self.recorder.clock() if self.recorder is not None else 0.0
        async with abort_signal(kwargs.get(ABORT_UID_KEY)) as stop:  # tail batching: the group's abort stops it
            gen = await self.engine.generate(list(prompt_ids), params, stop=stop)
        self.requests_served += 1
        if self.recorder is not None and num_prompt_logprobs is None:  # teacher scoring calls are not rollouts
            self.recorder.generation(request_id=request_id, prompt_ids=prompt_ids, sampling_params=params, gen=gen, start=start)
        extra = {
            "global_steps": gen.max_version,
            "min_global_steps": gen.min_version,
            "max_global_steps": gen.max_version,
            "finish_reason": gen.stop_reason,
        }
        TokenOutput = va.token_output_cls()
        return TokenOutput(
            token_ids=gen.token_ids,
            log_probs=gen.log_probs,
            stop_reason="aborted" if gen.stop_reason == "aborted" else "completed",
            extra_fields=extra,
        )

    async def _score(self, prompt_ids: list[int], num: int):
        """verl's teacher reply: prompt log-probs (batched with concurrent calls), one greedy token."""
        check_prompt_logprobs(prompt_ids, num)
        logits = await self.engine.score(prompt_ids)  # [S, V]
        self.requests_served += 1
        token = int(torch.argmax(logits[-1]))
        extra = {"global_steps": self.engine.version, "min_global_steps": self.engine.version,
                 "max_global_steps": self.engine.version, "finish_reason": "length"}
        extra.update(prompt_logprobs_from_logits(logits, prompt_ids, num))
        return va.token_output_cls()(token_ids=[token], log_probs=[float(torch.log_softmax(logits[-1], -1)[token])],
                                     stop_reason="completed", extra_fields=extra)

    async def update_weights(self, named_tensors: list, global_steps: Optional[int] = None,
                             peft_config: Optional[dict] = None) -> int:
        """Swap weights between decode steps; requests keep their KV caches (like vLLM's in-flight update).

        A LoRA push is merged into the model's own tensors first (``peft_config``: what verl passes with it)."""
        self.engine.pause()
        try:
            n = self.engine.load_weights(self.lora.translate(named_tensors, peft_config), version=global_steps)
        finally:
            self.engine.resume()
        self.global_steps = global_steps
        return n

    def stats(self) -> dict:
        return {"version": self.engine.version, "active": self.engine.active, "peak_active": self.engine.peak_active,
                "requests_served": self.requests_served}

    # -- verl control calls: their CPU meaning (the rest: rollout_contract.ServerControl) ---------
    def _in_flight(self) -> int:
        return self.engine.active

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        n = self.engine.active
        self.engine.abort_all()
        return {"aborted_count": n, "request_ids": []}

    async def resume_generation(self):
        self.engine.resume()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id, "error": "hf_cpu aborts all requests, not single ones"}


def _server_threads() -> tuple[int]:
    return (int(os.environ.get("THUNDERSYNC_ROLLOUT_THREADS", "1")),)


async def _named_cpu_tensors(weights, wire_format: str) -> list:
    if wire_format != "named_tensors":
        raise NotImplementedError(f"hf_cpu receives full named tensors only, got wire_format={wire_format!r}")
    return [(name, t.detach().to("cpu").clone()) async for name, t in contract.iterate_weights(weights)]


def make_replica_class():
    """Build the RolloutReplica subclass (deferred: it needs verl)."""
    return contract.make_replica_class("HFCpuReplica", __name__, HFCpuServer, server_actor_name, _server_threads)


def make_server_adapter_class():
    """Build the learner-side BaseRollout subclass (deferred: it needs verl); it ships full CPU tensors."""
    return contract.make_server_adapter_class("HFCpuServerAdapter", __name__, server_actor_name, _named_cpu_tensors)


__getattr__ = contract.lazy_classes(globals(), {"HFCpuReplica": make_replica_class,
                                                "HFCpuServerAdapter": make_server_adapter_class})
