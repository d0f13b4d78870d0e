"""Learner -> rollout weight pushes on real optimizer steps: dense vs verl's delta_sharded vs sparse_sync.

Why:
1. Every ThunderSync step ends with a weight push that the next batch waits for. This measures, on
   real AdamW steps (verl's own GRPO loss on replayed batches), how many elements change between
   pushes (density, per step and per parameter kind) and what each way of pushing costs in bytes
   and seconds, and checks after every push that the rollout's copy is bit-identical to the
   learner's weights cast to the rollout dtype.
2. Workloads: the embedded task's tiny student (``thundersync_verl.models``, warm-started by the
   project's own build) at the cpu_tiny recipe's AdamW lr 2e-4, pushed in that recipe's rollout
   dtype (fp32) and viewed in bf16; a 57 M-parameter Qwen2 made here at the B200 recipes' lr 1e-6,
   fp32 master weights pushed in bf16 (the GPU rollout dtype).
3. Methods, on the same steps: ``dense`` (cast + copy of every value, what ``cpu_channel``/``nccl``
   move); verl 0.9.1's ``delta_sharded``, whose engine cannot run here (its module imports cupy, its
   wire is NCCL on CUDA, and verl's rollout worker accepts it only for sglang/vllm), so its own CPU
   importable functions are run instead: the FSDP shard export's bf16 cast, ``shard_delta_indices``
   + snapshot refresh, the flush manifest and ``checksum``, and its SGLang loader ``apply_delta``
   onto a CPU copy (first push: its values-only seed); ``sparse`` (``backends/sparse_sync``).
4. Seconds are the compute on this machine (cast, encode, apply; no wire). Both GB/s figures count
   the same thing, the rollout-dtype bytes of the dense model handled per second, summed over the
   pushes after the first: ``encode_apply_gbps`` over sparse encode (diff against the snapshot,
   index/value extraction, snapshot update, buckets, checksum) + verify + apply; ``memcpy_gbps``
   over one copy of that many bytes (each read once and written once) timed just before and just
   after each of those pushes (their mean). ``encode_apply_over_memcpy`` is their ratio (target
   0.5), also given per push and as the median push.
5. The sparse diff, scatter and digest run the compiled CPU kernels when they build here (built, or
   loaded from the cache, before any timing; ``sparse_kernels`` says which ran and why):
   ``THUNDERSYNC_SPARSE_NATIVE=0`` measures the numpy/torch kernels on the same steps instead.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from thundersync_harness import tiny_lm as C
from thundersync_verl import verl_adapter as va
from thundersync_verl.backends.sparse_sync import codec, native
from thundersync_verl.backends.sparse_sync.state import Mirror, ShardEncoder
from thundersync_verl.run.results import add_results_dir_argument, write_result

KINDS = ("embedding", "attention", "mlp", "norm")
GBPS_MEANS = ("bytes of the dense weights in the rollout dtype processed per second (1e9 bytes); memcpy: the same "
              "bytes copied once (read once, written once), timed in the same run just before and just after each "
              "sparse push (their mean)")
TINY_LR, LARGE_LR = 2e-4, 1e-6  # recipes/cpu_tiny/grpo.yaml; recipes/swe_smith/base (B200 recipes)


def kind_of(name: str) -> str:
    """embedding (input and output embeddings), attention, mlp, norm."""
    if "embed" in name or "lm_head" in name:
        return "embedding"
    if "attn" in name:
        return "attention"
    if "mlp" in name:
        return "mlp"
    return "norm" if "norm" in name else "other"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(codec.bits(a.contiguous()).reshape(-1), codec.bits(b.contiguous()).reshape(-1))


@dataclass
class Record:
    bytes: int = 0
    cast_s: float = 0.0
    encode_s: float = 0.0
    apply_s: float = 0.0
    changed: int = 0
    full: bool = False


class Dense:
    """Every value, cast to the rollout dtype and copied into the receiver's weights."""

    name = "dense"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype, self.weights = dtype, {}

    def push(self, named: list) -> Record:
        rec = Record(full=True)
        for name, t in named:
            t0 = time.perf_counter()
            value = t.to(self.dtype)
            t1 = time.perf_counter()
            self.weights.setdefault(name, torch.empty_like(value)).copy_(value)
            rec.cast_s += t1 - t0
            rec.apply_s += time.perf_counter() - t1
            rec.bytes += value.numel() * value.element_size()
            rec.changed += value.numel()
        return rec


