"""Rollout backend ``replay``: serves recorded generations through verl's replica / server / adapter contract.

Why a rollout backend (and not a mocked agent loop or dataset):
1. verl creates it from ``actor_rollout_ref.rollout.name=replay`` exactly as it creates
   ``hf_cpu`` or vLLM replicas, so everything around the rollout (agent loop, tools, reward loop,
   trainer, weight sync) runs unchanged, in hybrid (Sync) and standalone (ThunderSync, async)
   layouts alike; only the tokens come from a file.
2. ``ReplayServer.generate(request_id, prompt_ids, sampling_params)`` answers with the recorded
   tokens and log-probs for that exact prompt (:class:`Recording`), after sleeping the call's
   recorded service time times ``time_scale`` (0 = no sleeping), optionally permuted by
   ``permute_seed``. A prompt that was not recorded is an error naming the file.
3. The learner-side adapter consumes every weight push (FSDP2 gathers are collectives, so every
   rank must iterate) and forwards only the version: replayed answers report the weight version
   the server holds, like ``hf_cpu``, so staleness metrics mean the same thing.
4. Configuration: ``+actor_rollout_ref.rollout.engine_kwargs.replay.path=<recording>``, optional
   ``.time_scale`` (default 1.0), ``.permute_seed`` (default none: recorded order), ``.repeat`` (default false:
   a prompt asked for more often than recorded serves its recorded answers again, in order, as tail batching's
   re-run of a deferred prompt needs) and
   ``.record_path`` (re-record what was served, e.g. to check two replays saw the same data).
   ``.synthesize=<shape>`` writes a NEW recording at ``path`` instead of reading one: a scripted
   agent of that shape answers every call (``synthesize.py``), nothing is slept.
5. ``$THUNDERSYNC_REPLAY_WEIGHTS_DIR`` (benchmarks): the pushed weights are kept and written there
   per version (``weights_v<version>.pt``), so two runs' parameter updates can be compared; unset,
   pushes carry only their version. A LoRA actor's pushes (peft names, ``backends/lora_weights.py``) are kept as
   the model the rollout would serve: the checkpoint's weights with each pushed adapter merged in.
"""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace
from typing import Any, Optional

from thundersync_verl.run import faults
from thundersync_verl import verl_adapter as va
from thundersync_verl.backends import rollout_contract as contract
from thundersync_verl.backends.replay.record import GenerateRecorder, engine_section
from thundersync_verl.backends.replay.recording import Recording
from thundersync_verl.backends.replay.synthesize import AgenticScript
from thundersync_verl.backends.lora_weights import LoraMerger, LoraSpec

ROLLOUT_NAME = "replay"
PATH_KEY = "path"
SETTING_KEYS = {PATH_KEY, "time_scale", "permute_seed", "record_path", "synthesize", "repeat"}
WEIGHTS_DIR_ENV = "THUNDERSYNC_REPLAY_WEIGHTS_DIR"


def server_actor_name(replica_rank: int, suffix: str = "") -> str:
    return f"replay_server_{replica_rank}{suffix}"


def replay_settings(config) -> dict[str, Any]:
    """``engine_kwargs.replay`` checked: ``{"path", "time_scale", "permute_seed", "record_path", "synthesize"}``."""
    section = engine_section(config, ROLLOUT_NAME)
    unknown = sorted(set(section) - SETTING_KEYS)
    if unknown:
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.replay has unknown keys {unknown}; "
                         f"known: {', '.join(sorted(SETTING_KEYS))}")
    path = section.get(PATH_KEY)
    if not path:
        raise ValueError("rollout 'replay' needs a recording: set "
                         "+actor_rollout_ref.rollout.engine_kwargs.replay.path=/abs/recording.jsonl "
                         "(see thundersync_verl/backends/replay/record.py for how to record one)")
    time_scale = float(section.get("time_scale", 1.0))
    if not time_scale >= 0:
        raise ValueError(f"engine_kwargs.replay.time_scale must be >= 0 (0 = no sleeping), got {time_scale}")
    seed = section.get("permute_seed")
    record_path = section.get("record_path")
    if record_path and os.path.abspath(str(record_path)) == os.path.abspath(str(path)):
        raise ValueError(f"engine_kwargs.replay.record_path is the recording being replayed ({path}); "
                         "re-record to another file")
    synthesize = section.get("synthesize")
    if synthesize and os.path.exists(str(path)):
        raise ValueError(f"engine_kwargs.replay.synthesize writes a new recording, and {path} exists; "
                         "synthesise to a new path (or delete the old file)")
    repeat = section.get("repeat", False)
    if not isinstance(repeat, bool):
        raise ValueError(f"engine_kwargs.replay.repeat must be true or false, got {repeat!r}")
    return {"path": str(path), "time_scale": time_scale, "permute_seed": None if seed is None else int(seed),
            "record_path": record_path, "synthesize": str(synthesize) if synthesize else None, "repeat": repeat}


