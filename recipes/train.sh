#!/usr/bin/env bash
# `jetrl train` on a config file, with dotted overrides forwarded:
#
#   recipes/train.sh                                         # recipes/tiny-arith-cpu.yaml
#   CONFIG=my.yaml RECIPE=bf16 recipes/train.sh run.steps=50  # any config, recipe and overrides
#   RESUME=1 recipes/train.sh                                # continue the run after a kill
#   DRY_RUN=1 recipes/train.sh                               # check the config and this machine only
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
CONFIG=${CONFIG:-recipes/tiny-arith-cpu.yaml}
RECIPE=${RECIPE:-jetrl-unified}
SEED=${SEED:-0}
RESUME=${RESUME:-0}
DRY_RUN=${DRY_RUN:-0}

cmd=("$PYTHON" -m jetrl.train "$CONFIG" "run.recipe=$RECIPE" "run.seed=$SEED")
if [[ "$RESUME" == 1 ]]; then cmd+=(--resume); fi
if [[ "$DRY_RUN" == 1 ]]; then cmd+=(--dry-run); fi
cmd+=("$@")

printf '+ '; printf '%q ' "${cmd[@]}"; echo
exec "${cmd[@]}"
