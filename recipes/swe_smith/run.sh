#!/usr/bin/env bash
# Launch a SWE-smith GPU recipe of this folder with stock verl (python -m verl.trainer.main_ppo).
#
#   recipes/swe_smith/run.sh ALGO SHAPE LAYOUT MODE [hydra overrides...]
#     ALGO    grpo | opd                                   (grpo.yaml, opd.yaml)
#     SHAPE   qwen3_8b | qwen3_30b_a3b                     (shape/: parallel sizes of the model)
#     LAYOUT  1node | 2nodes | 4nodes                      (layout/: nodes of 8 B200, 4 learner + 4 rollout each)
#     MODE    sync | async | fully_async | thundersync     (mode/)
#
# Environment (paths are read by the recipes themselves, ${oc.env:...}):
#   MODEL_PATH    Hugging Face checkpoint of the student, of shape SHAPE          (required)
#   DATA_DIR      train.parquet + val.parquet from                                 (required)
#                 python -m thundersync_verl.data.swe_smith --input <SWE-smith> --out $DATA_DIR [--name val]
#   TEACHER_PATH  teacher checkpoint, same tokenizer, e.g. Qwen3-32B              (opd)
#   THUNDERSYNC_STOP_FILE  a path; once the file exists the run stops at the next step boundary with a
#                 checkpoint (touch it from the scheduler's pre-emption or time-limit hook; thundersync mode)
# Hardware toggles (defaults for B200 nodes; verl's example scripts expose the same kind of switches):
#   ATTN_BACKEND=fused   Megatron attention: TransformerEngine's cuDNN fused attention runs on Blackwell;
#                        set flash where a FlashAttention build for the GPU is installed
#   CUDA_GRAPHS=1        vLLM CUDA graphs (0: eager decoding, for debugging)
#   CPU_ADAM=...         Megatron's CPU-offloaded Adam: 1 for qwen3_30b_a3b (expert weights fill the GPUs
#                        at 1 node), 0 for qwen3_8b
#   DEEPEP=0             MoE token dispatch through DeepEP (1 needs DeepEP built for the cluster's NICs)
#   WANDB_API_KEY        set: log to wandb as well
#   DRY_RUN=1            print the command instead of running it
#   PLAN=1               run `thundersync plan` for this recipe's hardware instead (the step times in the
#                        recipe headers come from it)
# Multi-node layouts: start Ray on every node first (ray start --head / ray start --address=HEAD:6379)
# and run this script on the head node.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
usage() { echo "usage: $0 grpo|opd qwen3_8b|qwen3_30b_a3b 1node|2nodes|4nodes sync|async|fully_async|thundersync [overrides...]" >&2; exit 2; }
[[ $# -ge 3 ]] || usage
ALGO=$1 SHAPE=$2 LAYOUT=$3 MODE=${4:-thundersync}
shift $(( $# >= 4 ? 4 : 3 ))
[[ -f "$HERE/$ALGO.yaml" && -f "$HERE/shape/$SHAPE.yaml" && -f "$HERE/layout/$LAYOUT.yaml" && -f "$HERE/mode/$MODE.yaml" ]] || usage
NODES=${LAYOUT%%node*}

# ---- per-model deltas: the planner's description of the model and its hardware switches ----------
case $SHAPE in
  qwen3_8b)
    PLAN_MODEL=(--params 8.2B --layers 36 --hidden 4096)
    CPU_ADAM=${CPU_ADAM:-0}
    DEEPEP=0 ;;                        # dense: no token dispatch
  qwen3_30b_a3b)
    # The planner takes one parameter count: the 3.3B active parameters set the FLOPs, and the push
    # bandwidth is scaled by 3.3/30.5 so a weight push still moves all 61 GB of bf16 weights.
    PLAN_MODEL=(--params 3.3B --layers 48 --hidden 4096 --sync-gbps 1.08)
    CPU_ADAM=${CPU_ADAM:-1}
    DEEPEP=${DEEPEP:-0} ;;
esac

if [[ ${PLAN:-0} == 1 ]]; then
  exec thundersync plan "${PLAN_MODEL[@]}" --gpus $((8 * NODES)) --learner-gpus $((4 * NODES)) --cp 4 --algo "$ALGO"
fi

# ---- the shared parameter array: hardware toggles every recipe takes ----------------------------
COMMON=(
  "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=${ATTN_BACKEND:-fused}"
  "actor_rollout_ref.rollout.enforce_eager=$([[ ${CUDA_GRAPHS:-1} == 1 ]] && echo false || echo true)"
)
[[ -n ${WANDB_API_KEY:-} ]] && COMMON+=("trainer.logger=[console,file,wandb]")

MODEL_DELTA=()
if [[ $CPU_ADAM == 1 ]]; then
  MODEL_DELTA+=(
    "actor_rollout_ref.actor.optim.use_precision_aware_optimizer=true"
    "++actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=true"
    "++actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1.0"
    "++actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=true"
  )
fi
if [[ $DEEPEP == 1 ]]; then
  MODEL_DELTA+=(
    "++actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=flex"
    "++actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep=true"
  )
fi

CMD=(python3 -m verl.trainer.main_ppo --config-path="$HERE" --config-name="$ALGO"
     "shape=$SHAPE" "layout=$LAYOUT" "mode=$MODE" "${COMMON[@]}" "${MODEL_DELTA[@]}" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
: "${MODEL_PATH:?set MODEL_PATH to the student checkpoint}" "${DATA_DIR:?set DATA_DIR to the converted SWE-smith parquet folder}"
[[ $ALGO != opd ]] || : "${TEACHER_PATH:?set TEACHER_PATH to the teacher checkpoint (opd)}"
export CUDA_DEVICE_MAX_CONNECTIONS=1   # Megatron: keeps tensor/sequence-parallel communication ordered with compute
export HYDRA_FULL_ERROR=1
# Ray's GCS keeps the last N tasks' events (default 100000): bounded lower for runs of days. It takes effect where
# the GCS starts: here for a local cluster; on a cluster started with `ray start`, export it before that.
export RAY_task_events_max_num_task_in_gcs=${RAY_task_events_max_num_task_in_gcs:-10000}
exec "${CMD[@]}"