class ReplayServer(contract.ServerControl):
    """One replay server (a Ray actor with high max_concurrency; also usable in-process)."""

    def __init__(self, config, model_config=None, rollout_mode=None, replica_rank: int = 0):
        self.config = config
        self.replica_rank = replica_rank
        self.rollout_mode = rollout_mode
        settings = replay_settings(config)
        self.time_scale = settings["time_scale"]
        if settings["synthesize"]:
            self.recording = AgenticScript.load(settings["synthesize"], _model_path(model_config), settings["path"])
        else:
            self.recording = Recording(settings["path"], permute_seed=settings["permute_seed"], repeat=settings["repeat"])
        self.recorder = GenerateRecorder.from_config(config, section=ROLLOUT_NAME, use_env=False)
        self.version = 0
        self.resumed_at: Optional[int] = None  # a resumed run's first pushed version: older records were consumed
        self.global_steps: Optional[int] = None
        self.requests_served = 0
        self.active = 0
        self._open = asyncio.Event()  # closed by abort_all_requests, reopened by resume_generation
        self._open.set()
        self.model_config = model_config
        self.lora: Optional[LoraMerger] = None  # built at the first LoRA push that is kept (point 5)
        self.kept: dict = {}  # with LoRA: the served model's tensors, by name

    async def generate(self, prompt_ids, sampling_params: dict[str, Any], request_id: str, **kwargs):
        params = dict(sampling_params or {})
        if params.get("prompt_logprobs") is not None:
            raise ValueError("rollout 'replay' serves recorded generations and cannot score prompts "
                             "(prompt_logprobs); use hf_cpu for distillation.teacher_models")
        if faults.ACTIVE:  # $THUNDERSYNC_FAULTS: rollout_kill
            faults.rollout_generate()
        await self._open.wait()  # like hf_cpu: calls that arrive after an abort wait for resume
        start = self.recorder.clock() if self.recorder is not None else time.time()
        version = self.version
        if isinstance(self.recording, AgenticScript):
            rec = self.recording.next_generate(prompt_ids, temperature=params.get("temperature", 1.0),
                                               max_tokens=params.get("max_tokens"), version=version)
        else:
            rec = self.recording.next_generate(prompt_ids, temperature=params.get("temperature", 1.0),
                                               max_tokens=params.get("max_tokens"), min_version=self.resumed_at)
        self.active += 1
        try:
            delay = 0.0 if isinstance(self.recording, AgenticScript) else self.recording.service_s[rec.line] * self.time_scale
            if delay > 0:
                await asyncio.sleep(delay)
        finally:
            self.active -= 1
        self.requests_served += 1
        if self.recorder is not None:
            gen = SimpleNamespace(token_ids=rec.response_ids, log_probs=rec.log_probs, stop_reason=rec.stop_reason,
                                  max_version=version)
            self.recorder.generation(request_id=request_id, prompt_ids=prompt_ids, sampling_params=params, gen=gen,
                                     start=start)
        TokenOutput = va.token_output_cls()
        return TokenOutput(
            token_ids=list(rec.response_ids),
            log_probs=list(rec.log_probs),
            stop_reason="aborted" if rec.stop_reason == "aborted" else "completed",
            extra_fields={"global_steps": version, "min_global_steps": version, "max_global_steps": version,
                          "finish_reason": rec.stop_reason, "replay_line": rec.line},
        )

    async def update_weights(self, named_tensors: Optional[list] = None, global_steps: Optional[int] = None,
                             peft_config: Optional[dict] = None) -> int:
        """Only the version matters here: answers are recorded, not computed (kept weights are written, point 5)."""
        if self.requests_served == 0 and self.resumed_at is None and global_steps is not None and int(global_steps) > 0:
            self.resumed_at = int(global_steps)  # the first push of a run resumed from a checkpoint
        self.version = self.version + 1 if global_steps is None else int(global_steps)
        self.global_steps = global_steps
        if named_tensors and os.environ.get(WEIGHTS_DIR_ENV):
            import torch

            os.makedirs(os.environ[WEIGHTS_DIR_ENV], exist_ok=True)
            torch.save(self._kept(named_tensors, peft_config),
                       os.path.join(os.environ[WEIGHTS_DIR_ENV], f"weights_v{self.version}.pt"))
        return len(named_tensors or [])

    def _kept(self, named_tensors: list, peft_config: Optional[dict]) -> dict:
        """What a push leaves the rollout serving: the push itself, or with LoRA the checkpoint's weights with the
        adapter merged in (point 5)."""
        if self.model_config is None:  # in-process use without a model: the push as it came
            return dict(named_tensors)
        spec = LoraSpec.from_model_config(self.model_config)
        if self.lora is None and spec is None and peft_config is None:
            return dict(named_tensors)
        if self.lora is None:
            from safetensors.torch import load_file

            folder = _model_path(self.model_config)
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    self.kept.update(load_file(os.path.join(folder, name)))
            self.lora = LoraMerger(spec, self.kept.get)
        self.kept.update(self.lora.translate(named_tensors, peft_config))
        return dict(self.kept)

    def stats(self) -> dict:
        recorded = len(self.recording.plans) if isinstance(self.recording, AgenticScript) else self.recording.num_generates
        return {"version": self.version, "active": self.active, "requests_served": self.requests_served,
                "recorded_calls": recorded, "recording": getattr(self.recording, "path", None) or self.recording.file.path}

    # -- verl control calls: their replay meaning (the rest: rollout_contract.ServerControl) ------
    def _in_flight(self) -> int:
        return self.active

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False):
        # In-flight calls still return their whole recorded answer: a cut-short answer was never recorded.
        self._open.clear()
        return {"aborted_count": 0, "request_ids": []}

    async def resume_generation(self):
        self._open.set()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True):
        return {"aborted": False, "request_id": request_id, "error": "replay does not abort single requests"}


