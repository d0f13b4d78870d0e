"""The streamed chunk's layout: what the driver sends the learner, built here, read by ``learner/stream_loss.py``.

Why:
1. A chunk is a verl no-padding batch (the layout ``update_actor`` receives) plus the streaming fields named
   below (``ts_coef`` [B], the non-tensor ``ts_dest``, and for per-token chunks ``ts_token_coef`` [B, R]
   and the teacher's or reference model's log-probs); the loss (``learner/stream_loss.py``, its points 1-6)
   reads them by these names, so both sides import the names from this one module.
2. verl splits a chunk evenly over data-parallel ranks, so the driver pads it to a multiple of the DP size
   with copies of a real row whose response mask is all zero and whose coefficient is 0: they contribute
   exactly zero, and every rank runs the backward (FSDP's reduce-scatter is a collective).
3. Every field is checked here, before the chunk leaves the driver (``_check_rows``, ``_check_token_rows``):
   a bad chunk is refused before any work, on the side that built it.
4. With several data-parallel ranks a row chunk is built part by part (``build_stream_parts``): the rows each rank
   receives from verl's split of the padded chunk, each part a chunk of its own. verl's split re-chunks every nested
   tensor of the whole chunk on every call; the parts reach the ranks without it (``va.DataParallelParts``).
5. A row chunk travels padded (``padded=True``, marked ``ts_padded``) and the learner turns it into verl's no-padding
   layout on arrival (``on_arrival``): built and pickled in that layout, a chunk of 8 rows of 250-2000 tokens took the
   driver 6.4-8.6 ms, padded 2.6 ms, on the one process that plans every chunk of the step, where each rank converts
   only its own part. The conversion is verl's own (``va.to_no_padding``), the same
   function on the same tensors: the learner's layout is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from thundersync_verl import verl_adapter as va
from thundersync_verl.core import StreamingConfigError, StreamingInputError, kl_per_token
from thundersync_verl.core.errors import rule_message

COEF_KEY = "ts_coef"  # [B] per-trajectory coefficient (A_i, or 1 for a bucket)
DEST_KEY = "ts_dest"  # non-tensor: "direct" or a bucket key
PADDED_KEY = "ts_padded"  # non-tensor: the chunk travels padded; the learner converts it on arrival (point 5)
SEQ_KEY = "ts_seq"  # non-tensor: the ticket of a queued call (streaming_worker, stream_exec.OpPipeline)
TOKEN_COEF_KEY = "ts_token_coef"  # [B, R] per-token coefficient, zero off the scored tokens
TEACHER_KEY = "ts_teacher_log_prob"  # [B, R] teacher log-probs of the scored tokens (OPD)
ROLLOUT_LP_KEY = "ts_rollout_log_prob"  # [B, R] optional: the rollout's log-probs, for the agreement metric
LP_DIFF_METRIC = "stream/rollout_logprob_diff_max"  # max |log p_rollout - log p_learner| over scored tokens
KL_SUM_METRIC = "stream/opd_reverse_kl_sum"  # OPD: sum of log pi - log p_teacher over scored tokens (at θ_k)
KL_TOKENS_METRIC = "stream/opd_reverse_kl_tokens"
ADV_CLAMP_KEY = "ts_opd_clamp"  # non-tensor: |log pi - log p_teacher| bound (verl's loss_max_clamp), or None
DISTILL_LOSS_KEY = "ts_distill_loss"  # non-tensor: verl's distillation estimator (k1 when absent)
SUPERVISED_KEY = "ts_distill_supervised"  # non-tensor: True: the estimator is the loss; absent/False: -estimator is A_t
REF_LP_KEY = "ts_ref_log_prob"  # [B, R] reference log-probs of the response tokens (actor.use_kl_loss)
PART_KEY = "ts_part"  # non-tensor: the terms this backward carries, one of PARTS (point 6)
PARTS = ("all", "policy", "independent")
KL_LOSS_METRIC = "stream/kl_loss_sum"  # sum_{i,t} w_{i,t} kl_{i,t} of the chunk (unnormalised)
ENTROPY_METRIC = "stream/entropy_sum"  # sum_{i,t} w_{i,t} H_{i,t} of the chunk (unnormalised)


def chunk_refused(rule: str, why: str, fix: str) -> StreamingInputError:
    """A chunk input refused before any work: the error to raise, in rule / why / fix form."""
    return StreamingInputError(rule_message(rule, why, fix))


@dataclass(frozen=True)
class IndependentTerms:
    """The advantage-free terms of verl's actor loss (point 6): KL to the reference, entropy bonus."""

    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.0
    entropy_coeff: float = 0.0

    @property
    def active(self) -> bool:
        """True when a chunk's loss has more than the policy term."""
        return self.use_kl_loss or self.entropy_coeff != 0.0

    @classmethod
    def from_actor_config(cls, actor: Any) -> "IndependentTerms":
        """From verl's ``actor_rollout_ref.actor`` section (the keys verl's ``ppo_loss`` reads)."""
        read = actor.get if hasattr(actor, "get") else (lambda key, default=None: getattr(actor, key, default))
        terms = cls(use_kl_loss=bool(read("use_kl_loss", False)), kl_loss_type=str(read("kl_loss_type", "low_var_kl")),
                    kl_loss_coef=float(read("kl_loss_coef", 0.0) or 0.0),
                    entropy_coeff=float(read("entropy_coeff", 0.0) or 0.0))
        if terms.use_kl_loss:
            kl_per_token(torch.zeros(1, 1), torch.zeros(1, 1), terms.kl_loss_type)  # refuses an unknown type now
        if not (math.isfinite(terms.kl_loss_coef) and math.isfinite(terms.entropy_coeff)):
            raise StreamingConfigError(rule_message(
                f"actor_rollout_ref.actor.kl_loss_coef={terms.kl_loss_coef} and entropy_coeff={terms.entropy_coeff} "
                "must be finite",
                "they multiply every token's KL and entropy gradient", "set both to finite numbers"))
        return terms


