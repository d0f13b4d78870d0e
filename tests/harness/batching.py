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
   causal mask (``backends/megatron/cpu_spec.py`` point 4). ``--dynamic-bsz`` too, padded or packed, and on
   Megatron in the per-token regime (packed, as verl requires there): verl's Megatron engine cuts its micro-batches
   with the same ``prepare_micro_batches`` / ``rearrange_micro_batches`` as FSDP2 (the micro-batch count
   all-reduced to the maximum over DP), and the stream's calls go through the same engine call, so each call is
   cut by the same budget. Other combinations are refused, not ignored.
5. On Megatron the comparison also runs point 7's fine floor (verl's update with ONE row per micro-batch); under
   ``--dynamic-bsz`` that run switches the token budget off for its own call (``use_dynamic_bsz=False`` in the
   batch, ``engine_steps.verl_update``), else it would be cut by the budget like ``sync_a`` and measure nothing.
   ``gap_over_regrouped_floor`` is the gap over the larger of the stride-permuted and regrouped floors (the FSDP2
   figure); ``gap_over_max_floor`` over the largest floor the run measured (with the fine floor on Megatron);
   ``gap_over_max_floor_with_rounding`` also over verl's own update with its advantages x24 vs x16 (point 7's
   control: verl's per-row loss scalars A_i / N rounded otherwise, the term no regrouping shows and no streamed row
   can share; ``tests/megatron/test_megatron_dynamic_bsz_on_cpu.py`` asserts its median over batches).
"""

from __future__ import annotations

DYNAMIC_MAX_TOKEN_LEN = 48  # >= the longest harness row (8 prompt + 14 response tokens)
DYNAMIC_FLOOR_MAX_TOKEN_LEN = 64  # the regrouped floor's budget (point 3)


def add_batching_arguments(parser) -> None:
    parser.add_argument("--remove-padding", action="store_true",
                        help="use_remove_padding=true (packed rows) for verl's update and the stream")
    parser.add_argument("--dynamic-bsz", action="store_true",
                        help=f"use_dynamic_bsz=true, ppo_max_token_len_per_gpu={DYNAMIC_MAX_TOKEN_LEN} "
                             "(fsdp or megatron)")


def check_batching(parser, args):
    """``args`` when the flags fit the comparison, else ``parser.error``."""
    if not (args.remove_padding or args.dynamic_bsz):
        return args
    others = [flag for flag, on in (
        ("--algo opd", args.algo != "grpo"), ("--kl", args.kl), ("--entropy", args.entropy),
        ("--estimator", args.estimator != "grpo"), ("--mini-batches", args.mini_batches > 1),
        ("--ppo-epochs", args.ppo_epochs > 1), ("--float64-sum", getattr(args, "float64_sum", False))) if on]
    if others:
        given = " / ".join(flag for flag, on in (("--remove-padding", args.remove_padding),
                                                 ("--dynamic-bsz", args.dynamic_bsz)) if on)
        parser.error(f"{given} run the plain GRPO comparison (also --per-token-loss on --engine megatron): "
                     f"drop {', '.join(others)}, or drop {given}")
    return args


def megatron_batching_options(args) -> dict:
    """``megatron_config`` / ``per_token_config`` keywords for the flags (the per-token config packs by default)."""
    options = {"remove_padding": True} if args.remove_padding else {}
    if getattr(args, "dynamic_bsz", False):
        options["max_token_len"] = DYNAMIC_MAX_TOKEN_LEN
    return options


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
    out = {"floor_regrouped": max(regrouped), "gap_over_regrouped_floor": max(ratios),
           "gap_over_max_floor": max(ratios), "floor_regrouped_max_token_len": DYNAMIC_FLOOR_MAX_TOKEN_LEN}
    if "sync_fine" in runs:  # Megatron: point 7's one-row floor as well (point 5)
        fine = [relative_gap(f, a) for f, a in zip(runs["sync_fine"][0], da)]
        every = [relative_gap(s, a) / max(relative_gap(b, a), r, f)
                 for s, a, b, r, f in zip(ds, da, db, regrouped, fine)]
        print("  stream gap over the largest of the stride-permuted, regrouped and one-row floors: "
              + ", ".join(f"{x:.2f}" for x in every))
        out["gap_over_max_floor"] = max(every)
        if "sync_other" in runs:  # and verl's own x24 vs x16 run: its per-row loss scalars rounded otherwise
            rounding = [relative_gap(o, p) for o, p in zip(runs["sync_other"][0], runs["sync_pow2"][0])]
            both = [relative_gap(s, a) / max(relative_gap(b, a), r, f, x)
                    for s, a, b, r, f, x in zip(ds, da, db, regrouped, fine, rounding)]
            print("  ... and verl's x24 vs x16 control as a floor too: " + ", ".join(f"{x:.2f}" for x in both))
            out["gap_over_max_floor_with_rounding"] = max(both)
    return out


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
