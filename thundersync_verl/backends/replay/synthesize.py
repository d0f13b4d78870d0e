"""Synthesised recordings: a published agentic workload's shape, written in the replay format.

Why:
1. The speed-up of streaming depends on the shape of the rollout: how many turns a trajectory
   takes, how many tokens each turn decodes, how long each call and tool takes, with the heavy
   tail of agentic SWE runs. The tiny CPU model does not produce that shape (one to four short
   turns), so the shape is synthesised: a scripted agent answers each generate call, and the
   ``replay`` backend serves the result like any recording.
2. Synthesis runs online, inside a real run: the agent loop builds each turn's prompt from the
   previous turns and the tools' real output, which only the loop itself knows. With
   ``engine_kwargs.replay.synthesize=<shape>`` the replay server answers from ``AgenticScript``
   instead of a file, and appends every call to ``engine_kwargs.replay.path`` with its synthetic
   service time (not slept: synthesis is fast). Every later replay of that file then gives every
   mode the same trajectories, tokens and per-call times.
3. Each answer is a real turn of the embedded task: a python tool call (padded with a comment to
   its drawn token count) until the trajectory's drawn turn count, then ``<answer>N</answer>``,
   right or wrong by a draw. Its log-probs are the policy model's at the weights it starts from
   (the model at ``actor_rollout_ref.model.path``), so verl's bypass mode and ThunderSync's
   rollout-vs-learner check see the learner's own log-probs on step 1.
4. A trajectory is recognised in later turns by a marker in its first tool call's comment
   (``#t<serial>``), and its turn by the number of tool responses in the prompt.
5. ``SHAPES["paper"]`` is the simulator's paper preset (``sim/presets.PAPER_WORKLOAD``) scaled down
   to the tiny model's context: turns lognormal (median 30 -> 4, the same sigma 0.8, group
   correlation 0.72), tokens per turn lognormal (median 110 -> 32, sigma 0.6), a median turn's
   service time 110 x 0.013 s = 1.43 s, tools lognormal (0.75 s, sigma 1.0), verifier lognormal
   (8.5 s, sigma 0.5). Seconds are the published ones; the replay's ``time_scale`` (and the
   tools' and verifier's latency ``scale``) shrink them together.
"""

from __future__ import annotations

import dataclasses
import math
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Optional

from thundersync_verl.backends.replay.record import RecordFile
from thundersync_verl.backends.replay.recording import GenerateRecord
from thundersync_verl.envs import protocol

MARKER_RE = re.compile(r"#t(\d+)")
TASK_RE = re.compile(r"Compute `([0-9+\-*]+)`")


@dataclass(frozen=True)
class AgenticShape:
    """A scaled-down agentic workload (module docstring, point 5); seconds are at time scale 1."""

    turns_median: float = 4.0
    turns_sigma: float = 0.8
    icc: float = 0.72  # within-group correlation of the turn count
    min_turns: int = 2  # an agentic trajectory calls a tool at least once
    max_turns: int = 12
    gen_tokens_median: float = 32.0
    gen_tokens_sigma: float = 0.6
    max_gen_tokens: int = 96
    turn_gen_s: float = 1.43  # service time of a median turn (the decode rate is this / gen_tokens_median)
    prefill_s_per_token: float = 2e-5
    correct_prob: float = 0.5
    tool_median_s: float = 0.75
    tool_sigma: float = 1.0
    tool_max_s: float = 20.0
    reward_median_s: float = 8.5
    reward_sigma: float = 0.5
    reward_max_s: float = 40.0
    response_tokens: int = 640  # data.max_response_length: the typical trajectory (~200 tokens) and most of the tail
    seed: int = 0

    @property
    def decode_s_per_token(self) -> float:
        return self.turn_gen_s / self.gen_tokens_median

    def service_s(self, new_prompt_tokens: int, gen_tokens: int) -> float:
        return self.prefill_s_per_token * new_prompt_tokens + self.decode_s_per_token * gen_tokens

    def overrides(self) -> list[str]:
        """The run's settings for this shape (hydra overrides): turn cap, lengths, tool and verifier latency
        shapes (their ``scale`` is the caller's: it is the time scale of the whole workload)."""
        env = "thundersync.env"
        out = [f"{env}.max_tool_turns={self.max_turns - 1}", f"data.max_response_length={self.response_tokens}",
               f"actor_rollout_ref.rollout.max_model_len={self.response_tokens + 64}"]
        for key, (median, sigma, cap) in {"tool_latency": (self.tool_median_s, self.tool_sigma, self.tool_max_s),
                                          "verifier_latency": (self.reward_median_s, self.reward_sigma,
                                                               self.reward_max_s)}.items():
            out += [f"{env}.{key}.kind=lognormal", f"++{env}.{key}.median_s={median}", f"++{env}.{key}.sigma={sigma}",
                    f"++{env}.{key}.max_s={cap}"]  # ++: the recipe's latency sections list only kind and scale
        return out


SHAPES = {"paper": AgenticShape()}


@dataclass
class _Plan:
    expression: str
    answer: int
    turns: int
    correct: bool
    gen_tokens: list  # per tool turn
    context: int = 0  # tokens of the last call's prompt and answer (what a next turn need not prefill)