NO_TERMS = IndependentTerms()


def exact_micro_batch_size(rows: int, cap: int | None) -> int:
    """The largest micro-batch size <= ``cap`` that divides ``rows`` (verl's fixed micro-batching needs an exact split)."""
    rows = int(rows)
    return max(d for d in range(1, min(rows, int(cap or rows)) + 1) if rows % d == 0)


def pad_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_token_id: int,
              response_masks: Sequence[Sequence[int]] | None = None) -> dict:
    """verl's left/right padded layout: prompts left-padded, responses right-padded.

    Returns ``input_ids``, ``attention_mask``, ``position_ids`` [B, P + R], ``prompts`` [B, P],
    ``responses`` and ``response_mask`` [B, R]. Every response token is attended to; only the
    tokens whose ``response_masks`` entry is 1 are scored (default: all of them; multi-turn
    trajectories pass 0 for tool-observation tokens, as verl's agent loop does).
    """
    n_rows, p_len, r_len = len(prompts), max(len(p) for p in prompts), max(len(r) for r in responses)
    prompt_ids = torch.full((n_rows, p_len), pad_token_id, dtype=torch.long)  # [B, P]
    prompt_mask = torch.zeros(n_rows, p_len, dtype=torch.long)  # [B, P]
    response_ids = torch.full((n_rows, r_len), pad_token_id, dtype=torch.long)  # [B, R]
    response_mask = torch.zeros(n_rows, r_len, dtype=torch.long)  # [B, R]
    for b, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[b, p_len - len(p):] = torch.tensor(list(p), dtype=torch.long)
        prompt_mask[b, p_len - len(p):] = 1
        response_ids[b, : len(r)] = torch.tensor(list(r), dtype=torch.long)
        response_mask[b, : len(r)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)  # [B, P + R]
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P + R]
    if response_masks is not None:
        response_mask = torch.zeros(n_rows, r_len, dtype=torch.long)  # [B, R]
        for b, m in enumerate(response_masks):
            response_mask[b, : len(m)] = torch.tensor([1 if x else 0 for x in m], dtype=torch.long)
    return {
        "input_ids": torch.cat([prompt_ids, response_ids], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "prompts": prompt_ids,
        "responses": response_ids,
        "response_mask": response_mask,
    }


def build_stream_chunk(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    coefs: Sequence[float],
    dest: str,
    *,
    dp_size: int,
    pad_token_id: int,
    temperature: float = 1.0,
    response_masks: Sequence[Sequence[int]] | None = None,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    ref_log_probs: Sequence[Sequence[float]] | None = None,
    padded: bool = False,
):
    """The TensorDict ``stream_backward`` takes, padded to a multiple of ``dp_size`` rows; ``padded``: left/right
    padded and marked, for the learner to convert on arrival (point 5), instead of in verl's no-padding layout.

    ``response_masks`` (optional, one 0/1 list per response) marks the scored tokens; the
    planner must have been given the same count (``num_tokens = sum(mask)``).
    ``rollout_log_probs`` (optional, one list per response): the loss then also reports
    ``stream/rollout_logprob_diff_max``, the rollout-vs-learner check verl's old-log-prob
    forward exists for, from the backward's own forward (same weights θ_k).
    ``ref_log_probs`` (optional, one list per response): the reference model's log-probs of the
    response tokens, for the KL term (point 6; ``attach_ref_log_probs`` computes them on the engine).
    """
    from tensordict import TensorDict

    _check_rows(prompts, responses, coefs, dest, response_masks)
    if ref_log_probs is not None and (len(ref_log_probs) != len(responses) or any(
            len(r) < len(o) for r, o in zip(ref_log_probs, responses))):
        raise chunk_refused("ref_log_probs must give one value per response token of every row",
                       "the KL term pairs each token's log-prob with the reference's at the same position",
                       "pass the reference log-probs of each trajectory's response, unshifted")
    n_pad = (-len(prompts)) % int(dp_size)
    prompts = list(prompts) + [prompts[-1]] * n_pad
    responses = list(responses) + [responses[-1]] * n_pad
    masks = None if response_masks is None else list(response_masks) + [[0] * len(responses[-1])] * n_pad
    tensors = pad_batch(prompts, responses, pad_token_id, masks)
    if n_pad:
        tensors["response_mask"][-n_pad:] = 0  # padding rows score no token
    tensors[COEF_KEY] = torch.tensor([float(c) for c in coefs] + [0.0] * n_pad, dtype=torch.float64)  # [B]
    if rollout_log_probs is not None:
        tensors[ROLLOUT_LP_KEY] = _rows_to_tensor(rollout_log_probs, tensors["responses"].shape[1], torch.float32, n_pad)
    if ref_log_probs is not None:
        width = tensors["responses"].shape[1]
        tensors[REF_LP_KEY] = _rows_to_tensor([list(r)[:width] for r in ref_log_probs], width, torch.float32, n_pad)
    td = TensorDict(tensors, batch_size=[len(prompts)])
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest})
    return _to_layout(td, padded)


