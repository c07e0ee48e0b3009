#!/usr/bin/env bash
# Qwen2.5-7B on MATH, 8K responses, with verl dapo (DAPO settings: recipes/lib/verl_common.sh says where each comes from).
#   python scripts/data/math.py                      # once: writes $DATA_DIR/math/{train,test}.parquet
#   bash recipes/qwen2.5-7b_math.sh                 # RECIPE=jetrl-unified (default) | naive-fp8-rollout | bf16
#   DRY_RUN=1 MODEL_PATH=recipes/models/qwen2.5-7b bash recipes/qwen2.5-7b_math.sh   # check the config, no GPU
# Extra hydra overrides are forwarded, e.g. trainer.total_epochs=1.
set -euo pipefail

MODEL_NAME=qwen2.5-7b
MODEL_ID=Qwen/Qwen2.5-7B
DATASET=math
ALGO=dapo
RESPONSE_LEN=${RESPONSE_LEN:-8192}
PROMPT_LEN=${PROMPT_LEN:-1024}

source "$(dirname "${BASH_SOURCE[0]}")/lib/verl_common.sh"
jetrl_verl_run "$@"
