#!/usr/bin/env bash
# Qwen3-8B-Base on DeepMath-103K, 16K responses, with verl dapo (DAPO settings: recipes/lib/verl_common.sh says where each comes from).
#   python scripts/data/deepmath.py                      # once: writes $DATA_DIR/deepmath/{train,test}.parquet
#   bash recipes/qwen3-8b-base_deepmath.sh                 # RECIPE=jetrl-unified (default) | naive-fp8-rollout | bf16
#   DRY_RUN=1 MODEL_PATH=recipes/models/qwen3-8b-base bash recipes/qwen3-8b-base_deepmath.sh   # check the config, no GPU
# Extra hydra overrides are forwarded, e.g. trainer.total_epochs=1.
set -euo pipefail

MODEL_NAME=qwen3-8b-base
MODEL_ID=Qwen/Qwen3-8B-Base
DATASET=deepmath
ALGO=dapo
RESPONSE_LEN=${RESPONSE_LEN:-16384}
PROMPT_LEN=${PROMPT_LEN:-1024}

source "$(dirname "${BASH_SOURCE[0]}")/lib/verl_common.sh"
jetrl_verl_run "$@"
