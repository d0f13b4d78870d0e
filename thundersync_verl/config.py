"""``ThunderSyncConfig``: the ``thundersync.*`` keys of the hydra config, typed once at the edge.

Why:
1. verl passes the ``thundersync`` section through untouched, as an untyped node. Reading it as a
   dict in every module spread its defaults and checks over several files and left some keys
   unchecked. ``ThunderSyncConfig.from_verl(config)`` builds it once; modules read the object.
2. Every key has a type, a range and a one-line doc on its field (``fields(...)[i].metadata``).
   A bad value raises ``StreamingConfigError`` in rule / why / fix form NAMING THE KEY
   (``thundersync.chunk_size``); the field's doc is the "why". Unknown keys are refused with the
   known ones listed, so a typo cannot silently keep a default.
3. Values follow what hydra gives: yaml ints are ints and yaml floats floats. An integer key also
   takes an integral float (``2e9``) or an integer string (``"2"``) and refuses anything
   non-integral; a boolean key takes only true/false; ``None`` only where the field says so.
4. The classes stand on verl's own config base (``verl.base_config.BaseConfig``, reached through
   ``verl_adapter``), as verl's ``McoreActorConfig`` does: read-only after construction (setting a
   field raises ``FrozenInstanceError``) and readable as a mapping (``cfg.get("chunk_size")``).
5. Only the ``thundersync`` keys are checked here. Rules that need the rest of verl's config
   (``learner_forward=fused`` needs ``actor_rollout_ref.rollout.calculate_log_probs``) stay with
   the trainer.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar

from thundersync_verl import verl_adapter as va
from thundersync_verl.core.bucket_memory import BUCKET_DEVICES
from thundersync_verl.core.errors import StreamingConfigError, rule_message
from thundersync_verl.core.tail_policy import ROUNDS as TAIL_ROUNDS
from thundersync_verl.envs.latency import KINDS, LatencyModel

MODES = ("sync", "async", "fully_async", "thundersync")
LEARNER_FORWARDS = ("fused", "separate")
GRANULARITIES = ("turn", "trajectory")
TEACHER_CALLS = ("turn", "trajectory")


class _Refused(Exception):
    """A value outside its key's type or range; carries what the key expects."""


# ----- checkers: (value, key) -> the typed value, or _Refused(what the key expects) ---------------
def _integer(low: int) -> Callable:
    def check(value, key):
        if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
            value = int(value.strip())
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise _Refused(f"an integer >= {low}")
        return value
    return check


def _number(*, above: float | None = None, at_least: float | None = None, at_most: float | None = None) -> Callable:
    bounds = [f"> {above}" if above is not None else None, f">= {at_least}" if at_least is not None else None,
              f"<= {at_most}" if at_most is not None else None]
    expected = "a finite number " + " and ".join(b for b in bounds if b)

    def check(value, key):
        try:
            number = float(value) if not isinstance(value, bool) and isinstance(value, (int, float, str)) else math.nan
        except ValueError:
            number = math.nan
        if not (math.isfinite(number) and (above is None or number > above) and (at_least is None or number >= at_least)
                and (at_most is None or number <= at_most)):
            raise _Refused(expected)
        return number
    return check


def _boolean(value, key):
    if not isinstance(value, bool):
        raise _Refused("true or false")
    return value


def _choice(*options: str) -> Callable:
    def check(value, key):
        if value not in options:
            raise _Refused(f"one of {options}")
        return value
    return check


def _path(value, key):
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise _Refused("a non-empty path")
    return str(os.fspath(value))


def _optional(check: Callable, meaning: str) -> Callable:
    def optional(value, key):
        if value is None:
            return None
        try:
            return check(value, key)
        except _Refused as refused:
            raise _Refused(f"{refused} or null ({meaning})") from None
    return optional


