"""GPU check of sparse_sync (``ci/gpu_check.sh``): UNVERIFIED until it has run on a GPU machine.

1. Codec on CUDA: the torch kernels (word-wide compare, nonzero, lane split, index_select /
   index_copy_, the wrapping int64 block digest) encode and apply pushes of bf16 weights that drift
   like an RL run's (a few % of elements cross a bf16 rounding step per push); the receiver's copy
   must equal the weights bit for bit after every push, and encode + apply throughput is printed
   next to a device-to-device copy of the same bytes (and their ratio).
2. NCCL wire (two or more GPUs): a sender and a receiver Ray actor, one GPU each, push through the
   ``sparse_sync`` engine with ``transport=nccl`` (manifests through the channel actor, buckets by
   ``ray.util.collective`` broadcast); the receiver's copy must equal the sender's weights.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from thundersync_verl.backends.sparse_sync.state import Mirror, ShardEncoder


def _drift(weights: dict, generator: torch.Generator, density: float) -> None:
    for t in weights.values():
        hit = torch.rand(t.shape, generator=generator, device=t.device) < density
        t[hit] = (t[hit].float() * (1 + 2 ** -6)).to(t.dtype)


def _equal(mirror: Mirror, weights: dict) -> bool:
    return all(torch.equal(mirror.tensor(n).view(torch.int16), t.view(torch.int16)) for n, t in weights.items())


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def codec_on_device(n_params: int = 1 << 28, pushes: int = 4, density: float = 0.02, device: str = "cuda") -> dict:
    """Bitwise round trips and throughput of encode + apply on one device (bf16, ``n_params`` elements)."""
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [(n_params // 64 // 4096, 4096)] * 64
    weights = {f"w{i}": (torch.randn(s, generator=g, device=dev) * 0.02).to(torch.bfloat16) for i, s in enumerate(shapes)}
    encoder, mirror = ShardEncoder(), Mirror(dev)
    equal, seconds, nbytes = [], [], sum(t.numel() * 2 for t in weights.values())
    for step in range(pushes + 1):
        if step:
            _drift(weights, g, density)
        _sync(dev)
        t0 = time.perf_counter()
        payload, _stats = encoder.encode(list(weights.items()))
        mirror.apply(payload)
        _sync(dev)
        encoder.commit(payload)
        if step:
            seconds.append(time.perf_counter() - t0)
        equal.append(_equal(mirror, weights))
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    _sync(dev)
    copy_gbps = nbytes * 5 / (time.perf_counter() - t0) / 1e9
    encode_apply_gbps = nbytes * pushes / sum(seconds) / 1e9
    return {"bitwise_equal": all(equal), "encode_apply_gbps": round(encode_apply_gbps, 2),
            "device_copy_gbps": round(copy_gbps, 2), "encode_apply_over_copy": round(encode_apply_gbps / copy_gbps, 3),
            "params": n_params, "density": density}


def nccl_push(pushes: int = 3) -> dict:
    """Two GPU actors: the engine's NCCL transport moves full and sparse pushes; bitwise check on the receiver."""
    import ray

    from thundersync_verl.backends.sparse_sync.sparse_engine import SparseSyncCore

    @ray.remote(num_gpus=1)
    class Side:
        def __init__(self):
            self.core = SparseSyncCore(transport="nccl", channel_name="gpu_check")
            g = torch.Generator(device="cuda").manual_seed(0)
            self.w = {"a": (torch.randn(4096, 1024, generator=g, device="cuda") * 0.02).to(torch.bfloat16)}
            self.g = g

        def prepare(self):
            return self.core.prepare()

        def init(self, **kw):
            self.core.init_process_group(**kw)

        def drift(self):
            _drift(self.w, self.g, 0.02)

        async def send(self, version):
            return await self.core.send_weights(list(self.w.items()), version)

        async def receive(self, version):
            return [n async for n, _ in self.core.receive_weights(version)]

        def equal_to(self, weights):
            return _equal(self.core.mirror, {n: t.cuda() for n, t in weights.items()})

        def weights(self):
            return {n: t.cpu() for n, t in self.w.items()}

        def finalize(self):
            self.core.finalize()

    ray.init(ignore_reinit_error=True)
    sender, receiver = Side.remote(), Side.remote()
    results = []
    for version in range(pushes):
        if version:
            ray.get(sender.drift.remote())
        meta = ray.get([sender.prepare.remote(), receiver.prepare.remote()])
        actor, rollout = SparseSyncCore.build_topology(1, 1, meta)
        ray.get([sender.init.remote(**{k: v[0] for k, v in actor.items()}),
                 receiver.init.remote(**{k: v[0] for k, v in rollout.items()})])
        metrics, _names = ray.get([sender.send.remote(version), receiver.receive.remote(version)])
        weights = ray.get(sender.weights.remote())
        results.append({"full": metrics["checkpoint_engine/sparse_sync/full_push"],
                        "equal": ray.get(receiver.equal_to.remote(weights))})
        ray.get([sender.finalize.remote(), receiver.finalize.remote()])
    return {"pushes": results, "bitwise_equal": all(r["equal"] for r in results)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (``ci/gpu_check.py --dry-run`` parses its arguments with it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=1 << 28)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    out = {"codec_cuda": codec_on_device(args.params)}
    if torch.cuda.device_count() >= 2:
        out["nccl"] = nccl_push()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
