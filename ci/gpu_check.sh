#!/usr/bin/env bash
# Device check for the GPU paths (unverified until it has run on a GPU machine).
# Runs the streamed-vs-sync equivalence on verl's FSDP2 engine with CUDA + NCCL, DP 1 (and DP 2 when
# two GPUs are visible), then the exactness core's CUDA buffers. Prints one JSON line per check.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export VERL_PLATFORM=nvidia RAY_AUTH_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
$PY benchmarks/equivalence.py --quick --dp 1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then $PY benchmarks/equivalence.py --quick --dp 2; fi
$PY -m pytest -q tests/core -k "buffers or memory"
# sparse_sync (unverified until run here): the codec's torch kernels on CUDA (bit-exact pushes, encode+apply GB/s
# next to a device copy), and with two GPUs a push through the engine's NCCL transport between two Ray actors.
$PY -m thundersync_verl.backends.sparse_sync.gpu_check
# Megatron learner (unverified until run here): streamed step vs verl's update_actor on verl's Megatron engine
# with TransformerEngine kernels and NCCL, TP 1 (bf16: the harness picks bfloat16 where CUDA is present; needs
# megatron-core and mbridge, vanilla_mbridge=true). Prints the JSON line with engine/tp/pp/dp/gap_over_floor.
$PY benchmarks/equivalence.py --quick --engine megatron --tp 1
