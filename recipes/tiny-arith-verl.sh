#!/usr/bin/env bash
# The embedded default through verl + Ray on one GPU: the tiny ChatML Qwen3 after jetrl's supervised warm-up
# (`jetrl warmup --format chat`), GRPO on the arithmetic task as verl parquet (scripts/data/arithmetic.py),
# actor and rollout colocated (FSDP2 world size 1, vLLM TP 1). The fidelity run of issue 16 / the smallest
# real `python -m jetrl.verl` a newcomer can start.
#
#   bash recipes/tiny-arith-verl.sh                             # RECIPE=jetrl-unified (default)
#   RECIPE=naive-fp8-rollout bash recipes/tiny-arith-verl.sh    # verl's own FP8 rollout (the baseline)
#   RECIPE=bf16 STEPS=20 bash recipes/tiny-arith-verl.sh
#   DRY_RUN=1 bash recipes/tiny-arith-verl.sh                   # compose + validate + print, no GPU or Ray
# Extra hydra overrides are forwarded last, e.g. trainer.logger='["console","file"]'.
#
# Data and checkpoint are made once (skipped when present): $DATA_DIR/arithmetic/{train,test}.parquet with
# operands 0-9 and $TINY_DIR (the warm-up, on $WARMUP_DEVICE). Settings are the local demo's
# (jetrl/demo.py: 16 prompts x 8 samples per step, 2 mini-batches, lr 2e-4, no KL) with verl's GRPO;
# the image without flash-attn needs sdpa without remove-padding (ATTN=flash_attention_2 REMOVE_PADDING=True
# where flash-attn is installed).
set -euo pipefail

JETRL_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-$HOME/data/jetrl}
TINY_DIR=${TINY_DIR:-$DATA_DIR/tiny-arith-chat}
WARMUP_STEPS=${WARMUP_STEPS:-300}
WARMUP_DEVICE=${WARMUP_DEVICE:-$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}
STEPS=${STEPS:-5}
SEED=${SEED:-0}
ATTN=${ATTN:-sdpa}
REMOVE_PADDING=${REMOVE_PADDING:-False}
LOOP_WORKERS=${LOOP_WORKERS:-2}  # agent-loop, reward and dataloader workers (verl: 8 each) for 16 prompts a step

if [[ ! -f "$DATA_DIR/arithmetic/train.parquet" ]]; then
  "$PYTHON" "$JETRL_ROOT/scripts/data/arithmetic.py" --out-dir "$DATA_DIR/arithmetic" --max-operand 9 --seed "$SEED"
fi
if [[ ! -f "$TINY_DIR/warmup.json" ]]; then
  "$PYTHON" -m jetrl.cli warmup --out "$TINY_DIR" --format chat --max-operand 9 --seed "$SEED" \
    --steps "$WARMUP_STEPS" --device "$WARMUP_DEVICE"
fi

MODEL_NAME=tiny
MODEL_ID=$TINY_DIR
DATASET=arithmetic
ALGO=grpo
NGPUS=${NGPUS:-1}
ROLLOUT_TP=${ROLLOUT_TP:-1}
RESPONSE_LEN=${RESPONSE_LEN:-8}
PROMPT_LEN=${PROMPT_LEN:-128}
TRAIN_BATCH=${TRAIN_BATCH:-16}
MINI_BATCH=${MINI_BATCH:-8}
N_RESP=${N_RESP:-8}
TEST_FREQ=${TEST_FREQ:-$STEPS}
EXPERIMENT=${EXPERIMENT:-tiny-arith-verl_${RECIPE:-jetrl-unified}}

source "$JETRL_ROOT/recipes/lib/verl_common.sh"
jetrl_verl_run \
  actor_rollout_ref.model.use_remove_padding="$REMOVE_PADDING" \
  actor_rollout_ref.model.enable_gradient_checkpointing=False \
  +actor_rollout_ref.model.override_config.attn_implementation="$ATTN" \
  actor_rollout_ref.actor.optim.lr=2e-4 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.3 \
  actor_rollout_ref.rollout.max_num_batched_tokens=8192 \
  actor_rollout_ref.rollout.enforce_eager=True \
  actor_rollout_ref.rollout.agent.num_workers="$LOOP_WORKERS" \
  reward.num_workers="$LOOP_WORKERS" \
  data.dataloader_num_workers="$LOOP_WORKERS" \
  trainer.total_training_steps="$STEPS" \
  data.seed="$SEED" \
  "$@"
