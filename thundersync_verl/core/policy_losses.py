"""Which of verl 0.9.1's policy losses (``actor.policy_loss.loss_mode``) stream exactly, and why the others do not.

Why:
1. A trajectory's backward may run before its group closes only if its gradient needs that row's own tokens and
   log-probs, and is linear in its advantage: the bucket of an open group is multiplied by A_i at the fold. In
   the first mini-batch every ratio is 1 (the old log-probs are the learner's own at the batch's weights), so for
   each loss listed as streaming the gradient of verl's function there is -A_i * w_{i,t} * grad log pi_{i,t} with
   the token weights w of its ``loss_agg_mode``: the streamed loss of ``learner/stream_loss.py``. The ``why`` of
   each row says which part of the loss makes that so (a clip band containing 1, a stop-gradient equal to 1, a
   penalty whose gradient vanishes at ratio 1); ``tests/core/test_policy_losses_verl_on_cpu.py`` checks each against
   verl's own function. With ``rollout_correction.bypass_mode`` the ratio is not 1: only the losses that also take
   several mini-batches (their ratio != 1 path is verl's own function) stream there.
2. The losses that read other rows (a batch covariance, a micro-batch mean) are refused, naming the key and the
   reason; a loss missing from the table (a later verl, a user's own registration) is refused too, never guessed.
3. ``agg_mode``: a loss that aggregates its policy term with a fixed mode whatever ``actor.loss_agg_mode`` says
   (verl's ``sapo``) streams only when the two agree, since the deferred normaliser and the KL / entropy terms
   follow ``actor.loss_agg_mode``.
4. ``minibatches``: mini-batches after the first run verl's own function at ratio != 1 (``learner/minibatch_loss.py``)
   with this package's settings object as its config; only the losses whose function reads nothing else from it
   take several optimizer steps per batch. The others stream with one mini-batch and are refused with several.
5. One table, framework-free: the trainer's refusal (``config_validation``), the CLI's listing
   (``thundersync recipes check --list-losses``) and the equivalence benchmark's ``policy_losses_streamed``
   all read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from thundersync_verl.core.errors import StreamingConfigError, fail

LOSS_KEY = "actor_rollout_ref.actor.policy_loss.loss_mode"


@dataclass(frozen=True)
class PolicyLossEntry:
    """One row of the table: whether ``name`` streams, and the reason in one sentence."""

    name: str
    streams: bool
    why: str
    agg_mode: str | None = None  # point 3: the loss_agg_mode the policy term always uses
    minibatches: bool = False  # point 4: several optimizer steps per batch


POLICY_LOSSES: dict[str, PolicyLossEntry] = {e.name: e for e in (
    PolicyLossEntry("vanilla", True, "PPO's clip band (1-eps_low, 1+eps_high) contains ratio 1: the plain policy "
                    "gradient", minibatches=True),
    PolicyLossEntry("gpg", True, "-A log pi, no ratio at all", minibatches=True),
    PolicyLossEntry("bypass_mode", True, "old log-probs are the rollout's; the rollout_correction rules decide",
                    minibatches=True),
    PolicyLossEntry("gspo", True, "the token ratio sg[s_i] pi/sg[pi] is 1 with gradient grad log pi, and its clip "
                    "band contains 1; aggregated with actor.loss_agg_mode, as verl's ppo_loss passes it"),
    PolicyLossEntry("cispo", True, "the stop-gradient weight sg[clip(r)] is 1 at ratio 1"),
    PolicyLossEntry("dro", True, "the penalty 0.5 beta (log pi - log pi_old)^2 has zero gradient at ratio 1"),
    PolicyLossEntry("dppo_tv", True, "at ratio 1 the TV divergence is 0, so the trust-region mask keeps every token, "
                    "and the detached truncated ratio is 1"),
    PolicyLossEntry("dppo_kl", True, "at ratio 1 the binary KL is 0, so the trust-region mask keeps every token, "
                    "and the detached truncated ratio is 1"),
    PolicyLossEntry("sapo", True, "the soft gate 4/tau sigmoid(tau (r - 1)) has slope 1 at ratio 1 for both taus; "
                    "verl always aggregates it with seq-mean-token-mean", agg_mode="seq-mean-token-mean"),
    PolicyLossEntry("geo_mean", False, "verl averages it with torch.mean over the micro-batch's rows (no global batch "
                    "size, no dp_size), so its update depends on the micro-batch split and the data-parallel size, "
                    "not on each row alone"),
    PolicyLossEntry("clip_cov", False, "it detaches the tokens whose advantage / log-prob covariance is extreme over "
                    "the whole batch, a statistic that exists only once every row is in"),
    PolicyLossEntry("kl_cov", False, "it adds a KL penalty to the top-k tokens by advantage / log-prob covariance over "
                    "the whole batch, a statistic that exists only once every row is in"),
)}


def streamed_policy_losses() -> list[str]:
    """The loss modes that stream (point 1), in the table's order."""
    return [name for name, entry in POLICY_LOSSES.items() if entry.streams]


