"""Both ends of a sparse weight push: the sender's snapshot and the receiver's copy.

Why:
1. The sender keeps, per parameter shard, the bits it last pushed in the rollout's dtype. Each push
   diffs the learner's current weights (cast to that dtype exactly as a dense push would cast
   them) against it, sends what changed and updates the snapshot in place: only the changed
   elements are written, the rest is read once.
2. A push whose (index, value) pairs would cost more than the dense push (density above the
   break-even: 1/3 in bf16, 1/2 in fp32) is sent as a full push; below it, a chunk whose own pairs
   would cost more than its values travels as a dense run. A full push is also
   sent first, after either side restarts (the chain tokens disagree) and when a receiver asks
   for one. Whatever the mode, the receiver ends with the same bits.
3. Pushes form a chain: each carries the token of the push it patches (``base``) and its own.
   The receiver OVERWRITES its copy with the pushed values (never adds) and applies a patch only
   onto the exact state it was computed against; a patch on any other base, or one whose checksum
   does not match, is refused before any element is written.
4. A sender shard covers a fixed, aligned slice of every flattened parameter, so several learner
   ranks can share the diff work and the snapshot memory; one shard covers everything.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable

import torch

from thundersync_verl.backends.sparse_sync import codec, native
from thundersync_verl.core.errors import rule_message

DEFAULT_CHUNK_ELEMS = 1 << 20  # 2 MB of bf16: the cast chunk stays in cache for the diff
DEFAULT_BUCKET_BYTES = 512 << 20


class PushRefused(RuntimeError):
    """A receiver cannot apply a payload (checksum or chain mismatch); a full push repairs it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def shard_bounds(numel: int, shard: int, n_shards: int) -> tuple[int, int]:
    """The aligned slice [lo, hi) of a flattened parameter that sender shard ``shard`` covers."""
    def cut(i: int) -> int:
        return numel if i >= n_shards else (numel * i // n_shards) // codec.ALIGN_ELEMS * codec.ALIGN_ELEMS

    return cut(shard), cut(shard + 1)


@dataclass
class PushStats:
    """What one encode did (elements, changed elements, bytes, time, dense chunks)."""

    numel: int = 0
    changed: int = 0
    payload_bytes: int = 0
    pair_bytes: int = 0  # what every change sent as an (index, value) pair would cost
    dense_bytes: int = 0
    dense_chunks: int = 0
    encode_s: float = 0.0
    cast_s: float = 0.0
    full: bool = False
    reason: str = ""
    changed_by_name: dict = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.changed / self.numel if self.numel else 0.0


@dataclass
class _Snap:
    shape: tuple[int, ...]
    lo: int
    hi: int
    buf: torch.Tensor  # this shard's slice, rollout dtype, flat
    density: float = 0.0  # changed share at the last patch push (none yet: 0): picks the diff kernel


class ShardEncoder:
    """The sender's side for one shard: snapshot, diff, chain token."""

    def __init__(self, shard: int = 0, n_shards: int = 1, *, dtype: torch.dtype | None = None,
                 chunk_elems: int = DEFAULT_CHUNK_ELEMS, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 snapshot_device: str | None = None) -> None:
        if not 0 <= shard < n_shards:
            raise ValueError(f"shard {shard} is outside 0..{n_shards - 1}")
        self.shard, self.n_shards, self.dtype = shard, n_shards, dtype
        self.chunk = max(codec.ALIGN_ELEMS, int(chunk_elems) // codec.ALIGN_ELEMS * codec.ALIGN_ELEMS)
        self.bucket_bytes = int(bucket_bytes)
        self.snapshot_device = snapshot_device
        self.snaps: dict[str, _Snap] = {}
        self.token: str | None = None  # the last push every receiver acknowledged
        self._scratch = codec.Scratch()  # the CPU diff's buffers, reused chunk after chunk
        self._cast_bufs: dict[tuple, torch.Tensor] = {}  # one chunk in the rollout dtype, reused

    def reset(self) -> None:
        """Forget the snapshot (the next push is full)."""
        self.snaps.clear()
        self.token = None

    def _target_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def encode(self, weights: Iterable[tuple[str, torch.Tensor]], force_full: bool = False) -> tuple[codec.Payload, PushStats]:
        """Diff ``weights`` against the snapshot (updated in place) and build this shard's payload."""
        full = force_full or self.token is None or not self.snaps
        stats = PushStats(full=full, reason="first" if self.token is None else ("forced" if full else ""))
        builder = codec.PayloadBuilder(self.bucket_bytes)
        self._scratch.begin()  # the last push's pairs were copied into its buckets
        seen = set()
        for name, tensor in weights:
            seen.add(name)
            self._encode_one(name, tensor.detach(), builder, stats, full)
        if seen != set(self.snaps):
            for name in set(self.snaps) - seen:
                del self.snaps[name]
            if not full:  # a parameter vanished: the receiver's copy no longer matches the snapshot's names
                full, stats.full, stats.reason = True, True, "names"
        if not full and max(stats.pair_bytes, stats.payload_bytes) >= stats.dense_bytes:
            full, stats.full, stats.reason = True, True, "break_even"
        if full:
            builder = self._full_builder(stats)
            self._reserve_pairs()
        new_token = uuid.uuid4().hex
        t0 = time.perf_counter()
        payload = builder.build(full=full, shard=self.shard, base=None if full else self.token, token=new_token,
                                reason=stats.reason, numel=stats.numel, changed=stats.changed)
        stats.encode_s += time.perf_counter() - t0
        stats.payload_bytes = payload.nbytes
        return payload, stats

    def _reserve_pairs(self) -> None:
        """At a full push (no diff runs): room, touched once, for the pairs of the next patches (one chunk
        plus an eighth of the elements per dtype; it grows if a patch needs more), so page faults on
        fresh scratch memory are paid here and not inside the first patches."""
        numel: dict[torch.dtype, int] = {}
        for snap in self.snaps.values():
            if snap.buf.device.type == "cpu":
                bits_dtype = codec.bits(snap.buf[:0]).dtype
                numel[bits_dtype] = numel.get(bits_dtype, 0) + snap.buf.numel()
        if numel and native.kernels() is not None:  # only the compiled diff writes into the arena
            for dtype, n in numel.items():
                self._scratch.reserve(self.chunk + n // 8, dtype)

    def full_payload(self, reason: str) -> codec.Payload:
        """This shard's whole snapshot as a full push (a repair: the snapshot already holds the weights)."""
        if self.token is None and not self.snaps:
            raise RuntimeError("no snapshot to resend: nothing was pushed yet")
        stats = PushStats(full=True, reason=reason)
        stats.numel = sum(s.hi - s.lo for s in self.snaps.values())
        return self._full_builder(stats).build(full=True, shard=self.shard, base=None, token=uuid.uuid4().hex,
                                               reason=reason, numel=stats.numel, changed=stats.numel)

    def commit(self, payload: codec.Payload) -> None:
        """Every receiver holds ``payload``'s state: later pushes patch it."""
        self.token = payload.token

    def _encode_one(self, name: str, tensor: torch.Tensor, builder: codec.PayloadBuilder, stats: PushStats,
                    full: bool) -> None:
        flat = tensor.reshape(-1)
        lo, hi = shard_bounds(flat.numel(), self.shard, self.n_shards)
        dtype = self._target_dtype(flat)
        snap = self.snaps.get(name)
        if snap is None or snap.shape != tuple(tensor.shape) or snap.buf.dtype != dtype or (snap.lo, snap.hi) != (lo, hi):
            device = self.snapshot_device or flat.device
            snap = _Snap(tuple(tensor.shape), lo, hi, torch.empty(hi - lo, dtype=dtype, device=device))
            self.snaps[name] = snap
            full_param = True
        else:
            full_param = full
        stats.numel += hi - lo
        stats.dense_bytes += (hi - lo) * snap.buf.element_size()
        before = stats.changed_by_name.get(name, 0)
        for c0 in range(lo, hi, self.chunk):
            c1 = min(c0 + self.chunk, hi)
            t0 = time.perf_counter()
            new = self._cast(flat[c0:c1], snap.buf)
            t1 = time.perf_counter()
            stats.cast_s += t1 - t0
            self._encode_chunk(name, snap, c0, new, builder, stats, full_param)
            stats.encode_s += time.perf_counter() - t1
        if not full_param:
            snap.density = (stats.changed_by_name.get(name, 0) - before) / max(hi - lo, 1)

    def _cast(self, piece: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``piece`` in ``like``'s dtype and device: the piece itself when it already is, else a copy
        into a buffer reused chunk after chunk (warm in cache for the diff that follows)."""
        if piece.dtype == like.dtype and piece.device == like.device:
            return piece
        key = (like.dtype, like.device)
        buf = self._cast_bufs.get(key)
        if buf is None or buf.numel() < piece.numel():
            buf = self._cast_bufs[key] = torch.empty(self.chunk, dtype=like.dtype, device=like.device)
        return buf[: piece.numel()].copy_(piece)

    def _encode_chunk(self, name: str, snap: _Snap, c0: int, new: torch.Tensor, builder: codec.PayloadBuilder,
                      stats: PushStats, full_param: bool) -> None:
        old_bits = codec.bits(snap.buf[c0 - snap.lo : c0 - snap.lo + new.numel()])
        new_bits = codec.bits(new)
        dname = codec.dtype_name(new.dtype)
        if full_param:
            old_bits.copy_(new_bits)
            stats.changed += new.numel()
            stats.changed_by_name[name] = stats.changed_by_name.get(name, 0) + new.numel()
            if not stats.full:  # a new parameter inside a patch push travels as a dense run
                builder.add(name, snap.shape, dname, c0, new.numel(), old_bits)
                stats.payload_bytes += new.numel() * new.element_size()
            return
        pos, values = codec.diff_update(new_bits, old_bits, words=snap.density < codec.WORDS_BELOW_DENSITY,
                                        scratch=self._scratch)  # the snapshot now holds ``new``
        k = int(pos.numel())
        if k == 0:
            return
        stats.changed += k
        stats.changed_by_name[name] = stats.changed_by_name.get(name, 0) + k
        stats.pair_bytes += codec.sparse_bytes(k, new.element_size())
        if codec.sparse_bytes(k, new.element_size()) >= new.numel() * new.element_size():
            builder.add(name, snap.shape, dname, c0, new.numel(), old_bits)
            stats.dense_chunks += 1
            stats.payload_bytes += new.numel() * new.element_size()
            return
        builder.add(name, snap.shape, dname, c0, new.numel(), values, indices=pos)
        stats.payload_bytes += codec.sparse_bytes(k, new.element_size())

    def _full_builder(self, stats: PushStats) -> codec.PayloadBuilder:
        """A payload of every snapshot value (the snapshot already holds the current weights)."""
        builder = codec.PayloadBuilder(self.bucket_bytes)
        for name, snap in self.snaps.items():
            dname = codec.dtype_name(snap.buf.dtype)
            for c0 in range(snap.lo, snap.hi, self.chunk):
                c1 = min(c0 + self.chunk, snap.hi)
                builder.add(name, snap.shape, dname, c0, c1 - c0, codec.bits(snap.buf[c0 - snap.lo : c1 - snap.lo]))
        stats.payload_bytes = stats.dense_bytes
        return builder


@dataclass
class ApplyStats:
    entries: int = 0
    pairs: int = 0
    dense_elems: int = 0
    apply_s: float = 0.0
    verify_s: float = 0.0
    names: set = field(default_factory=set)


class Mirror:
    """The receiver's copy of the weights (rollout dtype) and the chain token per sender shard."""

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.flat: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.tokens: dict[int, str] = {}
        self._index: torch.Tensor | None = None  # int64 positions, reused (made on first use)

    def _positions(self, indices: torch.Tensor) -> torch.Tensor:
        """``indices`` (int32 on the wire) as the int64 ``index_copy_`` takes, in a reused buffer."""
        if self._index is None or self._index.numel() < indices.numel():
            self._index = torch.empty(indices.numel(), dtype=torch.int64, device=self.device)
        return self._index[: indices.numel()].copy_(indices)

    def _scatter(self, target: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> None:
        """``target[indices] = values``: the compiled kernel on CPU (int32 positions as sent), else index_copy_."""
        kernels = native.usable_for(target, indices, values)
        if kernels is not None:
            kernels.scatter(target, indices, values)
        else:
            target.index_copy_(0, self._positions(indices), values)

    def reset(self) -> None:
        self.flat.clear()
        self.shapes.clear()
        self.tokens.clear()

    def tensor(self, name: str) -> torch.Tensor:
        return self.flat[name].view(self.shapes[name])

    def named_tensors(self, names: Iterable[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        return [(n, self.tensor(n)) for n in (self.flat if names is None else names)]

    def verify(self, payload: codec.Payload) -> None:
        """Raise ``PushRefused`` unless ``payload`` is intact and patches exactly this copy's state."""
        got = codec.checksum(payload.entries, payload.buckets)
        if got != payload.checksum:
            raise PushRefused("checksum", rule_message(
                f"sparse push from shard {payload.shard} failed its checksum (sent {payload.checksum}, got {got})",
                "a corrupted patch would leave the rollout with weights the learner never had",
                "nothing was applied; the sender resends this shard as a full push"))
        if payload.full:
            return
        held = self.tokens.get(payload.shard)
        if held != payload.base:
            raise PushRefused("chain", rule_message(
                f"sparse push from shard {payload.shard} patches state {payload.base}, this copy holds {held}",
                "a patch is only exact on the state it was diffed against",
                "nothing was applied; the sender resends this shard as a full push"))

    def apply(self, payload: codec.Payload) -> ApplyStats:
        """Verify, then overwrite the pushed elements with the pushed bits; returns what was touched."""
        stats = ApplyStats()
        t0 = time.perf_counter()
        self.verify(payload)
        t1 = time.perf_counter()
        for e in payload.entries:
            if e.name not in self.flat or (payload.full and self.shapes[e.name] != tuple(e.shape)):
                numel = 1
                for d in e.shape:
                    numel *= int(d)
                self.flat[e.name] = torch.zeros(numel, dtype=codec.dtype_of(e.dtype), device=self.device)
                self.shapes[e.name] = tuple(e.shape)
            target = codec.bits(self.flat[e.name])[e.start : e.start + e.length]
            bucket = payload.buckets[e.bucket]
            values = bucket.values[e.val_off : e.val_off + e.count].to(target.device)
            if e.kind == "dense":
                target.copy_(values)
                stats.dense_elems += e.count
            else:
                self._scatter(target, bucket.indices[e.idx_off : e.idx_off + e.count], values)
                stats.pairs += e.count
            stats.entries += 1
            stats.names.add(e.name)
        self.tokens[payload.shard] = payload.token
        stats.verify_s, stats.apply_s = t1 - t0, time.perf_counter() - t1
        return stats