async def _drain(weights, wire_format: str) -> Optional[list]:
    """Consume the push (every rank must: the gathers are collectives); only its version reaches the server,
    unless ``$THUNDERSYNC_REPLAY_WEIGHTS_DIR`` asks for the tensors (module docstring, point 5)."""
    keep = [] if os.environ.get(WEIGHTS_DIR_ENV) else None
    async for name, tensor in contract.iterate_weights(weights):
        if keep is not None:
            keep.append((name, tensor.detach().to("cpu", copy=True)))
    return keep


def _model_path(model_config) -> str:
    path = getattr(model_config, "local_path", None) or getattr(model_config, "path", None)
    if not path:
        raise ValueError("engine_kwargs.replay.synthesize needs the policy model (its tokenizer and its log-probs); "
                         "set actor_rollout_ref.model.path")
    return str(path)


def make_replica_class():
    """Build the RolloutReplica subclass (deferred: it needs verl)."""
    return contract.make_replica_class("ReplayReplica", __name__, ReplayServer, server_actor_name)


def make_server_adapter_class():
    """Build the learner-side BaseRollout subclass (deferred: it needs verl); it drops the tensors."""
    return contract.make_server_adapter_class("ReplayServerAdapter", __name__, server_actor_name, _drain)


__getattr__ = contract.lazy_classes(globals(), {"ReplayReplica": make_replica_class,
                                                "ReplayServerAdapter": make_server_adapter_class})