def check_policy_loss(loss_mode: str, *, loss_agg_mode: str, optimizer_steps: int = 1,
                      dro_beta: float | None = None, ratio_is_one: bool = True) -> PolicyLossEntry:
    """The table's row of ``loss_mode`` when it streams with these settings, else ``StreamingConfigError`` naming
    the key, the reason and what to set instead."""
    streamed = streamed_policy_losses()
    entry = POLICY_LOSSES.get(loss_mode)
    if entry is None:
        fail(f"{LOSS_KEY}={loss_mode!r} is not in thundersync's policy-loss table",
             "only losses whose streamed gradient has been derived from verl 0.9.1's function are streamed",
             f"set {LOSS_KEY} to one of {streamed} (see `thundersync recipes check --list-losses`)",
             cls=StreamingConfigError)
    if not entry.streams:
        fail(f"{LOSS_KEY}={loss_mode!r} cannot be streamed", entry.why,
             f"set {LOSS_KEY} to one of {streamed}, or mode=sync", cls=StreamingConfigError)
    if entry.agg_mode is not None and loss_agg_mode != entry.agg_mode:
        fail(f"{LOSS_KEY}={loss_mode!r} needs actor_rollout_ref.actor.loss_agg_mode={entry.agg_mode!r} "
             f"(got {loss_agg_mode!r})",
             f"verl aggregates its policy term with {entry.agg_mode} whatever loss_agg_mode says, while the deferred "
             "normaliser and the KL / entropy terms follow loss_agg_mode",
             f"set actor_rollout_ref.actor.loss_agg_mode={entry.agg_mode}", cls=StreamingConfigError)
    if not ratio_is_one and not entry.minibatches:
        fail(f"{LOSS_KEY}={loss_mode!r} streams only where the first mini-batch's ratio is 1",
             "with algorithm.rollout_correction.bypass_mode=true the old log-probs are the rollout's, so the ratio "
             "differs from 1 and this loss's gradient is not the plain policy gradient the stream computes (point 1)",
             "set algorithm.rollout_correction.bypass_mode=false (the learner recomputes the old log-probs), or "
             f"{LOSS_KEY}=vanilla", cls=StreamingConfigError)
    if optimizer_steps > 1 and not entry.minibatches:
        fail(f"{LOSS_KEY}={loss_mode!r} streams with one optimizer step per batch (got {optimizer_steps})",
             "mini-batches after the first run verl's own function at ratio != 1, and this loss's function reads "
             "actor settings the mini-batch path does not pass yet",
             "set actor_rollout_ref.actor.ppo_mini_batch_size=data.train_batch_size and ppo_epochs=1, or "
             f"{LOSS_KEY}=vanilla", cls=StreamingConfigError)
    if loss_mode == "dro" and not (dro_beta is not None and float(dro_beta) > 0):
        fail(f"actor_rollout_ref.actor.policy_loss.dro_beta={dro_beta!r} must be positive with {LOSS_KEY}='dro'",
             "verl's dro loss raises without it; the streamed first mini-batch would not",
             "set actor_rollout_ref.actor.policy_loss.dro_beta to e.g. 0.1", cls=StreamingConfigError)
    return entry


def format_table() -> str:
    """The table as text lines: ``name  streams|refused  why``."""
    width = max(len(name) for name in POLICY_LOSSES)
    return "\n".join(f"{e.name:<{width}}  {'streams' if e.streams else 'refused'}  {e.why}"
                     + (f" (needs loss_agg_mode={e.agg_mode})" if e.agg_mode else "")
                     + ("" if e.minibatches or not e.streams else " (one mini-batch per batch)")
                     for e in POLICY_LOSSES.values())
