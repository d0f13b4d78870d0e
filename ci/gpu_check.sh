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

# main_ppo on ONE GPU, ThunderSync vs Sync (prepared, unverified until it has run on a GPU machine): stock
# verl.trainer.main_ppo through benchmarks/modes.py with the cpu_tiny recipe moved to CUDA: the tiny student the
# model factory builds (an HF folder), an FSDP2 learner and a vLLM rollout on a quarter of the GPU, 4 steps each.
# In ThunderSync the standalone rollout pool and the learner share the one GPU: Ray gets the recipe's logical GPU
# slots and leaves CUDA_VISIBLE_DEVICES alone (every worker sees GPU 0); weights go through cpu_channel (NCCL refuses
# two ranks on one device). Proves the CUDA learner path and the vLLM integration; prints one JSON line.
RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 $PY benchmarks/modes.py --modes sync,thundersync --steps 4 \
    --work-dir runs/gpu_check --results-dir runs/gpu_check/results \
    --override trainer.device=cuda \
    --override actor_rollout_ref.rollout.name=vllm \
    --override actor_rollout_ref.rollout.gpu_memory_utilization=0.25 \
    --override actor_rollout_ref.rollout.enforce_eager=true \
    --override actor_rollout_ref.rollout.free_cache_engine=true \
    --override ray_kwargs.ray_init.num_gpus=3