class _LoadTarget:
    """The receiver side verl's SGLang delta loader writes into (``load_weights`` -> ``copy_``)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, chunk) -> None:
        for name, t in chunk:
            self.weights[name].copy_(t)


class DeltaSharded:
    """verl 0.9.1's delta_sharded algorithm from its own functions, at one learner rank."""

    name = "delta_sharded"

    def __init__(self, dtype: torch.dtype) -> None:
        self.parts, self.dtype = va.delta_sharded_parts(), dtype
        self.snaps: dict[str, torch.Tensor] = {}
        self.target = _LoadTarget()

    def push(self, named: list) -> Record:
        rec, seed = Record(full=not self.snaps), not self.snaps
        pieces = []
        for name, t in named:
            t0 = time.perf_counter()
            local = t.to(torch.bfloat16).reshape(-1)  # verl's FSDP get_per_tensor_param_shard casts to bf16
            t1 = time.perf_counter()
            if seed:
                self.snaps[name] = local.clone()
                self.target.weights[name] = torch.zeros(t.shape, dtype=self.dtype)
                pieces.append((name, t.shape, None, local))
            else:
                idx, val = self.parts.shard_delta_indices(local, self.snaps[name], 0)
                self.snaps[name].copy_(local)
                pieces.append((name, t.shape, idx.to(torch.int32), val))
            rec.cast_s += t1 - t0
            rec.encode_s += time.perf_counter() - t1
        t0 = time.perf_counter()
        named_flush, rec.bytes, rec.changed = self._flush(pieces, seed)
        t1 = time.perf_counter()
        self.parts.apply_delta(self.target, named_flush)
        rec.encode_s += t1 - t0
        rec.apply_s += time.perf_counter() - t1
        return rec

    def _flush(self, pieces: list, seed: bool):
        """One flush as verl's engine assembles it: JSON manifest, int32 positions, bf16 values."""
        params, idx_parts, val_parts, pos, off = [], [], [], 0, 0
        for name, shape, idx, val in pieces:
            n = int(val.numel())
            pos_len = 0 if idx is None else 4 * n
            params.append(vars(self.parts.DeltaParam(name=name, dtype="bfloat16", shape=list(shape), pos_start=pos,
                                                     pos_end=pos + pos_len, pos_width=4, val_start=off, val_end=off + n)))
            if idx is not None:
                idx_parts.append(idx)
            val_parts.append(val)
            pos, off = pos + pos_len, off + n
        values = torch.cat(val_parts)
        positions = torch.cat(idx_parts).view(torch.uint8) if idx_parts else torch.empty(0, dtype=torch.uint8)
        encoding = "dense" if seed else "indices"
        spec = {"encoding": encoding, "verify": False, "is_last": True, "params": params,
                "checksum": int(self.parts.checksum(positions, values))}
        named = [("__delta_spec__", torch.frombuffer(bytearray(json.dumps(spec).encode()), dtype=torch.uint8)),
                 ("__values__", values)]
        if not seed:
            named.insert(1, ("__positions__", positions))
        return named, int(positions.numel() + values.numel() * values.element_size()), int(values.numel())

    @property
    def weights(self) -> dict:
        return self.target.weights


class Sparse:
    """This project's sparse_sync: snapshot encoder and receiving copy, as the checkpoint engine runs them."""

    name = "sparse"

    def __init__(self, dtype: torch.dtype) -> None:
        self.encoder, self.mirror = ShardEncoder(dtype=dtype), Mirror()
        self.by_name: dict[str, int] = {}

    def push(self, named: list) -> Record:
        payload, stats = self.encoder.encode(named)
        applied = self.mirror.apply(payload)
        self.encoder.commit(payload)
        self.by_name = stats.changed_by_name
        return Record(bytes=payload.nbytes, cast_s=stats.cast_s, encode_s=stats.encode_s,
                      apply_s=applied.apply_s + applied.verify_s, changed=stats.changed, full=payload.full)

    @property
    def weights(self) -> dict:
        return {name: self.mirror.tensor(name) for name in self.mirror.flat}


