"""Where the group buckets live and what they cost: ONE function for the planner and the learner.

Why:
1. A bucket is a full copy of the rank's LOCAL gradient shards in the accumulation dtype (fp32):
   ``numel * 4`` bytes. With 32 open groups and two buckets each, an 8B learner rank holds far
   more bucket bytes than its accelerator has, so on accelerators buckets go to host memory
   (pinned, so copies are asynchronous), and the planner must price them there.
2. ``bucket_memory`` is the only place that turns (values per rank, ``thundersync.bucket_device``,
   whether the learner sits on an accelerator, buckets at once) into (placement, bytes). The learner
   (``streaming_worker._BatchState``) builds its ``BufferPool`` from it, ``thundersync plan`` prices
   its recommendation with it and the launch check (``verl_adapter/bucket_check.py``) compares it
   with the budget and the host memory: the three cannot disagree.
3. ``auto`` means host on an accelerator (device memory is the scarce one) and device on a CPU
   learner (there host IS the device: one copy, no staging).
"""

from __future__ import annotations

from dataclasses import dataclass

from thundersync_verl.core.errors import StreamingConfigError, rule_message

BUCKET_DEVICES = ("auto", "host", "device")
FP32_BYTES = 4


@dataclass(frozen=True)
class BucketMemory:
    """Placement and cost of the buckets of one learner rank."""

    storage: str  # "host" or "device": where BufferPool allocates
    pinned: bool  # host buffers in page-locked memory (accelerator learners only)
    bucket_bytes: int  # one bucket: the rank's local gradient shards in the accumulation dtype
    buckets: int  # buckets held at once (the plan's peak)

    @property
    def peak_bytes(self) -> int:
        return self.buckets * self.bucket_bytes

    @property
    def host_bytes(self) -> int:
        return self.peak_bytes if self.storage == "host" else 0

    @property
    def device_bytes(self) -> int:
        return self.peak_bytes if self.storage == "device" else 0


def check_bucket_device(value: str) -> str:
    """``value`` if it names a bucket placement, else a rule/why/fix error naming the key."""
    if value not in BUCKET_DEVICES:
        raise StreamingConfigError(rule_message(
            f"thundersync.bucket_device must be one of {BUCKET_DEVICES}, got {value!r}",
            "group buckets live either in host memory (pinned on accelerators) or next to the parameters",
            "set thundersync.bucket_device=host (accelerators) or auto (host on accelerators, device on CPU)"))
    return value


def bucket_placement(bucket_device: str, accelerator: bool) -> str:
    """``host`` or ``device`` for ``thundersync.bucket_device`` on a learner with or without an accelerator."""
    check_bucket_device(bucket_device)
    if bucket_device == "auto":
        return "host" if accelerator else "device"
    return bucket_device


def bucket_memory(numel: int, *, bucket_device: str = "auto", accelerator: bool, buckets: int = 1,
                  elem_bytes: int = FP32_BYTES) -> BucketMemory:
    """Placement and bytes of ``buckets`` buckets of ``numel`` values each (point 2)."""
    if int(numel) < 0 or int(buckets) < 0 or int(elem_bytes) <= 0:
        raise StreamingConfigError(rule_message(
            f"bucket_memory needs numel >= 0, buckets >= 0, elem_bytes > 0 (got {numel}, {buckets}, {elem_bytes})",
            "a bucket's size is a count of gradient values times their width",
            "pass the rank's local gradient values and the accumulation dtype's width"))
    storage = bucket_placement(bucket_device, accelerator)
    return BucketMemory(storage=storage, pinned=storage == "host" and accelerator,
                        bucket_bytes=int(numel) * int(elem_bytes), buckets=int(buckets))