def _to_layout(td, padded: bool):
    """The chunk as it travels: marked padded (point 5), or in verl's no-padding layout."""
    if padded:
        va.assign_non_tensor(td, **{PADDED_KEY: True})
        return td
    return va.to_no_padding(td)


def on_arrival(chunk):
    """The chunk in verl's no-padding layout: a padded one (``PADDED_KEY``, point 5) converted, any other as given."""
    if not va.non_tensor(chunk, PADDED_KEY, False):
        return chunk
    va.assign_non_tensor(chunk, **{PADDED_KEY: False})
    return va.to_no_padding(chunk)


def build_stream_parts(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    coefs: Sequence[float],
    dest: str,
    *,
    dp_size: int,
    pad_token_id: int,
    temperature: float = 1.0,
    response_masks: Sequence[Sequence[int]] | None = None,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    ref_log_probs: Sequence[Sequence[float]] | None = None,
    padded: bool = False,
) -> list:
    """``build_stream_chunk``'s chunk as ``dp_size`` chunks, one per data-parallel rank (point 4); ``padded`` as there.

    Rank i receives the rows verl's split would give it: the chunk's rows padded to a multiple of ``dp_size``
    (padding rows as in point 2), cut into equal contiguous parts. Each part is a chunk of its own rows (its own
    no-padding layout and widths, as a one-rank chunk of those rows), so the dispatch sends it without splitting.
    """
    _check_rows(prompts, responses, coefs, dest, response_masks)
    dp_size = int(dp_size)
    rows, n_pad = len(prompts), (-len(prompts)) % dp_size
    per_part = (rows + n_pad) // dp_size
    masks = [list(m) for m in response_masks] if response_masks is not None else [[1] * len(r) for r in responses]
    pad = {"prompt": prompts[-1], "response": responses[-1], "mask": [0] * len(responses[-1]), "coef": 0.0,
           "rollout": None if rollout_log_probs is None else rollout_log_probs[-1],
           "ref": None if ref_log_probs is None else ref_log_probs[-1]}
    columns = {"prompt": list(prompts), "response": list(responses), "mask": masks, "coef": list(coefs),
               "rollout": None if rollout_log_probs is None else list(rollout_log_probs),
               "ref": None if ref_log_probs is None else list(ref_log_probs)}
    columns = {k: None if v is None else v + [pad[k]] * n_pad for k, v in columns.items()}
    parts = []
    for i in range(dp_size):
        cut = {k: None if v is None else v[i * per_part:(i + 1) * per_part] for k, v in columns.items()}
        parts.append(build_stream_chunk(cut["prompt"], cut["response"], cut["coef"], dest, dp_size=1,
                                        pad_token_id=pad_token_id, temperature=temperature, response_masks=cut["mask"],
                                        rollout_log_probs=cut["rollout"], ref_log_probs=cut["ref"], padded=padded))
    return parts