# ----- models and training ------------------------------------------------------------------
def tiny_student():
    """The embedded task's student: the project's warm-started build when it is cached, else the same
    architecture and tokenizer at its seeded initialisation (the build takes many minutes on 2 cores)."""
    from thundersync_verl.models import default_root, load_tiny_model, version_hash
    from thundersync_verl.models.factory import build_tokenizer, is_built
    from thundersync_verl.models.variants import get_spec

    path = default_root() / version_hash() / "student"
    if is_built(path):
        model, tokenizer = load_tiny_model(path)
        return model, len(tokenizer), f"student, warm-started build ({path})"
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = get_spec("student")
    tokenizer = build_tokenizer(spec, seed=0)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                      num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                      num_key_value_heads=spec.num_kv_heads, tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float(), len(tokenizer), "student architecture at seeded init (no cached build)"


def larger_model():
    """A 57 M-parameter Qwen2 (hidden 512, 8 layers, vocab 32000, untied), seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).float(), cfg.vocab_size


def train_step(model, optimizer, vocab: int, seed: int) -> float:
    """One AdamW step of verl's GRPO loss (token-mean, clip 0.2/0.28) on a replayed batch of 4 groups x 4."""
    trajs = C.make_batch(seed, [4, 4, 4, 4], "binary", prompt_len=(8, 16), response_len=(8, 24), vocab=vocab)
    optimizer.zero_grad(set_to_none=True)
    loss = C.verl_oracle_loss(model, None, C.LossSpec(), trajs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # verl's default actor grad_clip
    optimizer.step()
    return float(loss.detach())


class Memcpy:
    """One copy of ``nbytes`` between two buffers allocated and touched once, timed like a push."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src, self.dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        self.dst.copy_(self.src)

    def seconds(self) -> float:
        return _timed(lambda: self.dst.copy_(self.src))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----- one workload: train, push through every method, check bits -----------------------------
def _push_all(methods: dict, named: list, copiers: dict) -> tuple[dict, dict]:
    """``{dtype: {method: (record, bitwise_equal)}}`` for one push of ``named``, and per dtype the seconds of
    one memcpy of the rollout-dtype model bytes: the mean of one timed just before the sparse push and one
    just after it (a load that comes or goes on this shared machine during the push weighs on both sides)."""
    out, copy_s = {}, {}
    for dtype, group in methods.items():
        out[dtype] = {}
        for m in group:
            before = copiers[dtype].seconds() if m.name == Sparse.name else 0.0
            rec = m.push(named)
            if m.name == Sparse.name:
                copy_s[dtype] = (before + copiers[dtype].seconds()) / 2
            equal = all(_same_bits(m.weights[n], t.to(dtype)) for n, t in named)
            out[dtype][m.name] = (rec, equal)
    return out, copy_s


def _kind_density(sparse: Sparse, named: list) -> dict:
    numel = {k: 0 for k in KINDS}
    changed = {k: 0 for k in KINDS}
    for name, t in named:
        k = kind_of(name)
        if k in numel:
            numel[k] += t.numel()
            changed[k] += sparse.by_name.get(name, 0)
    return {k: round(changed[k] / numel[k], 6) for k in KINDS if numel[k]}


def run_workload(label: str, model, vocab: int, lr: float, weight_decay: float, dtypes: list, steps: int,
                 seed: int) -> dict:
    """``steps`` AdamW steps; a push after each (and one before: the first, full push) through every method."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.999))
    methods = {dtype: [Dense(dtype), DeltaSharded(dtype), Sparse(dtype)] for dtype in dtypes}
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    n_params = sum(t.numel() for _, t in named)
    print(f"\n{label}: {n_params / 1e6:.2f} M params, AdamW lr {lr:g}, rollout dtypes {[str(d) for d in dtypes]}")
    pushes, memcpy = [], {d: [] for d in dtypes}
    copiers = {d: Memcpy(n_params * d.itemsize) for d in dtypes}  # the rollout-dtype model bytes
    for step in range(steps + 1):
        loss = train_step(model, optimizer, vocab, seed * 1000 + step) if step else float("nan")
        results, copy_s = _push_all(methods, named, copiers)
        if step:
            for d in dtypes:
                memcpy[d].append(copy_s[d])
        kinds = {str(d): _kind_density(methods[d][2], named) for d in dtypes}
        pushes.append((results, kinds, loss))
        for d in dtypes:
            r = results[d]
            sp = r["sparse"][0]
            print(f"  push {step} {codec.dtype_name(d):>8} loss {loss:7.4f} density {sp.changed / n_params:.4f} "
                  f"bytes dense {r['dense'][0].bytes:>10} delta_sharded {r['delta_sharded'][0].bytes:>10} "
                  f"sparse {sp.bytes:>10} bitwise {[r[m][1] for m in ('dense', 'delta_sharded', 'sparse')]} "
                  f"kinds {kinds[str(d)]}")
    return {codec.dtype_name(d): _summarise(pushes, str(d), d, n_params, lr, memcpy[d]) for d in dtypes}


def _summarise(pushes: list, key: str, dtype: torch.dtype, n_params: int, lr: float, memcpy: list) -> dict:
    steady = pushes[1:]
    names = ("dense", "delta_sharded", "sparse")
    rec = {m: [p[0][dtype][m][0] for p in pushes] for m in names}
    tot = {m: {f: sum(getattr(r, f) for r in rec[m][1:]) for f in ("bytes", "cast_s", "encode_s", "apply_s", "changed")}
           for m in names}
    density = tot["sparse"]["changed"] / (n_params * len(steady)) if steady else 0.0
    model_bytes = n_params * dtype.itemsize * len(steady)
    sparse_s = tot["sparse"]["encode_s"] + tot["sparse"]["apply_s"]
    per_push = [round(c / (r.encode_s + r.apply_s), 3) for c, r in zip(memcpy, rec["sparse"][1:])]
    out = {
        "params": n_params, "lr": lr, "steps": len(steady), "density": round(density, 6),
        "density_per_step": [round(r.changed / n_params, 6) for r in rec["sparse"][1:]],
        "density_by_kind_per_step": {k: [p[1][key].get(k) for p in steady] for k in KINDS},
        "sparse_full_pushes": [r.full for r in rec["sparse"]],
        "bitwise_equal": {m: all(p[0][dtype][m][1] for p in pushes) for m in names},
        "bytes_per_push": {m: [r.bytes for r in rec[m]] for m in names},
        "steady_seconds": {m: {f: round(tot[m][f], 4) for f in ("cast_s", "encode_s", "apply_s")} for m in names},
        "payload_ratio_vs_dense": {m: round(tot[m]["bytes"] / tot["dense"]["bytes"], 6) for m in names[1:]},
        "payload_bound": round(min(1.0, density * (codec.INDEX_BYTES + dtype.itemsize) / dtype.itemsize), 6),
        "encode_apply_gbps": round(model_bytes / sparse_s / 1e9, 3) if sparse_s else None,
        "memcpy_gbps": round(model_bytes / sum(memcpy) / 1e9, 3) if memcpy else None,
        "encode_apply_over_memcpy": round(sum(memcpy) / sparse_s, 3) if memcpy and sparse_s else None,
        "encode_apply_over_memcpy_per_push": per_push,
        "encode_apply_over_memcpy_median_push": sorted(per_push)[len(per_push) // 2] if per_push else None,
    }
    return out


def special_values_probe() -> dict:
    """Bit patterns a float comparison misses, pushed through delta_sharded's apply and sparse_sync's."""
    cases = {"+0.0 -> -0.0": (0x0000, -0x8000), "NaN payload change": (0x7FC1, 0x7F81),
             "finite -> NaN": (0x3F80, 0x7FC0), "denormal change": (0x0001, 0x0040)}
    out = {}
    for method in (DeltaSharded(torch.bfloat16), Sparse(torch.bfloat16)):
        w = torch.randn(64).to(torch.bfloat16)
        bits = w.view(torch.int16)
        for i, (before, _after) in enumerate(cases.values()):
            bits[i] = before
        method.push([("w", w)])
        for i, (_before, after) in enumerate(cases.values()):
            bits[i] = after
        method.push([("w", w)])
        got = method.weights["w"].view(torch.int16)
        out[method.name] = {case: bool(got[i] == bits[i]) for i, case in enumerate(cases)}
    return out


def _sparse_kernels() -> str:
    """Build or load the compiled kernels now (never inside a timed push) and say which kernels the sparse path runs."""
    t0 = time.perf_counter()
    why = native.why_unavailable()
    if why is not None:
        return f"numpy/torch ({why})"
    simd = "AVX2 compare" if native.kernels().set_avx2(True) else "portable compare"
    return f"compiled (kernels.cpp, {simd}; built or loaded in {time.perf_counter() - t0:.1f} s)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps per workload (default: 8 tiny, 6 large)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--e2e", action="store_true", help="instead: ThunderSync main_ppo, dense vs sparse pushes")
    parser.add_argument("--e2e-steps", type=int, default=3)
    parser.add_argument("--work-dir", default="runs/weight_sync")
    add_results_dir_argument(parser)
    args = parser.parse_args()
    if args.e2e:
        from weight_sync_e2e import end_to_end  # sibling script in benchmarks/

        write_result("weight_sync_e2e", end_to_end(args.e2e_steps, args.work_dir), args.results_dir)
        return
    torch.set_num_threads(1)
    kernels = _sparse_kernels()
    tiny_steps, large_steps = (3, 3) if args.quick else (8, 6)
    tiny, tiny_vocab, tiny_source = tiny_student()
    tiny_res = run_workload("tiny student (cpu_tiny recipe)", tiny, tiny_vocab, TINY_LR, 0.0,
                            [torch.float32, torch.bfloat16], tiny_steps, args.seed)
    large, large_vocab = larger_model()
    large_res = run_workload("qwen2 57M (B200 recipe lr)", large, large_vocab, LARGE_LR, 0.01, [torch.bfloat16],
                             large_steps, args.seed)
    probe = special_values_probe()
    workloads = {"tiny_student_fp32": tiny_res["float32"], "tiny_student_bf16": tiny_res["bfloat16"],
                 "qwen2_57m_bf16": large_res["bfloat16"]}
    head = workloads["qwen2_57m_bf16"]
    ratio, density = head["payload_ratio_vs_dense"]["sparse"], head["density"]
    bound = 3 * density  # (int32 index + bf16 value) per change: 3x the bf16 bytes of the changed elements
    errors = va.checkpoint_engine_import_errors()
    result = {
        "bitwise_equal": all(w["bitwise_equal"]["sparse"] for w in workloads.values()) and all(probe["sparse"].values()),
        "payload_ratio_vs_dense": ratio,
        "density": density,
        "payload_target": round(bound, 6),
        "payload_target_met": ratio <= bound,
        "compression_vs_dense": round(1 / ratio, 3),
        "compression_target": round(1 / bound, 3),
        "encode_apply_gbps": head["encode_apply_gbps"],
        "memcpy_gbps": head["memcpy_gbps"],
        "encode_apply_over_memcpy": head["encode_apply_over_memcpy"],
        "encode_apply_over_memcpy_target": 0.5,
        "encode_apply_over_memcpy_median_push": head["encode_apply_over_memcpy_median_push"],
        "gbps": GBPS_MEANS,
        "threads": f"torch intra-op {torch.get_num_threads()} (memcpy included); sparse kernels single-threaded",
        "sparse_kernels": kernels,
        "headline_workload": "qwen2_57m_bf16",
        "delta_sharded_engine_on_cpu": f"not runnable: {errors.get('delta_checkpoint_engine', 'imported')}; NCCL "
                                       "wire on CUDA; rollout worker accepts it for sglang/vllm only. Its own "
                                       "functions were run instead (see docstring).",
        "special_values_probe": probe,
        "workloads": workloads,
        "tiny_model": tiny_source,
        "seconds": "compute on this machine, summed over the pushes after the first: cast (learner dtype to rollout "
                   "dtype, common to all methods), encode (diff, buckets, checksum), apply (verify and write); no wire",
        "quick": args.quick,
    }
    print(f"\nheadline (qwen2_57m_bf16, pushes after the first): density {density:.4f}, sparse payload "
          f"{ratio:.4f} x dense (target <= 3 x density = {bound:.4f}), delta_sharded "
          f"{head['payload_ratio_vs_dense']['delta_sharded']:.4f} x dense; encode+apply "
          f"{head['encode_apply_gbps']} GB/s vs memcpy {head['memcpy_gbps']} GB/s "
          f"(encode_apply_over_memcpy {head['encode_apply_over_memcpy']}, per push "
          f"{head['encode_apply_over_memcpy_per_push']}); special values {probe}")
    write_result("weight_sync", result, args.results_dir)


if __name__ == "__main__":
    main()
