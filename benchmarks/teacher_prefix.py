"""Teacher scoring turn by turn vs once on the whole trajectory: same log-probs, and at what cost?

Why:
1. OPD turn streaming scores each agent turn as soon as it ends, on its causal prefix (prompt +
   earlier turns + this turn), and backpropagates it while the next tool call runs. That is
   exact only if the teacher's log-probs of a turn do not depend on the tokens after it: true
   for a causal model, up to kernel numerics. This measures the numerics: max |diff| against
   one whole-sequence forward, for per-turn prefix recompute (one forward per turn) and for
   incremental scoring (``thundersync_harness.teacher``'s sessions: one KV cache per trajectory). fp32 must
   stay below 1e-5; bf16 is printed for information (the gap a bf16 teacher would add).
2. Trajectories of the embedded arithmetic tool task: protocol transcripts whose tool fails
   transiently (retry_prob 0.5), so 2-5 assistant turns separated by tool observations,
   tokenized with the project's tokenizer and chat template (``encode_transcript``; the mask is
   1 on assistant tokens). The teacher and student are the project's tiny models when built
   (``thundersync build-model``), else random inits of the same architectures: the comparison
   is about numerics, not quality, and the run says which.
3. Cost, both sides: teacher tokens fed and seconds for the three scoring ways; for the learner,
   forward+backward of the per-turn prefix rows (recompute-the-prefix, ``opd_stream.py``) vs
   the whole trajectories, 4 rows per call, on the student.
Run: python benchmarks/teacher_prefix.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import torch

from thundersync_harness.teacher import HFTeacherScorer
from thundersync_verl.run.results import add_results_dir_argument, find_results_dir, write_result
from thundersync_verl.algos.opd.opd_stream import turns_of_trajectory

FP32_LIMIT = 1e-5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ----- models and data -----------------------------------------------------------------------
def _random_model(variant: str, tokenizer, seed: int):
    """A random init of a tiny variant's architecture (used when the trained one is not built)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from thundersync_verl.models.variants import get_spec

    spec = get_spec(variant)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
                         intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
                         num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                         max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def load_models() -> tuple[object, object, object, str]:
    """``(teacher, student, tokenizer, description)``: the built tiny models, else random inits."""
    from thundersync_verl.models import default_root, load_tiny_model, version_hash
    from thundersync_verl.models.factory import build_tokenizer, is_built
    from thundersync_verl.models.variants import get_spec

    folder = default_root() / version_hash(seed=0)
    if is_built(folder / "teacher") and is_built(folder / "student"):
        teacher, tokenizer = load_tiny_model(folder / "teacher")
        student, _ = load_tiny_model(folder / "student")
        return teacher, student, tokenizer, f"trained tiny models from {folder}"
    tokenizer = build_tokenizer(get_spec("teacher"), 0)
    return (_random_model("teacher", tokenizer, 1), _random_model("student", tokenizer, 0), tokenizer,
            "random inits of the tiny teacher/student architectures (not built: run `thundersync build-model`)")


def task_trajectories(tokenizer, n: int, seed: int) -> list[dict]:
    """Multi-turn transcripts of the embedded task as (prompt, response, response mask) token lists."""
    from thundersync_verl.envs import protocol
    from thundersync_verl.models.tokenizer import encode_transcript

    out = []
    for messages in protocol.transcripts(n, seed, tool_fraction=1.0, retry_prob=0.5, stream="teacher_prefix"):
        ids, mask = encode_transcript(tokenizer, messages)
        first, last = mask.index(1), len(mask) - mask[::-1].index(1)  # response: first to last assistant token
        out.append({"id": len(out), "prompt": ids[:first], "response": ids[first:last], "mask": mask[first:last]})
    return out


# ----- teacher: three ways to score ----------------------------------------------------------
def compare_scoring(model, trajs: list[dict], dtype: torch.dtype) -> dict:
    """Max |diff| of per-turn prefix and incremental scores vs whole-sequence scores; tokens fed, seconds."""
    scorer = HFTeacherScorer(model.to(dtype))
    diff = {"prefix": 0.0, "incremental": 0.0}
    tokens = {"whole": 0, "prefix": 0, "incremental": 0}
    seconds = {"whole": 0.0, "prefix": 0.0, "incremental": 0.0}
    for t in trajs:
        p, full = len(t["prompt"]), t["prompt"] + t["response"]
        t0 = time.perf_counter()
        whole = scorer.score(full, (p, len(full)))  # [R]
        seconds["whole"] += time.perf_counter() - t0
        tokens["whole"] += len(full)
        session = scorer.session()
        for turn in turns_of_trajectory(t["id"], t["prompt"], t["response"], t["mask"]):
            prefix, span = list(turn.prompt + turn.response), (p + turn.action_start, p + len(turn.response))
            ref = whole[turn.action_start : len(turn.response)]  # [n]
            for way, score in (("prefix", scorer.score), ("incremental", session.score)):
                t0 = time.perf_counter()
                values = score(prefix, span)  # [n]
                seconds[way] += time.perf_counter() - t0
                diff[way] = max(diff[way], float((values - ref).abs().max()))
            tokens["prefix"] += len(prefix)
        tokens["incremental"] += len(session.ids)
    model.to(torch.float32)
    return {"diff": diff, "tokens": tokens, "seconds": seconds}


