"""Prompts that can be generated again: the same prompt's group on later attempts, for the tail policy.

Why this module exists:
1. The tail policy (tail.py) aborts prompt groups that run long and generates them again in a
   later round, at the weights of that round. A re-run is a new sample of the SAME prompt: how
   long its trajectories run depends mostly on the prompt (how many turns the task takes, how
   slow its repository's tools and tests are), so a prompt that ran long is likely to run long
   again. The draw keeps each prompt's group latents (the shared part of the Gaussian copula,
   dists.group_latents) fixed across attempts and draws only the per-trajectory part again.
   Without that, a deferred prompt would come back as a fresh random length, and deferring
   would quietly throw the long prompts' lengths away.
2. Prompt p is row p % P of block p // P (P prompt groups per step). Attempt 0 of block b is
   exactly SyntheticSource.batch(b), the batch every other mode trains in step b, so all modes
   see the same prompts and the same first attempts (common random numbers). Attempt a >= 1 of a
   block draws its per-trajectory part from a generator seeded by (seed, b, a) only, so a
   re-run's draw never depends on which other prompts run beside it.
3. `gather` assembles one round's launch (any prompts, any attempts, in launch order) into a
   Batch whose group g is the g-th launched prompt; blocks are drawn whole and cached, as a
   round re-runs only a few recent blocks.
4. `RecordedPrompts` are the prompts of a recorded run (a trace's batches, trace.TraceSource) drawn as the
   replay backend serves them again (``engine_kwargs.replay.repeat``): every attempt of a prompt is its
   recorded group, tokens and service times alike. Prompt p is group p % P of the recorded batch p // P;
   a run that needs more prompts than were recorded wraps around to the first batch.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from thundersync_verl.sim.workload import Batch, SyntheticSource

CACHE_BLOCKS = 48  # (block, attempt) batches kept; a round needs about (K + 2) blocks x (K + 1) attempts
PER_TRAJECTORY = ("dur_s", "reward_s", "seq_tokens", "n_turns", "last_score_s", "prompt_tokens", "land_s", "passed")
PER_TURN = ("turn_end_s", "turn_lo", "turn_hi", "turn_score_s", "turn_gen_s", "turn_tool_s", "turn_gen_tokens")


class PromptSource(SyntheticSource):
    """A SyntheticSource whose prompts can be drawn again (module docstring, points 1-2)."""

    def __init__(self, workload, rollout, seed: int = 0):
        super().__init__(workload, rollout, seed)
        self._blocks: OrderedDict = OrderedDict()
        self._group_z: OrderedDict = OrderedDict()

    @classmethod
    def of(cls, source: SyntheticSource) -> "PromptSource":
        """The prompt source with `source`'s workload, rollout and seed (the same batches)."""
        return source if isinstance(source, cls) else cls(source.workload, source.rollout, source.seed)

    @property
    def groups_per_step(self) -> int:
        return self.workload.groups_per_step

    def group_z(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompts' group latents of a block ([P] turns, [P] environment), as batch(block) drew them."""
        if block not in self._group_z:
            w = self.workload
            rng = np.random.default_rng([self.seed, int(block)])
            z_turns = rng.standard_normal(w.groups_per_step)  # dists.group_latents: group part first,
            rng.standard_normal(w.groups_per_step * w.group_size)  # then each trajectory's own part
            z_env = rng.standard_normal(w.groups_per_step)
            self._group_z[block] = (z_turns, z_env)
            _trim(self._group_z)
        return self._group_z[block]

    def attempt(self, block: int, attempt: int) -> Batch:
        """Every prompt of a block on its `attempt`-th run (0: the batch of step `block`)."""
        key = (int(block), int(attempt))
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return self._blocks[key]
        if attempt == 0:
            batch = self.batch(block)
        else:
            w = self.workload
            zg_turns, zg_env = self.group_z(block)
            rng = np.random.default_rng([self.seed, int(block), int(attempt)])
            own = w.group_size * w.groups_per_step
            a, b = math.sqrt(w.icc), math.sqrt(1.0 - w.icc)
            z_turns = a * np.repeat(zg_turns, w.group_size) + b * rng.standard_normal(own)  # [N]
            z_env = a * np.repeat(zg_env, w.group_size) + b * rng.standard_normal(own)  # [N]
            batch = self.draw(rng, *self.from_latents(z_turns, z_env))
        self._blocks[key] = batch
        _trim(self._blocks)
        return batch

    def gather(self, prompts: np.ndarray, attempts: np.ndarray) -> Batch:
        """One round's launch: group g of the result is prompt prompts[g] on attempt attempts[g]."""
        prompts, attempts = np.asarray(prompts, dtype=np.int64), np.asarray(attempts, dtype=np.int64)
        p = self.groups_per_step
        parts = []
        blocks, rows = prompts // p, prompts % p
        keys = blocks * (int(attempts.max(initial=0)) + 1) + attempts
        for key in dict.fromkeys(keys.tolist()):  # first-seen order; positions say where each row goes
            sel = np.flatnonzero(keys == key)
            parts.append((sel, self.attempt(int(blocks[sel[0]]), int(attempts[sel[0]])), rows[sel]))
        return _assemble(parts, len(prompts), self.group_size)


class RecordedPrompts:
    """A recorded run's prompt groups, served again on every attempt (module docstring, point 4)."""

    def __init__(self, source):
        self.source = source  # anything with batch(i), batch_size and group_size (trace.TraceSource)
        self.group_size, self.batch_size = int(source.group_size), int(source.batch_size)
        self.groups_per_step = self.batch_size // self.group_size

    def gather(self, prompts: np.ndarray, attempts: np.ndarray) -> Batch:
        """One round's launch: group g of the result is prompt prompts[g] (the attempt does not matter)."""
        prompts = np.asarray(prompts, dtype=np.int64)
        blocks, rows = prompts // self.groups_per_step, prompts % self.groups_per_step
        parts = [(sel, self.source.batch(int(b)), rows[sel])
                 for b in dict.fromkeys(blocks.tolist()) for sel in [np.flatnonzero(blocks == b)]]
        return _assemble(parts, len(prompts), self.group_size)


def _trim(cache: OrderedDict) -> None:
    while len(cache) > CACHE_BLOCKS:
        cache.popitem(last=False)


def _assemble(parts: list, n_groups: int, size: int) -> Batch:
    """Batch of n_groups groups; part (positions, batch, rows): the batch's group rows[i] becomes group positions[i]."""
    order = np.concatenate([pos for pos, _b, _r in parts])  # [G] launch position of each gathered group
    inv = np.empty(n_groups, dtype=np.int64)
    inv[order] = np.arange(n_groups)
    within = np.arange(size)
    traj = [(r[:, None] * size + within).ravel() for _p, _b, r in parts]  # [n * size] rows of each part
    out = {}
    for name in PER_TRAJECTORY:
        vals = [getattr(b, name) for _p, b, _r in parts]
        if all(v is not None for v in vals):
            out[name] = _reorder(np.concatenate([v[t] for v, t in zip(vals, traj)]), inv, size)
    group = np.repeat(np.arange(n_groups), size)
    batch = Batch(n_groups=n_groups, group=group, **{k: out.get(k) for k in PER_TRAJECTORY})
    if all(b.has_turns for _p, b, _r in parts):
        _assemble_turns(batch, parts, traj, inv, size)
    return batch


def _reorder(values: np.ndarray, inv: np.ndarray, size: int) -> np.ndarray:
    """Per-trajectory values gathered part by part -> in launch order (group-major, `size` per group)."""
    return values.reshape(-1, size)[inv].ravel()


def _assemble_turns(batch: Batch, parts: list, traj: list, inv: np.ndarray, size: int) -> None:
    """The per-turn arrays of the gathered trajectories, in the same (launch) order."""
    turn_idx, counts = [], []
    for (_p, b, _r), t in zip(parts, traj):
        lo, hi = b.turn_ptr[t], b.turn_ptr[t + 1]
        counts.append(hi - lo)
        turn_idx.append((b, _ranges(lo, hi)))
    count = _reorder(np.concatenate(counts), inv, size)  # [N] turns per trajectory in launch order
    gathered = {name: np.concatenate([getattr(b, name)[i] for b, i in turn_idx]) for name in PER_TURN}
    src_ptr = np.concatenate([[0], np.cumsum(np.concatenate(counts))])  # turn offsets in gathered order
    src_traj = np.concatenate([g * size + np.arange(size) for g in inv])  # [N] gathered row of each output row
    pick = _ranges(src_ptr[src_traj], src_ptr[src_traj + 1])
    batch.turn_ptr = np.concatenate([[0], np.cumsum(count)])
    for name, vals in gathered.items():
        setattr(batch, name, vals[pick])


def _ranges(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Concatenation of arange(lo[i], hi[i])."""
    lens = hi - lo
    if not len(lens) or lens.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.repeat(lo - np.concatenate([[0], np.cumsum(lens)[:-1]]), lens)
    return starts + np.arange(lens.sum())
