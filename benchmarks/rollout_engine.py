"""hf_cpu rollout throughput: continuous batching vs one request per forward, side by side.

Why:
1. Streaming training hides learner work behind the rollout's waiting (tools, verifiers). If
   the rollout engine itself is compute-bound, there is no waiting to hide anything behind, and
   on a shared CPU the learner only slows the rollout down. This measures how much of that the
   batched engine removes: the same requests through ``HFGenerationEngine`` with
   ``max_batch=1`` (one row per forward, the engine's behaviour before continuous batching)
   and with the default ``max_batch``.
2. Workload: the embedded task's prompts (the project's tokenizer and chat template), the
   trained student (built once and cached by ``thundersync build-model``), temperature 1,
   ``concurrency`` requests in flight at once, as verl's agent loop sends them.
3. Figures: generated tokens per second for each, the speedup, and the mean seconds per token
   of one request (what a trajectory's turn waits for). Rounds alternate so machine noise hits
   both sides alike.
4. ``--prompts turns``: the prompts of a multi-turn run, where a turn's prompt carries the trajectory's history
   (request i has i % 4 earlier turns of ``TURN_TOKENS`` each: 60 to 700 tokens). A third engine prefills each
   step's new requests as ONE padded batch (``prefill_pad_share=None``, the engine before ``kv_batch`` point 3)
   beside the default's forwards of similar lengths: ``prefill_speedup`` is its prefill CPU over the default's.
Run: python benchmarks/rollout_engine.py [--quick] [--prompts first|turns]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

from thundersync_verl.backends.cpu.hf_engine import HFGenerationEngine
from thundersync_verl.backends.cpu.rollout import eos_ids_of, load_hf_model
from thundersync_verl.run.results import add_results_dir_argument, write_result


def prompts_of_task(tokenizer, n: int) -> list[list[int]]:
    from thundersync_verl.envs.dataset import dataset_rows

    rows = dataset_rows(n, seed=7, split="train")
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


TURN_TOKENS = 200  # one earlier turn in ``--prompts turns``: a response and its tool reply


def with_history(prompts: list[list[int]]) -> list[list[int]]:
    """Request i: its task prompt after i % 4 earlier turns (point 4; other prompts' tokens stand in for them)."""
    pool = [t for p in prompts for t in p]
    out = []
    for i, p in enumerate(prompts):
        k = (i % 4) * TURN_TOKENS
        out.append(p + [pool[(i * 37 + j) % len(pool)] for j in range(k)])
    return out


class PrefillClock:
    """CPU seconds an engine spends in its prefill forwards (wraps ``_prefill``)."""

    def __init__(self, engine: HFGenerationEngine):
        self.seconds, inner = 0.0, engine._prefill

        def timed(reqs):
            t0 = time.process_time()
            inner(reqs)
            self.seconds += time.process_time() - t0

        engine._prefill = timed


async def one_round(engine: HFGenerationEngine, prompts: list[list[int]], max_tokens: int, seed: int) -> tuple[int, float, list[float]]:
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[
        engine.generate(p, {"max_tokens": max_tokens, "temperature": 1.0, "seed": seed + i}) for i, p in enumerate(prompts)
    ])
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens, time.perf_counter() - t0, [o.seconds / max(1, len(o.token_ids)) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds instead of 6")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (verl: batch x rollout.n)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompts", choices=("first", "turns"), default="first",
                        help="first turns only, or turns with 0-3 turns of history (point 4)")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from thundersync_verl.models import ensure_tiny_models

    model, tokenizer = load_hf_model(str(ensure_tiny_models(variants=("student",))["student"]))
    prompts = prompts_of_task(tokenizer, args.concurrency)
    if args.prompts == "turns":
        prompts = with_history(prompts)
    eos = eos_ids_of(model, tokenizer)
    engines = {
        "serial": HFGenerationEngine(model, tokenizer, eos_token_ids=eos, max_batch=1),
        "batched": HFGenerationEngine(model, tokenizer, eos_token_ids=eos),
    }
    if args.prompts == "turns":
        engines["padded"] = HFGenerationEngine(model, tokenizer, eos_token_ids=eos, prefill_pad_share=None)
    clocks = {name: PrefillClock(engine) for name, engine in engines.items()}
    tps: dict[str, list[float]] = {k: [] for k in engines}
    s_per_token: dict[str, list[float]] = {k: [] for k in engines}
    rounds = 2 if args.quick else 6
    for r in range(rounds):
        for name, engine in engines.items():  # same seeds on both sides: same sampled lengths
            tokens, seconds, per_token = asyncio.run(one_round(engine, prompts, args.max_tokens, seed=100 * r))
            tps[name].append(tokens / seconds)
            s_per_token[name].extend(per_token)
            print(f"round {r + 1}/{rounds} {name:8s} {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.0f} tok/s",
                  flush=True)
    result = {
        "prompts": args.prompts,
        "concurrency": args.concurrency,
        "tokens_per_s_serial": round(statistics.median(tps["serial"]), 1),
        "tokens_per_s_batched": round(statistics.median(tps["batched"]), 1),
        "speedup": round(statistics.median(tps["batched"]) / statistics.median(tps["serial"]), 2),
        "request_s_per_token_serial": round(statistics.mean(s_per_token["serial"]), 5),
        "request_s_per_token_batched": round(statistics.mean(s_per_token["batched"]), 5),
    }
    if "padded" in engines:
        result["tokens_per_s_padded_prefill"] = round(statistics.median(tps["padded"]), 1)
        result["prefill_cpu_s_padded"] = round(clocks["padded"].seconds / rounds, 3)
        result["prefill_cpu_s_grouped"] = round(clocks["batched"].seconds / rounds, 3)
        result["prefill_speedup"] = round(clocks["padded"].seconds / clocks["batched"].seconds, 2)
        result["speedup_over_padded_prefill"] = round(statistics.median(tps["batched"]) / statistics.median(tps["padded"]), 2)
    write_result(Path(__file__).stem + ("_turns" if args.prompts == "turns" else ""), result, args.results_dir)


if __name__ == "__main__":
    main()