# ----- learner: recompute-the-prefix cost ----------------------------------------------------
def learner_cost(model, rows_whole: list[list[int]], rows_turns: list[list[int]], chunk: int = 4,
                 repeats: int = 3) -> dict:
    """Forward+backward seconds of the per-turn prefix rows vs the whole trajectories, ``chunk`` rows a call."""

    def run(rows: list[list[int]]) -> float:
        t0 = time.perf_counter()
        for i in range(0, len(rows), chunk):
            part = rows[i : i + chunk]
            width = max(len(r) for r in part)
            ids = torch.zeros(len(part), width, dtype=torch.long)  # [b, L], right-padded
            mask = torch.zeros(len(part), width, dtype=torch.long)  # [b, L]
            for b, r in enumerate(part):
                ids[b, : len(r)], mask[b, : len(r)] = torch.tensor(r), 1
            logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].log_softmax(-1)  # [b, L-1, V]
            picked = logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [b, L-1]
            (-(picked * mask[:, 1:]).sum()).backward()
            model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    model.train()
    t_whole = min(run(rows_whole) for _ in range(repeats))
    t_turns = min(run(rows_turns) for _ in range(repeats))
    model.eval()
    tokens_ratio = sum(map(len, rows_turns)) / sum(map(len, rows_whole))
    return {"rows": (len(rows_turns), len(rows_whole)), "tokens_ratio": tokens_ratio,
            "seconds": (t_turns, t_whole), "time_ratio": t_turns / t_whole}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 trajectories instead of 48")
    parser.add_argument("--trajectories", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    add_results_dir_argument(parser)
    args = parser.parse_args(argv)
    results_dir = find_results_dir(args.results_dir)
    torch.set_num_threads(1)
    n = args.trajectories or (12 if args.quick else 48)
    teacher, student, tokenizer, source = load_models()
    trajs = task_trajectories(tokenizer, n, args.seed)
    n_turns = [len(turns_of_trajectory(t["id"], t["prompt"], t["response"], t["mask"])) for t in trajs]
    lengths = [len(t["prompt"]) + len(t["response"]) for t in trajs]
    print(f"teacher_prefix: {n} trajectories of the embedded task, {min(n_turns)}-{max(n_turns)} turns "
          f"(mean {sum(n_turns) / n:.1f}), {min(lengths)}-{max(lengths)} tokens; models: {source}")
    print(f"{'dtype':>5} | {'max|diff| prefix':>16} | {'max|diff| incremental':>21} | "
          f"{'teacher tokens whole/prefix/incr':>32} | {'seconds whole/prefix/incr':>25}")
    results = {}
    for name, dtype in DTYPES.items():
        r = results[name] = compare_scoring(teacher, trajs, dtype)
        tok, sec = r["tokens"], r["seconds"]
        print(f"{name:>5} | {r['diff']['prefix']:>16.3e} | {r['diff']['incremental']:>21.3e} | "
              f"{tok['whole']:>10}/{tok['prefix']:>10}/{tok['incremental']:>10} | "
              f"{sec['whole']:>7.3f}/{sec['prefix']:>7.3f}/{sec['incremental']:>7.3f}")
    worst = max(results["fp32"]["diff"].values())
    print(f"fp32 max |diff| = {worst:.3e} -> {'PASS' if worst < FP32_LIMIT else 'FAIL'} (acceptance: < {FP32_LIMIT:g})")
    rows_whole = [t["prompt"] + t["response"] for t in trajs]
    rows_turns = [list(u.prompt + u.response) for t in trajs
                  for u in turns_of_trajectory(t["id"], t["prompt"], t["response"], t["mask"])]
    cost = learner_cost(student, rows_whole, rows_turns)
    print(f"learner, recompute-the-prefix on the student (fwd+bwd, 4 rows a call): {cost['rows'][0]} turn rows vs "
          f"{cost['rows'][1]} trajectories: {cost['tokens_ratio']:.2f}x tokens, {cost['seconds'][0]:.2f} s vs "
          f"{cost['seconds'][1]:.2f} s = {cost['time_ratio']:.2f}x time")
    result = {"teacher_prefix_max_diff": worst}
    write_result("teacher_prefix", result, results_dir)
    return result


if __name__ == "__main__":
    main()