def _latency(value, key):
    """A ``LatencyModel`` or a mapping of its keys (``envs/latency.py``); sub-key errors name the sub-key."""
    if isinstance(value, LatencyModel):
        return value
    if not isinstance(value, Mapping):
        raise _Refused("a mapping of latency keys, e.g. {kind: constant, median_s: 0.0}")
    known = {f.name: f for f in fields(LatencyModel)}
    _refuse_unknown(value, known, key)
    typed = {}
    for name, raw in value.items():  # type first, by each key's default: kind is a name, seed an integer
        default = known[name].default
        check = _choice(*KINDS) if name == "kind" else _integer(0) if isinstance(default, int) else _number()
        typed[name] = _checked(check, raw, f"{key}.{name}", _LATENCY_WHY, lambda: default)
    try:
        return LatencyModel(**typed)
    except ValueError as err:  # LatencyModel's own ranges; its messages start with "LatencyModel.<key>"
        name = next((n for n in known if f"LatencyModel.{n} " in str(err)), None)
        raise StreamingConfigError(rule_message(
            f"{key}.{name}: {err}" if name else f"{key}: {err}", _LATENCY_WHY,
            f"change {key}.{name or '<key>'} (envs/latency.py documents the shape and its keys)")) from None


_LATENCY_WHY = "the heavy-tailed latency model of envs/latency.py draws every call's extra seconds from these keys"


