#!/usr/bin/env bash
# The GPU check (prepared, UNVERIFIED until it has run on a GPU machine): every GPU path of the project in at
# most 10 minutes on one H200 (a second GPU, where present, adds the DP 2 and NCCL checks). The table of checks
# is ci/gpu_check.py; it prints one JSON line per check and a summary line. docs/gpu-check.md says what each does.
#
#   bash ci/gpu_check.sh            the run: creates .venv-gpu on first use (a CUDA torch), then the checks
#   bash ci/gpu_check.sh --setup    only create .venv-gpu (the README's one install command for a GPU machine)
#   bash ci/gpu_check.sh --dry-run  any machine, no GPU: every command resolved, every import tried, the
#                                   platform of each check printed; ends with {"dry_run": true, ...}
#   bash ci/gpu_check.sh --only fsdp2_equivalence,sparse_sync
#
# The GPU venv is never make's .venv: that one has the CPU build of torch (torch==2.13.0+cpu). .venv-gpu gets
# the CUDA torch verl 0.9.1's vllm extra pins (torch==2.11.0) with vllm, megatron-core, mbridge, TransferQueue
# and cupy (setup.py's gpu extra); TransformerEngine compiles against that torch, so it comes second, without
# build isolation. VERL_PLATFORM is the caller's when set (nvidia otherwise) and no code below overrides it.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_VENV=${GPU_VENV:-.venv-gpu}

setup_gpu_venv() {
    python3 -m venv "$GPU_VENV"
    "$GPU_VENV/bin/python" -m pip install -q --upgrade pip
    "$GPU_VENV/bin/python" -m pip install -q -e ".[gpu]"
    "$GPU_VENV/bin/python" -m pip install -q --no-build-isolation "transformer-engine[pytorch]"
    touch "$GPU_VENV/.installed"
}

case "${1:-}" in
    --dry-run)
        # no GPU needed: the GPU venv where it exists, else make's CPU .venv (GPU-only packages reported missing)
        if [ -z "${PY:-}" ]; then
            if [ -x "$GPU_VENV/bin/python" ]; then PY="$GPU_VENV/bin/python"; else PY=.venv/bin/python; fi
        fi
        exec "$PY" ci/gpu_check.py "$@" ;;
    --setup)
        setup_gpu_venv
        exit 0 ;;
esac
[ -f "$GPU_VENV/.installed" ] || setup_gpu_venv
export VERL_PLATFORM=${VERL_PLATFORM:-nvidia} RAY_AUTH_MODE=disabled
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# ci/gpu_check.py refuses a torch without CUDA, a check on platform cpu, and runs each check under its timeout
exec "$GPU_VENV/bin/python" ci/gpu_check.py "$@"