def attach_ref_log_probs(chunk, worker_group, *, ref_in_actor: bool = False, dp_size: int = 1,
                         micro_batch_cap: int | None = None) -> torch.Tensor:
    """``chunk[ts_ref_log_prob]`` := the reference log-probs of its rows, computed as verl's trainer does.

    verl's ``_compute_ref_log_prob``: ``compute_ref_log_prob`` on the worker group holding the
    reference model, or (``ref_in_actor``: LoRA) the actor's ``compute_log_prob`` with the adapter
    disabled; no entropy, no loss. Per chunk, before its backward: the reference model never
    changes, so a row's reference log-probs are the same whenever they are computed. Returns them [B, R].
    """
    query = chunk.copy()
    rows = int(chunk.batch_size[0])
    extra = {"no_lora_adapter": True} if ref_in_actor else {}
    va.assign_non_tensor(query, calculate_entropy=False, compute_loss=False,
                         micro_batch_size_per_gpu=exact_micro_batch_size(rows // max(int(dp_size), 1), micro_batch_cap),
                         **extra)
    output = worker_group.compute_log_prob(query) if ref_in_actor else worker_group.compute_ref_log_prob(query)
    ref = va.unpad_response(va.td_get(output, "log_probs"), query).float()  # [B, R]
    chunk[REF_LP_KEY] = ref
    return ref


def build_token_chunk(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    token_coefs: Sequence[Sequence[float]],
    *,
    dp_size: int,
    pad_token_id: int,
    teacher_log_probs: Sequence[Sequence[float]] | None = None,
    opd_clamp: float | None = None,
    dest: str = "direct",
    temperature: float = 1.0,
    rollout_log_probs: Sequence[Sequence[float]] | None = None,
    distill_loss: str | None = None,
    supervised: bool = False,
    coef: float = 1.0,
    padded: bool = False,
):
    """A per-token chunk for ``stream_token_backward``, padded to a multiple of ``dp_size`` rows; ``padded`` as in
    ``build_stream_chunk`` (point 5).

    Row i scores the response tokens whose ``token_coefs[i]`` entry is non-zero (its
    ``response_mask``, from which verl counts tokens, is 1 exactly there). ``teacher_log_probs``
    (OPD) gives log p_teacher for those tokens (any value elsewhere; 0 by convention);
    ``rollout_log_probs`` the rollout's, for the loss's rollout-vs-learner check (as in ``build_stream_chunk``).
    ``distill_loss``: verl's estimator name (k1 when None); ``supervised``: the estimator is the loss itself
    (``stream_loss.py`` point 9), else A_t = -estimator, detached; ``coef``: every real row's ``ts_coef`` (verl's
    ``distillation_loss_coef`` with task rewards, else 1).
    """
    from tensordict import TensorDict

    _check_rows(prompts, responses, [1.0] * len(responses), dest, None)
    _check_token_rows(responses, token_coefs, teacher_log_probs, opd_clamp)
    n_pad = (-len(prompts)) % int(dp_size)
    prompts = list(prompts) + [prompts[-1]] * n_pad
    responses = list(responses) + [responses[-1]] * n_pad
    coefs = [list(map(float, c)) for c in token_coefs] + [[0.0] * len(responses[-1])] * n_pad
    masks = [[1 if c != 0 else 0 for c in row] for row in coefs]
    tensors = pad_batch(prompts, responses, pad_token_id, masks)
    width = tensors["responses"].shape[1]
    tensors[TOKEN_COEF_KEY] = _rows_to_tensor(coefs, width)  # [B, R]
    for key, rows in ((TEACHER_KEY, teacher_log_probs), (ROLLOUT_LP_KEY, rollout_log_probs)):
        if rows is not None:
            tensors[key] = _rows_to_tensor(rows, width, torch.float32, n_pad)  # [B, R]
    if (distill_loss is not None or supervised) and teacher_log_probs is None:
        raise StreamingInputError(rule_message(
            f"distill_loss={distill_loss!r} (supervised={supervised}) needs teacher_log_probs",
            "a token's distillation loss compares the student's log-prob with the teacher's",
            "pass the turn's teacher log-probs"))
    if not math.isfinite(float(coef)):
        raise StreamingInputError(rule_message(f"coef must be finite (got {coef!r})", "it multiplies every row's loss",
                                               "pass verl's distillation_loss_coef"))
    tensors[COEF_KEY] = torch.tensor([float(coef)] * (len(prompts) - n_pad) + [0.0] * n_pad, dtype=torch.float64)  # [B]
    td = TensorDict(tensors, batch_size=[len(prompts)])
    extra = {} if opd_clamp is None else {ADV_CLAMP_KEY: float(opd_clamp)}
    if distill_loss is not None:
        extra[DISTILL_LOSS_KEY] = str(distill_loss)
    if supervised:
        extra[SUPERVISED_KEY] = True
    va.assign_non_tensor(td, temperature=float(temperature), **{DEST_KEY: dest}, **extra)
    return _to_layout(td, padded)


def _rows_to_tensor(rows: Sequence[Sequence[float]], width: int, dtype=torch.float64, n_pad: int = 0) -> torch.Tensor:
    """Right-padded [B + n_pad, width]; the ``n_pad`` data-parallel padding rows are zeros (they score nothing)."""
    out = torch.zeros(len(rows) + n_pad, width, dtype=dtype)  # [B, R], right-padded like the responses
    for b, row in enumerate(rows):
        out[b, : len(row)] = torch.tensor(list(row), dtype=dtype)
    return out


def _check_rows(prompts, responses, coefs, dest, masks) -> None:
    if masks is not None and (len(masks) != len(responses) or any(len(m) != len(r) for m, r in zip(masks, responses))):
        raise chunk_refused(
            "response_masks must give one 0/1 entry per response token of every row",
            "the mask decides which tokens are scored; a shifted mask scores the wrong tokens",
            "pass the trajectory's own response_mask (e.g. from verl's agent loop), unpadded")
    if not (len(prompts) == len(responses) == len(coefs)) or not prompts:
        raise chunk_refused(
            f"a chunk needs as many prompts, responses and coefficients, at least one "
            f"(got {len(prompts)}, {len(responses)}, {len(coefs)})",
            "row i of the chunk is trajectory i, weighted by coefficient i",
            "pass one (prompt, response, coefficient) per trajectory of the BackwardOp")
    if any(len(p) == 0 for p in prompts) or any(len(r) == 0 for r in responses):
        raise chunk_refused(
            "every chunk row needs a non-empty prompt and a non-empty response",
            "verl's no-padding layout locates a response by its prompt; an empty one has no token to score",
            "drop empty trajectories before planning (they carry no gradient)")
    bad = [c for c in coefs if not math.isfinite(float(c))]
    if bad or not isinstance(dest, str) or not dest:
        raise chunk_refused(
            f"chunk coefficients must be finite and dest a non-empty string (got {bad or dest!r})",
            "a NaN coefficient poisons the batch gradient; dest names where the gradient goes",
            "use the coefficients and destination of the planner's BackwardOp")


def _check_token_rows(responses, token_coefs, teacher_log_probs, opd_clamp) -> None:
    lengths_ok = len(token_coefs) == len(responses) and all(len(c) == len(r) for c, r in zip(token_coefs, responses))
    if teacher_log_probs is not None:
        lengths_ok = lengths_ok and len(teacher_log_probs) == len(responses) and all(
            len(t) == len(r) for t, r in zip(teacher_log_probs, responses))
    if not lengths_ok:
        raise chunk_refused(
            "token_coefs (and teacher_log_probs) must give one value per response token of every row",
            "a per-token coefficient is aligned with the response token it weights; a shifted "
            "list weights the wrong tokens",
            "pass, for every row, lists as long as its response (0 off the scored tokens)")
    values = [float(x) for row in token_coefs for x in row]
    values += [float(x) for row in (teacher_log_probs or []) for x in row]
    if not all(math.isfinite(v) for v in values) or (opd_clamp is not None and not float(opd_clamp) > 0):
        raise chunk_refused(
            f"token coefficients and teacher log-probs must be finite, opd_clamp positive or None (got {opd_clamp!r})",
            "one NaN poisons the batch gradient",
            "check the teacher's scores (the turn teacher validates them) before building the chunk")