class AgenticScript:
    """Answers generate calls with scripted turns of the embedded task and records them (module docstring)."""

    def __init__(self, shape: AgenticShape, tokenizer, model, record_path: str):
        self.shape, self.tokenizer, self.model = shape, tokenizer, model
        self.file = RecordFile(record_path)
        self.plans: dict[int, _Plan] = {}
        self.occurrences: dict[str, int] = {}
        self._lock = threading.Lock()
        self._last = 0.0

    @classmethod
    def load(cls, shape_name: str, model_path: str, record_path: str) -> "AgenticScript":
        """The script for ``SHAPES[shape_name]`` with the policy model and tokenizer at ``model_path``."""
        if shape_name not in SHAPES:
            raise ValueError(f"engine_kwargs.replay.synthesize={shape_name!r} is not a known shape; known: {sorted(SHAPES)}")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype="float32", attn_implementation="sdpa").eval()
        return cls(SHAPES[shape_name], tokenizer, model, record_path)

    def next_generate(self, prompt_ids, *, temperature: Optional[float] = None, max_tokens: Optional[int] = None,
                      version: int = 0) -> GenerateRecord:
        prompt_ids = [int(t) for t in prompt_ids]
        temperature = 1.0 if temperature is None else float(temperature)
        with self._lock:
            text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
            serial, plan = self._plan_for(text)
            turn = text.count(protocol.TOOL_RESPONSE_OPEN)
            response = self._turn_ids(serial, plan, turn, max_tokens)
            start = max(time.time(), self._last + 1e-6)
            self._last = start
            t0 = self.file.origin(start)
        log_probs = self._log_probs(prompt_ids, response, temperature)
        stop = "length" if max_tokens is not None and len(response) >= int(max_tokens) and response[-1] != self.eos else "completed"
        service = self.shape.service_s(max(len(prompt_ids) - plan.context, 0), len(response))
        plan.context = len(prompt_ids) + len(response)
        record = {"kind": "generate", "request_id": f"synth{serial}_{turn}", "prompt_ids": prompt_ids,
                  "response_ids": response, "log_probs": log_probs, "stop_reason": stop, "start_s": start - t0,
                  "end_s": start - t0 + service, "version": int(version), "temperature": temperature,
                  "max_tokens": None if max_tokens is None else int(max_tokens), "pid": 0, "synthetic": True}
        self.file.append(record)
        return GenerateRecord(prompt_ids=tuple(prompt_ids), response_ids=response, log_probs=log_probs, stop_reason=stop,
                              start_s=record["start_s"], end_s=record["end_s"], version=int(version),
                              temperature=temperature, max_tokens=record["max_tokens"], line=serial)

    # -- the script -------------------------------------------------------------------------
    @property
    def eos(self) -> int:
        return int(self.tokenizer.eos_token_id)

    def _plan_for(self, text: str) -> tuple[int, _Plan]:
        marker = MARKER_RE.search(text)
        if marker is not None:
            return int(marker.group(1)), self.plans[int(marker.group(1))]
        task = TASK_RE.search(text)
        if task is None:
            raise ValueError(f"synthesize: the prompt holds no task `Compute \\`...\\`` (it starts {text[:80]!r}); "
                             "the scripted agent only knows the embedded arithmetic task")
        expression = task.group(1)
        k = self.occurrences.get(expression, 0)
        self.occurrences[expression] = k + 1
        serial = len(self.plans)
        self.plans[serial] = self._draw(expression, k)
        return serial, self.plans[serial]

    def _draw(self, expression: str, k: int) -> _Plan:
        """Turns (group-correlated lognormal), correctness and tokens per tool turn of sample ``k`` of a prompt."""
        s = self.shape
        group = random.Random(f"{s.seed}:{expression}").gauss(0.0, 1.0)
        rng = random.Random(f"{s.seed}:{expression}:{k}")
        z = math.sqrt(s.icc) * group + math.sqrt(1.0 - s.icc) * rng.gauss(0.0, 1.0)
        turns = min(s.max_turns, max(s.min_turns, round(s.turns_median * math.exp(s.turns_sigma * z))))
        gen = [min(s.max_gen_tokens, round(s.gen_tokens_median * math.exp(s.gen_tokens_sigma * rng.gauss(0.0, 1.0))))
               for _ in range(turns - 1)]
        value = eval(expression, {"__builtins__": {}})  # digits and + - * only (TASK_RE)
        return _Plan(expression, int(value), turns, rng.random() < s.correct_prob, gen)

    def _turn_ids(self, serial: int, plan: _Plan, turn: int, max_tokens: Optional[int]) -> list[int]:
        budget = int(max_tokens) if max_tokens is not None else 1 << 30
        answer = self._encode(protocol.answer_text(plan.answer if plan.correct else plan.answer + 1))
        if turn >= plan.turns - 1:
            return answer[:budget]
        call = self._tool_call(serial, plan.expression, plan.gen_tokens[turn])
        return call if len(call) <= budget else answer[:budget]

    def _tool_call(self, serial: int, expression: str, target: int) -> list[int]:
        """``print(expr)`` with the marker and a comment padded to at least ``target`` tokens."""
        code = f"print({expression})#t{serial}"
        ids = self._encode(protocol.tool_call_text(code))
        while len(ids) < target:
            code += f" {expression}"
            ids = self._encode(protocol.tool_call_text(code))
        return ids

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos]

    def _log_probs(self, prompt_ids: list, response: list, temperature: float) -> list[float]:
        import torch

        ids = torch.tensor([prompt_ids + response])
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature  # [R, V]
        lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None])[:, 0]  # [R]
        return [float(x) for x in lp]


def shape_summary(shape: AgenticShape) -> dict:
    return dataclasses.asdict(shape) | {"decode_s_per_token": shape.decode_s_per_token}
