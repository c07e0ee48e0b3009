#!/usr/bin/env bash
# The embedded default on a CPU (what `make demo` runs): a tiny Qwen3 + character tokenizer built from
# scratch, a short supervised warm-up, then GRPO with jetrl-unified and, unless COMPARE=0,
# naive-fp8-rollout on the same seed. Closing report: runs/$NAME/summary.json (+ report.txt, plots/).
#
#   recipes/tiny-arith-cpu.sh                      # default + comparison
#   STEPS=10 COMPARE=0 recipes/tiny-arith-cpu.sh   # shorter, unified only
#   DRY_RUN=1 recipes/tiny-arith-cpu.sh            # check configs and this machine, print the command
#   recipes/tiny-arith-cpu.sh --set algo.name=dapo # extra arguments go to python -m jetrl.demo
set -euo pipefail

PYTHON=${PYTHON:-.venv/bin/python}
NAME=${NAME:-tiny-arith}
STEPS=${STEPS:-60}
SEED=${SEED:-0}
OUT_DIR=${OUT_DIR:-runs}
COMPARE=${COMPARE:-1}
DRY_RUN=${DRY_RUN:-0}

cmd=("$PYTHON" -m jetrl.demo --name "$NAME" --steps "$STEPS" --seed "$SEED" --out-dir "$OUT_DIR")
if [[ "$COMPARE" == 1 ]]; then cmd+=(--compare); else cmd+=(--no-compare); fi
cmd+=("$@")

if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exec "${cmd[@]}" --dry-run
fi
exec "${cmd[@]}"