# ----- the generic parts ------------------------------------------------------------------------
def _key(default: Any, check: Callable, doc: str, *, factory: Callable | None = None):
    """A field: its default (or factory), its checker (type and range) and its one-line doc."""
    meta = {"check": check, "doc": doc}
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def _hydra(value: Any) -> str:
    """A value as it is written on a hydra command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, LatencyModel):
        return f"{{kind: {value.kind}, scale: {value.scale}}}"
    if isinstance(value, _Section):
        return "{" + ", ".join(f"{k}: {_hydra(getattr(value, k))}" for k in value.key_docs()) + "}"
    return str(value)


def _checked(check: Callable, value: Any, key: str, doc: str, default: Callable[[], Any]) -> Any:
    """``check(value)``, or a StreamingConfigError naming ``key``: the doc says why, the default shows a fix."""
    try:
        return check(value, key)
    except _Refused as refused:
        raise StreamingConfigError(rule_message(
            f"{key} must be {refused}, got {value!r}", doc, f"set {key} to {refused}, e.g. {key}={_hydra(default())} (the default)"
        )) from None


def _refuse_unknown(section: Mapping, known, prefix: str) -> None:
    unknown = sorted(str(k) for k in section if k not in known)
    if unknown:
        close = [f"{prefix}.{k} to {prefix}.{match[0]}" for k in unknown
                 if (match := difflib.get_close_matches(k, [str(n) for n in known], n=1))]
        raise StreamingConfigError(rule_message(
            f"unknown key(s) {', '.join(f'{prefix}.{k}' for k in unknown)}; the known keys of {prefix} are: "
            f"{', '.join(sorted(known))}",
            "a misspelt key would otherwise be ignored and its default used without a word",
            (f"rename {', '.join(close)} (the closest known key); otherwise " if close else "") +
            "correct the spelling, or remove the key (the keys are documented in thundersync_verl/config.py)"))


class _Section:
    """Checks every field of a ``thundersync`` section at construction (point 2)."""

    PREFIX: ClassVar[str] = "thundersync"

    def __post_init__(self) -> None:
        for f in fields(self):
            if "check" in f.metadata:
                default = (lambda f=f: f.default if f.default_factory is MISSING else f.default_factory())
                typed = _checked(f.metadata["check"], getattr(self, f.name), f"{self.PREFIX}.{f.name}", f.metadata["doc"], default)
                object.__setattr__(self, f.name, typed)  # verl's BaseConfig refuses a second plain set

    @classmethod
    def key_docs(cls) -> dict[str, str]:
        """``{key: one-line doc}`` of this section."""
        return {f.name: f.metadata["doc"] for f in fields(cls) if "check" in f.metadata}

    @classmethod
    def from_mapping(cls, section: Mapping):
        """Build from a plain mapping (unknown keys refused; missing keys keep their defaults)."""
        _refuse_unknown(section, cls.key_docs(), cls.PREFIX)
        return cls(**{str(k): v for k, v in section.items()})


def _section(cls) -> Callable:
    def check(value, key):
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise _Refused(f"a mapping with the keys {sorted(cls.key_docs())}")
        return cls.from_mapping(value)
    return check


# ----- the sections ----------------------------------------------------------------------------
@dataclass
class EnvConfig(_Section, va.base_config_cls()):
    """``thundersync.env``: the embedded tool-use task (``envs/agent_loop.py``, ``envs/reward.py``)."""

    PREFIX: ClassVar[str] = "thundersync.env"

    max_tool_turns: int = _key(3, _integer(0), "tool calls a trajectory may make before it must answer (0: no tools)")
    tool_timeout_s: float = _key(5.0, _number(above=0), "seconds a sandboxed tool call may run before it is reported as timed out")
    retry_prob: float = _key(0.2, _number(at_least=0, at_most=1),
                             "chance that a tool call answers 'sandbox busy, retry' instead of running (a transient failure)")
    trace_path: str | None = _key(None, _optional(_path, "no trace"), "JSONL file: one line of timings per finished trajectory")
    tool_latency: LatencyModel = _key(None, _latency, "extra latency of each tool call (envs/latency.py keys)", factory=LatencyModel)
    verifier_latency: LatencyModel = _key(None, _latency, "extra latency of each verifier call; the recipes pass it to "
                                          "reward.custom_reward_function.reward_kwargs", factory=LatencyModel)


@dataclass
class OPDConfig(_Section, va.base_config_cls()):
    """``thundersync.opd``: OPD turn streaming (``algos/opd/turn_teacher.py``, ``algos/opd/opd_stream.py``)."""

    PREFIX: ClassVar[str] = "thundersync.opd"

    granularity: str = _key("turn", _choice(*GRANULARITIES), "turn: each scored turn backpropagates at once (prefix "
                            "recompute; turns that land while the learner is busy share a row); trajectory: one row "
                            "per trajectory once its last turn is scored")
    teacher_calls: str = _key("turn", _choice(*TEACHER_CALLS), "turn: the agent loop scores each finished turn while "
                              "the next tool runs; trajectory: verl scores each whole trajectory when its loop ends")
    teacher_max_attempts: int = _key(3, _integer(1), "teacher calls per turn before the step fails loudly (1: no retry)")
    teacher_timeout_s: float | None = _key(120.0, _optional(_number(above=0), "no timeout"),
                                           "seconds one teacher attempt may take; a slower reply is a failed attempt")
    teacher_backoff_s: float = _key(0.5, _number(at_least=0), "sleep before retry k is teacher_backoff_s * k seconds")


@dataclass
class TailConfig(_Section, va.base_config_cls()):
    """``thundersync.tail``: tail batching (``step/tail_rounds.py``, ``core/tail_policy.py``)."""

    PREFIX: ClassVar[str] = "thundersync.tail"

    eta: float = _key(1.0, _number(at_least=1), "prompt groups launched per step over data.train_batch_size; the batch "
                      "is the first train_batch_size to complete, the others are aborted and their prompts queued "
                      "(1: off)")
    max_deferrals: int = _key(2, _integer(0), "a prompt aborted this many times is kept on its next run, whatever "
                              "its length")
    rounds: str = _key("dedicated", _choice(*TAIL_ROUNDS), "dedicated: queued prompts run in rounds of their own once "
                       "they fill one; mixed: in the next round, beside fresh prompts")

    @property
    def enabled(self) -> bool:
        return self.eta > 1.0


@dataclass
class ThunderSyncConfig(_Section, va.base_config_cls()):
    """The whole ``thundersync`` section; ``from_verl(config)`` is the one way in from a run's config."""

    PREFIX: ClassVar[str] = "thundersync"

    mode: str = _key("sync", _choice(*MODES), "the trainer the mode/ file selected; read by the trainers and reports")
    chunk_size: int = _key(8, _integer(1), "most ready trajectories (OPD: turns) that share one streamed backward")
    learner_forward: str = _key("fused", _choice(*LEARNER_FORWARDS), "fused: each backward's forward is the "
                                "old-log-prob check; separate: verl's own old-log-prob forward per arrival set")
    poll_s: float = _key(0.01, _number(above=0), "first pause between TransferQueue listings while waiting for arrivals; "
                                                      "each empty listing doubles it, up to max(poll_s, 0.08)")
    pipeline_depth: int = _key(2, _integer(1), "learner calls kept in flight (1: wait for each; 2: the next one queued)")
    coalesce: bool = _key(True, _boolean, "GRPO: while the learner is busy, arrivals wait to share the next chunk")
    call_efficiency: float = _key(0.0, _number(at_least=0, at_most=0.99), "GRPO: an idle learner's call waits for rows "
                                  "until their work is this share of the call (0: never; 0.9 where a call's fixed cost "
                                  "outweighs a row)")
    trajectory_timeout_s: float = _key(600.0, _number(above=0), "seconds a step waits for a missing trajectory "
                                       "before it fails without an optimizer step")
    weight_push_retries: int = _key(2, _integer(0), "times a failed weight push is repeated (the whole version) "
                                    "before the run stops; the rollout keeps its last complete version meanwhile")
    run_dir: str | None = _key(None, _optional(_path, "no traces"), "folder for event traces (JSONL) and per-step timeline PNGs")
    timeline_every: int = _key(1, _integer(0), "draw the timeline PNG of every N-th step under run_dir (0: never); the "
                               "event traces are written every step")
    memory_budget_bytes: int | None = _key(None, _optional(_integer(0), "unbudgeted"),
                                           "learner bytes the streamed gradient buckets may hold at once")
    bucket_device: str = _key("auto", _choice(*BUCKET_DEVICES), "where a learner rank's group buckets live: host "
                              "(pinned on accelerators), device, or auto (host on accelerators, device on CPU)")
    deterministic: bool = _key(False, _boolean, "GRPO: trajectories enter the learner in batch order and whole chunks, "
                               "so a step's sums do not depend on timing (bitwise-reproducible replays and resumes; less overlap)")
    reward_in_agent_loop: bool = _key(False, _boolean, "score each trajectory inside its agent-loop process with verl's "
                                      "own reward manager, not by a call to a RewardLoopWorker actor (custom or rule-based "
                                      "rewards; not with reward_model.enable)")
    stop_file: str | None = _key(None, _optional(_path, "no stop file"), "once this file exists the run stops at the next "
                                 "step boundary, saving a checkpoint there when trainer.save_freq > 0 (pre-emption, time limits)")
    env: EnvConfig = _key(None, _section(EnvConfig), "the embedded tool-use task", factory=EnvConfig)
    opd: OPDConfig = _key(None, _section(OPDConfig), "OPD turn streaming and its teacher calls", factory=OPDConfig)
    tail: TailConfig = _key(None, _section(TailConfig), "tail batching: launch more groups, train the first to "
                            "complete", factory=TailConfig)

    @classmethod
    def from_verl(cls, config: Any) -> "ThunderSyncConfig":
        """The ``thundersync`` section of a run's config (OmegaConf ``DictConfig`` or plain dict), typed.

        A missing or null section gives the defaults (the values the shipped recipes set).
        """
        return section_of(config, cls, "thundersync", "it holds the streaming trainer's settings")


def section_of(config: Any, cls, name: str, purpose: str):
    """The top-level section ``name`` of a run's config (OmegaConf or plain mapping) as ``cls``, typed.

    A missing or null section gives the defaults; ``purpose`` says in an error what the section is for.
    """
    if isinstance(config, cls):
        return config
    section = config.get(name) if isinstance(config, Mapping) or hasattr(config, "get") else None
    if isinstance(section, cls):
        return section
    from omegaconf import OmegaConf

    if OmegaConf.is_config(section):
        section = OmegaConf.to_container(section, resolve=True)
    if section is None:
        return cls()
    if not isinstance(section, Mapping):
        raise StreamingConfigError(rule_message(
            f"{name} must be a mapping of keys, got {section!r}", purpose,
            f"write {name} as a section with any of the keys {sorted(cls.key_docs())}"))
    return cls.from_mapping(section)
