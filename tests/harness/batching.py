"""verl's packing and micro-batching settings for the equivalence comparison (``--remove-padding``, ``--dynamic-bsz``).

Why:
1. verl's defaults are ``use_remove_padding=true`` (each micro-batch packed into one unpadded row) and many
   recipes set ``use_dynamic_bsz=true`` (micro-batches cut by a token budget, ``ppo_max_token_len_per_gpu``).
   The FSDP2 comparison runs verl's update AND the streamed step under the same setting: both read it from the
   actor's config (``engine_setup.verl_config``), the stream's chunks go through the same engine call.
2. ``DYNAMIC_MAX_TOKEN_LEN`` is small against the harness rows (5-22 tokens each, 4 groups x 4 rows ~ 220
   tokens) so verl cuts each mini-batch into several micro-batches of different row counts.
3. With token-budgeted micro-batches the benchmark's floor (rows in a stride-permuted order) no longer gives
   every row new companions: verl cuts micro-batches by balancing sequence lengths, largely whatever the row
   order, so the regrouped run keeps part of the run it is measured against (of the companion pairs of
   ``make_trajectories`` batches 1000, 1001, 1002, 1100, 1200 it keeps 7/18, 6/18, 14/14, 10/18, 12/24; with
   fixed micro-batches 0). ``regrouped_floor_steps`` adds the floor that
   does regroup: verl's own update with the budget ``DYNAMIC_FLOOR_MAX_TOKEN_LEN`` instead
   (``floor_regrouped``); ``gap_over_max_floor`` is the gap over the larger of the two floors, as the Megatron
   comparison's fine floor does.
4. ``--remove-padding`` applies to the plain GRPO comparison on both engines (on Megatron also in the per-token
   regime, which verl requires it for): verl's THD path, which the CPU layer spec runs with a block-diagonal
   causal mask (``backends/megatron/cpu_spec.py`` point 4). ``--dynamic-bsz`` runs on FSDP2 only. Other
   combinations are refused, not ignored.
"""

from __future__ import annotations

DYNAMIC_MAX_TOKEN_LEN = 48  # >= the longest harness row (8 prompt + 14 response tokens)
DYNAMIC_FLOOR_MAX_TOKEN_LEN = 64  # the regrouped floor's budget (point 3)


def add_batching_arguments(parser) -> None:
    parser.add_argument("--remove-padding", action="store_true",
                        help="fsdp: use_remove_padding=true (packed rows) for verl's update and the stream")
    parser.add_argument("--dynamic-bsz", action="store_true",
                        help=f"fsdp: use_dynamic_bsz=true, ppo_max_token_len_per_gpu={DYNAMIC_MAX_TOKEN_LEN}")


def check_batching(parser, args):
    """``args`` when the flags fit the comparison, else ``parser.error``."""
    if (args.remove_padding or args.dynamic_bsz) and (
            args.algo != "grpo" or args.kl or args.entropy or args.estimator != "grpo"
            or args.mini_batches > 1 or args.ppo_epochs > 1 or getattr(args, "float64_sum", False)):
        parser.error("--remove-padding / --dynamic-bsz run the plain GRPO comparison")
    if args.dynamic_bsz and args.engine != "fsdp":
        parser.error("--dynamic-bsz runs on --engine fsdp (the Megatron comparison does not cut micro-batches by tokens)")
    return args


def megatron_batching_options(args) -> dict:
    """``megatron_config`` keywords for the flags."""
    return {"remove_padding": True} if args.remove_padding else {}


def batching_options(args) -> dict:
    """``verl_config`` keywords for the flags."""
    return {"remove_padding": bool(args.remove_padding),
            "max_token_len": DYNAMIC_MAX_TOKEN_LEN if args.dynamic_bsz else None}


def regrouped_floor_steps(args, wg, batches, pad_id: int) -> dict:
    """With ``--dynamic-bsz``: ``{"sync_regrouped": [step per batch]}``, verl's update on the rows in order with
    the floor's token budget (point 3); else nothing."""
    from functools import partial

    from thundersync_harness.engine_steps import sync_step

    if not getattr(args, "dynamic_bsz", False):
        return {}
    return {"sync_regrouped": [partial(sync_step, wg, trajs, list(range(len(trajs))), pad_id,
                                       max_token_len=DYNAMIC_FLOOR_MAX_TOKEN_LEN) for trajs, _ in batches]}


def regrouped_floor_figures(runs: dict) -> dict:
    """The regrouped floor per step (verl's update at the floor's budget vs at the configured one) and the
    stream's worst gap over the larger of the two floors."""
    from thundersync_harness.engine_steps import relative_gap

    da, db, ds = runs["sync_a"][0], runs["sync_b"][0], runs["stream"][0]
    regrouped = [relative_gap(r, a) for r, a in zip(runs["sync_regrouped"][0], da)]
    ratios = [relative_gap(s, a) / max(relative_gap(b, a), r) for s, a, b, r in zip(ds, da, db, regrouped)]
    print(f"  regrouped floor (verl's update, budget {DYNAMIC_FLOOR_MAX_TOKEN_LEN} vs {DYNAMIC_MAX_TOKEN_LEN} tokens)"
          " per step: " + ", ".join(f"{r:.3e}" for r in regrouped)
          + "; stream gap over the larger floor: " + ", ".join(f"{x:.2f}" for x in ratios))
    return {"floor_regrouped": max(regrouped), "gap_over_max_floor": max(ratios),
            "floor_regrouped_max_token_len": DYNAMIC_FLOOR_MAX_TOKEN_LEN}


def batching_result(args, result: dict, name: str, runs: dict) -> str:
    """Add the ``remove_padding`` / ``dynamic_bsz`` keys (and the regrouped floor's figures) to ``result``;
    the result's name with their suffixes."""
    dynamic = bool(getattr(args, "dynamic_bsz", False))
    per_token = bool(getattr(args, "per_token_loss", False))  # packed always: verl requires it in the regime
    result.update(remove_padding=bool(getattr(args, "remove_padding", False)) or per_token, dynamic_bsz=dynamic,
                  max_token_len_per_gpu=DYNAMIC_MAX_TOKEN_LEN if dynamic else None)
    if "sync_regrouped" in runs:
        result.update(regrouped_floor_figures(runs))
    packed = result["remove_padding"] and not per_token  # the per-token results are packed by their name
    return name + ("_remove_padding" if packed else "") + ("_dynamic_bsz" if dynamic else "")
