"""verl's rollout correction in the equivalence comparison (``--rollout-correction VARIANT``).

Why:
1. ``algorithm.rollout_correction.rollout_is`` makes verl's trainer multiply every token's policy loss by a
   truncated importance weight of its old log-probs against the rollout engine's. verl's side here is verl's own
   trainer function (``va.rollout_correction``: ``compute_rollout_correction_and_add_to_batch``) on the batch
   ``update_actor`` gets; the stream computes the same weights in the learner's loss from the chunk's rollout
   log-probs (``learner/stream_loss.py`` point 8), with the settings in the batch meta as the trainer sends them.
2. The CPU rollouts' log-probs equal the learner's (fp32 on both sides), where every weight is 1 and a missing
   weight would go unseen. So the rollout's log-probs here are the start policy's, shifted per token by seeded
   Gaussian noise (``NOISE``: token level 0.5 nats, sequence level 0.25, so that both the clamp or band and the
   weights in between are exercised); ``is_weight_stats`` reports how many tokens each variant clamps or masks.
   Each trajectory's rollout log-probs are drawn once and every path (verl's two orders, the stream) reads them.
3. Variants (verl's presets): ``tis`` (token, clamp at 2), ``token-mask`` (token, band 0.5-2: IcePop),
   ``sequence-tis`` (sequence, clamp at 2), ``sequence-mask`` (sequence, band 0.5-2). Rejection sampling
   (``rollout_rs``) changes the response mask, hence the batch's token count, and is not compared here.
4. The plain GRPO comparison only (one mini-batch, no KL/entropy, vanilla loss): later mini-batches are refused
   by the learner's rule (``stream_plan._check_policy_term_only``). The result gets ``rollout_correction`` and
   ``is_weight_stats``; its name ``_rc_<variant>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from thundersync_harness.engine_steps import PolicySpec, StreamingLearnerClient, TrajFeed, rollout_batch, traj_name
from thundersync_verl import verl_adapter as va

VARIANTS = {"tis": ("token", 2.0), "token-mask": ("token", "0.5_2.0"), "sequence-tis": ("sequence", 2.0),
            "sequence-mask": ("sequence", "0.5_2.0")}
NOISE = {"token": 0.5, "sequence": 0.25}  # nats of rollout-vs-learner log-prob noise per token (point 2)


def add_rollout_correction_arguments(parser) -> None:
    parser.add_argument("--rollout-correction", default=None, choices=sorted(VARIANTS),
                        help="algorithm.rollout_correction preset for verl's update and the stream (point 3)")


def check_rollout_correction(parser, args):
    """``args`` when ``--rollout-correction`` fits the comparison, else ``parser.error`` (point 4)."""
    if args.rollout_correction is None:
        return args
    refused = [flag for flag, on in (
        ("--algo opd", args.algo != "grpo"), ("--kl", args.kl), ("--entropy", args.entropy),
        ("--estimator", args.estimator != "grpo"), ("--mini-batches", args.mini_batches > 1),
        ("--ppo-epochs", args.ppo_epochs > 1), ("--policy-loss", getattr(args, "policy_loss", "vanilla") != "vanilla"),
        ("--per-token-loss", getattr(args, "per_token_loss", False)), ("--float64-sum", args.float64_sum)) if on]
    if refused:
        parser.error(f"--rollout-correction runs the plain GRPO comparison (one mini-batch); not with {', '.join(refused)}")
    return args


@dataclass(frozen=True)
class RolloutCorrectionSpec(PolicySpec):
    """GRPO with verl's rollout IS weights (point 1); ``rollout_lp`` holds each trajectory's drawn log-probs."""

    level: str = "token"
    threshold: float | str = 2.0
    rollout_lp: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    def config(self) -> dict:
        return {"rollout_is": self.level, "rollout_is_threshold": self.threshold, "rollout_is_batch_normalize": False,
                "rollout_rs": None, "rollout_rs_threshold": None}

    def draw(self, wg, trajs, pad_token_id: int) -> None:
        """Each trajectory's rollout log-probs, once: the current policy's plus seeded noise (point 2)."""
        todo = [t for t in trajs if _key(t) not in self.rollout_lp]
        if not todo:
            return
        old = rollout_batch(wg, todo, list(range(len(todo))), pad_token_id).batch["old_log_probs"]  # [B, R]
        for b, t in enumerate(todo):
            gen = torch.Generator().manual_seed(hash((t.gid, t.tid, len(t.response))) % (1 << 31))
            noise = torch.randn(len(t.response), generator=gen, dtype=torch.float32) * NOISE[self.level]
            self.rollout_lp[_key(t)] = (old[b, : len(t.response)] + noise).tolist()

    def verl_batch(self, wg, trajs, row_order, pad_token_id):
        """compute_log_prob -> rollout correction (verl's trainer function) -> compute_advantage."""
        self.draw(wg, trajs, pad_token_id)
        data = rollout_batch(wg, trajs, row_order, pad_token_id)
        lp = torch.zeros_like(data.batch["old_log_probs"])  # [B, R]
        for b, i in enumerate(row_order):
            row = self.rollout_lp[_key(trajs[i])]
            lp[b, : len(row)] = torch.tensor(row)
        data.batch["rollout_log_probs"] = lp
        data, _ = va.rollout_correction(data, self.config())
        self._count(data.batch["rollout_is_weights"], data.batch["response_mask"])
        self._near_edge(data.batch["old_log_probs"] - lp, data.batch["response_mask"])
        return self.advantages(data)

    def meta(self, groups: int) -> dict:
        return {**super().meta(groups), "rollout_is": self.level, "rollout_is_threshold": self.threshold,
                "rollout_is_batch_normalize": False}

    def feed(self, wg, trajs, pad_token_id, max_chunk):
        self.draw(wg, trajs, pad_token_id)
        lps = {(t.gid, traj_name(t)): self.rollout_lp[_key(t)] for t in trajs}
        client = StreamingLearnerClient(wg, pad_token_id=pad_token_id, row_log_probs=lps)
        return TrajFeed(self.planner(max_chunk), client, trajs, self.meta(len({t.gid for t in trajs})))

    def _count(self, weights: torch.Tensor, mask: torch.Tensor) -> None:
        scored = mask.bool()
        w = weights[scored]
        upper = float(self.threshold) if not isinstance(self.threshold, str) else float(self.threshold.split("_")[1])
        for k, v in (("tokens", int(scored.sum())), ("zero", int((w == 0).sum())), ("at_upper", int((w == upper).sum())),
                     ("between", int(((w > 0) & (w < upper) & (w != 1)).sum()))):
            self.stats[k] = self.stats.get(k, 0) + v


    def _near_edge(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> None:
        """Tokens (token level) or rows (sequence level) whose raw weight lies within 1e-5 (relative) of a threshold:
        there two correct computations of the old log-probs (verl's forward, the stream's) may fall on either side."""
        if self.level == "sequence":
            log_ratio = (log_ratio * mask).sum(dim=-1)  # [B]
            scored = mask.sum(dim=-1) > 0  # [B]
        else:
            scored = mask.bool()  # [B, R]
        spec = str(self.threshold).split("_")
        edges = [float(x) for x in spec]
        raw = torch.exp(log_ratio.double())[scored]
        near = sum(int(((raw / e - 1).abs() < 1e-5).sum()) for e in edges)
        self.stats["near_threshold"] = self.stats.get("near_threshold", 0) + near


def _key(t) -> tuple:
    return (t.gid, t.tid, t.prompt, t.response)


def rollout_correction_spec(args) -> RolloutCorrectionSpec | None:
    variant = getattr(args, "rollout_correction", None)
    if variant is None:
        return None
    level, threshold = VARIANTS[variant]
    return RolloutCorrectionSpec(level=level, threshold=threshold)


def rollout_correction_result(args, result: dict, name: str, spec: RolloutCorrectionSpec | None) -> str:
    """Point 4's keys; the result's name with ``_rc_<variant>``."""
    variant = getattr(args, "rollout_correction", None)
    if variant is None:
        return name
    result["rollout_correction"] = {"variant": variant, **spec.config()}
    result["is_weight_stats"] = dict(spec.stats)  # this comparison's tokens (with --seeds: this seed's)
    spec.stats.clear()
    return f"{name}_rc_{variant}"
