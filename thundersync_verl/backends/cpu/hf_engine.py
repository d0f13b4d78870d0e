"""A token-in/token-out generation engine on HF transformers, for CPU rollouts.

1. Continuous batching: each request keeps its own KV cache; one scheduler task on the
   server's asyncio loop prefills new requests together and then decodes every running
   request one token per batched forward (``kv_batch``), so a long request never blocks a
   short one (a serial server would hide exactly the long tail ThunderSync removes), new
   requests join at the next step, and decoding costs one forward per step, not per
   request (on a CPU that is the difference between a rollout bound by compute and one
   bound by its tools).
2. The log-prob returned for each sampled token is log_softmax(logits / T), the
   quantity verl's actor recomputes, so rollout and learner log-probs can be
   compared token by token (top-p/top-k change what is sampled, not this value).
   When the weights did not change during the request, the returned log-probs come
   from one causal forward over the finished turn (``rescore``): the learner's
   computation, instead of the incremental KV-cache sums (which differ by ~1e-6 per
   layer and add up on peaky trained models).
3. Weights are swapped between decode steps; every request reports the weight
   versions it was generated with (``min/max_global_steps``), which is how
   staleness is measured rather than assumed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any, Iterable, Optional

import torch

from thundersync_verl.backends.cpu import kv_batch

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: Optional[int] = None

    @classmethod
    def from_params(cls, params: dict[str, Any], default_max_tokens: int) -> "SamplingSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in params if k not in known and k not in _IGNORED_PARAMS)
        if unknown:
            logger.debug("hf_cpu ignores sampling params %s", unknown)
        max_tokens = params.get("max_tokens", params.get("max_new_tokens", default_max_tokens))
        stop = params.get("stop") or ()
        spec = cls(
            max_tokens=int(max_tokens if max_tokens is not None else default_max_tokens),
            temperature=float(params.get("temperature", 1.0)),
            top_p=float(params.get("top_p", 1.0)),
            top_k=int(params.get("top_k", -1) if params.get("top_k") is not None else -1),
            stop_token_ids=tuple(params.get("stop_token_ids") or ()),
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            ignore_eos=bool(params.get("ignore_eos", False)),
            seed=params.get("seed"),
        )
        if spec.max_tokens < 1:
            raise ValueError(f"sampling_params.max_tokens must be >= 1, got {spec.max_tokens}")
        if spec.temperature < 0 or not 0 < spec.top_p <= 1:
            raise ValueError(
                f"sampling_params need temperature >= 0 and 0 < top_p <= 1, got T={spec.temperature}, top_p={spec.top_p}"
            )
        return spec


_IGNORED_PARAMS = {"logprobs", "repetition_penalty", "n", "detokenize", "skip_special_tokens", "min_tokens"}


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    log_probs: list[float]
    stop_reason: str  # "completed" (eos/stop), "length", or "aborted"
    min_version: int
    max_version: int
    seconds: float


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V]
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)  # [V]
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)  # [V]
        drop = cum - torch.softmax(sorted_logits, dim=-1) > top_p  # keep the token that crosses top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    spec: SamplingSpec
    gen: Optional[torch.Generator]
    stops: set[int]
    epoch: int
    done: asyncio.Future
    out_ids: list[int] = dataclasses.field(default_factory=list)
    out_lp: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    cache: Any = None  # per-layer (K, V) while decoding
    reason: str = "length"
    t0: float = dataclasses.field(default_factory=time.perf_counter)
    stop: Optional[asyncio.Future] = None  # done: leave the batch at the next step (the caller's group was aborted)
    dropped: bool = False  # the caller stopped waiting (its call was cancelled)


class HFGenerationEngine:
    """Holds one HF causal LM and serves concurrent ``generate`` calls."""

    def __init__(self, model, tokenizer=None, *, eos_token_ids: Iterable[int] = (), max_model_len: int = 2048,
                 rescore: bool = True, max_batch: int = 64, prefill_pad_share: float | None = kv_batch.PAD_SHARE):
        self.rescore = rescore
        self.prefill_pad_share = prefill_pad_share  # kv_batch point 3; None: one padded prefill per step
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = set(int(t) for t in eos_token_ids)
        self.max_model_len = int(max_model_len)
        self.version = 0
        self.active = 0
        self.peak_active = 0
        self._abort_epoch = 0
        self.max_batch = int(max_batch)
        self.pad_token_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self._paused = asyncio.Event()
        self._paused.set()
        self._waiting: list[_Request] = []  # admitted, not prefilled yet
        self._running: list[_Request] = []  # prefilled, decoding
        self._scoring: list[tuple[list[int], asyncio.Future]] = []  # whole sequences to score (teacher calls)
        self._scheduler: Optional[asyncio.Task] = None

    # -- weights -----------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: Optional[int] = None) -> int:
        """Copy named tensors into the model in place; returns how many were loaded."""
        params = dict(self.model.named_parameters())
        params.update(dict(self.model.named_buffers()))
        loaded = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                target = params.get(name)
                if target is None and name.startswith("model.") is False:
                    target = params.get("model." + name)
                if target is None:
                    if "lm_head" in name and getattr(self.model.config, "tie_word_embeddings", False):
                        continue  # tied to the embedding, which is loaded under its own name
                    raise KeyError(f"weight '{name}' does not exist in the rollout model; the learner and rollout must be the same architecture")
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight '{name}' has shape {tuple(tensor.shape)} but the rollout model expects {tuple(target.shape)}")
                target.copy_(tensor.to(dtype=target.dtype, device=target.device))
                loaded += 1
        self.version = self.version + 1 if version is None else int(version)
        return loaded

    # -- generation ----------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: dict[str, Any],
                       stop: Optional[asyncio.Future] = None) -> Generation:
        """One request, batched with the others in flight. ``stop``: once done, the request leaves the batch at the
        next step and returns what it has, reason "aborted"; a cancelled call's request leaves it the same way."""
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens leaves no room within max_model_len={self.max_model_len}; "
                "raise actor_rollout_ref.rollout.max_model_len or shorten the prompt"
            )
        spec = SamplingSpec.from_params(params, default_max_tokens=room)
        spec.max_tokens = min(spec.max_tokens, room)
        gen = torch.Generator().manual_seed(int(spec.seed)) if spec.seed is not None else None
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            await self._paused.wait()  # requests that arrive during a pause are parked, not failed
            stops = set(spec.stop_token_ids) | (set() if spec.ignore_eos else self.eos_token_ids)
            req = _Request(list(prompt_ids), spec, gen, stops, self._abort_epoch, asyncio.get_running_loop().create_future(),
                           stop=stop)
            self._waiting.append(req)
            self._ensure_scheduler()
            try:
                await req.done
            except asyncio.CancelledError:
                req.dropped = True  # no one will read it: stop computing it
                raise
        finally:
            self.active -= 1
        versions = req.versions or [self.version]
        out_lp = req.out_lp
        if self.rescore and req.out_ids and req.reason != "aborted" and min(versions) == max(versions) == self.version:
            out_lp = self._full_forward_logprobs(req.prompt_ids, req.out_ids, spec.temperature)
        return Generation(req.out_ids, out_lp, req.reason, min(versions), max(versions), time.perf_counter() - req.t0)

    def _ensure_scheduler(self) -> None:
        if self._scheduler is None or self._scheduler.done():
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def score(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``prompt_ids`` ([L, V]), from its own unpadded forward.

        Teacher scoring (verl's ``prompt_logprobs``) needs the whole sequence, not a generation. Pending calls are
        scored one per scheduler step, first come first served, so each reply leaves as soon as it is computed;
        a padded batch of them would cost more than the rows alone (``kv_batch`` point 4).
        """
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(f"sequence of {len(prompt_ids)} tokens exceeds max_model_len={self.max_model_len}; "
                             "raise actor_rollout_ref.rollout.max_model_len (or the teacher's) to score it")
        await self._paused.wait()
        done = asyncio.get_running_loop().create_future()
        self._scoring.append((list(prompt_ids), done))
        self._ensure_scheduler()
        return await done

    def _score_pending(self) -> None:
        ids, done = self._scoring.pop(0)
        if not done.done():  # its caller gave up (cancelled): nothing to compute
            done.set_result(kv_batch.all_logits(self.model, ids))

    async def _schedule(self) -> None:
        """Score pending sequences, prefill new requests, decode running ones; until nothing is left."""
        try:
            while self._waiting or self._running or self._scoring:
                self._retire_aborted()
                if not self._paused.is_set():
                    await asyncio.sleep(0.005)  # paused for a weight swap: keep the KV caches, wait
                    continue
                if self._scoring:
                    self._score_pending()
                if self._waiting:
                    self._prefill(self._take_waiting())
                if self._running:
                    self._decode_step()
                await asyncio.sleep(0)  # let arrivals, tools and control calls run
        except BaseException as exc:  # a model error fails every request instead of hanging them
            failed = exc if isinstance(exc, Exception) else RuntimeError("engine stopped")
            for done in [r.done for r in self._waiting + self._running] + [d for _, d in self._scoring]:
                if not done.done():
                    done.set_exception(failed)
            self._waiting, self._running, self._scoring = [], [], []
            raise

    def _take_waiting(self) -> list["_Request"]:
        taken = self._waiting[: self.max_batch]
        self._waiting = self._waiting[self.max_batch :]
        return taken

    def _retire_aborted(self) -> None:
        for queue in (self._waiting, self._running):
            for req in [r for r in queue if r.epoch != self._abort_epoch or r.dropped
                        or (r.stop is not None and r.stop.done())]:
                queue.remove(req)
                self._finish(req, "aborted")

    def _prefill(self, reqs: list["_Request"]) -> None:
        """Prefill ``reqs`` in forwards of similar prompt lengths (``kv_batch.length_groups``), in arrival order
        afterwards: each request samples its first token from its own row, whichever forward computed it."""
        rows: dict[int, tuple] = {}
        for group in kv_batch.length_groups([len(r.prompt_ids) for r in reqs], self.prefill_pad_share):
            logits, caches = kv_batch.prefill(self.model, [reqs[i].prompt_ids for i in group], self.pad_token_id)
            rows.update((i, (row, cache)) for i, row, cache in zip(group, logits, caches))
        for i, req in enumerate(reqs):
            req.cache = rows[i][1]
            self._advance(req, rows[i][0])

    def _decode_step(self) -> None:
        reqs = self._running[: self.max_batch]
        logits, caches = kv_batch.decode(self.model, [r.out_ids[-1] for r in reqs], [r.cache for r in reqs])
        for req, row, cache in zip(reqs, logits, caches):
            self._running.remove(req)
            req.cache = cache
            self._advance(req, row)

    def _advance(self, req: "_Request", logits: torch.Tensor) -> None:
        """Sample ``req``'s next token from its logits; finish it or keep it running."""
        req.versions.append(self.version)
        token, logprob = self._sample(logits, req.spec, req.gen)
        req.out_ids.append(token)
        req.out_lp.append(logprob)
        if token in req.stops or self._hits_stop_string(req.out_ids, req.spec.stop):
            self._finish(req, "completed")
        elif len(req.out_ids) >= req.spec.max_tokens:
            self._finish(req, "length")
        else:
            self._running.append(req)  # rotates: rows beyond max_batch go first next step

    @staticmethod
    def _finish(req: "_Request", reason: str) -> None:
        req.reason, req.cache = reason, None
        if not req.done.done():
            req.done.set_result(None)

    def _full_forward_logprobs(self, prompt_ids: list[int], out_ids: list[int], temperature: float) -> list[float]:
        ids = torch.tensor([prompt_ids + out_ids], dtype=torch.long)  # [1, P + R]
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()  # [R, V]
        if temperature > 0:
            logits = logits / temperature
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(out_ids)[:, None])[:, 0].tolist()

    @staticmethod
    def _sample(logits: torch.Tensor, spec: SamplingSpec, gen) -> tuple[int, float]:
        if spec.temperature == 0:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token])
        scaled = logits / spec.temperature  # [V]
        logprobs = torch.log_softmax(scaled, -1)  # [V]
        filtered = _filter_logits(scaled, spec.top_k, spec.top_p)
        probs = torch.softmax(filtered, -1)
        token = int(torch.multinomial(probs, 1, generator=gen))
        return token, float(logprobs[token])

    def _hits_stop_string(self, out_ids: list[int], stops: tuple[str, ...]) -> bool:
        if not stops or self.tokenizer is None:
            return False
        tail = self.tokenizer.decode(out_ids[-16:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    # -- control -------------------------------------------------------------------
    def pause(self) -> None:
        self._paused.clear()

    def resume(self) -> None:
        self._paused.set()

    def abort_all(self) -> None:
        """Stop every in-flight request at its next token and park new ones until resume()."""
        self._abort_epoch += 1
        self._paused.clear()
