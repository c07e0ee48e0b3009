#!/usr/bin/env bash
# On the device: take one folder made by pack_vllm_device.sh (carried by this call), keep its files in
# /tmp/jetrl-vllm/pay (which outlives the call while the machine stays warm), unpack what is complete
# into /tmp/site, and once vLLM is there write /tmp/jetrl-vllm/env.sh. Idempotent; call once per folder.
#
#   bash third_party/install_vllm_device.sh .device/vllm-a
#   bash third_party/install_vllm_device.sh .device/vllm-b && source /tmp/jetrl-vllm/env.sh
# Later calls on the same warm machine: `source /tmp/jetrl-vllm/env.sh` from the repo root.
set -euo pipefail
src=${1:?usage: install_vllm_device.sh CARRIED_FOLDER}
root=/tmp/jetrl-vllm
site=/tmp/site
mkdir -p "$root/pay" "$site"
cp "$src"/* "$root/pay/"
if [ -f "$root/pay/deps.tar.xz" ] && [ ! -f "$root/deps.done" ]; then
  xz -dc "$root/pay/deps.tar.xz" | tar -x -C "$site"
  touch "$root/deps.done"
  echo "dependencies unpacked into $site"
fi
missing=0
while read -r p; do [ -f "$root/pay/$p" ] || missing=1; done < "$root/pay/PARTS"
if [ "$missing" = 1 ]; then
  echo "vLLM parts still missing: carry the other folder in the next call"
  exit 0
fi
if [ ! -f "$root/vllm.done" ]; then
  (cd "$root/pay" && cat $(cat PARTS)) | xz -dc | tar -x -C "$site"
  touch "$root/vllm.done"
  echo "vLLM unpacked into $site"
fi
nvcc_bin=$(command -v nvcc || true)
[ -n "$nvcc_bin" ] || { echo "no nvcc on PATH: DeepGEMM cannot JIT-compile"; exit 1; }
cat > "$root/env.sh" <<ENV
export PYTHONPATH=$site:\${PYTHONPATH:-}
export CUDA_HOME=$(dirname "$(dirname "$nvcc_bin")")
export VLLM_USE_FLASHINFER_SAMPLER=0
# every JIT cache under one folder, which third_party/jit_cache_device.sh carries from lease to lease
export VLLM_CACHE_ROOT=/tmp/jetrl-cache/vllm TRITON_CACHE_DIR=/tmp/jetrl-cache/triton
export TORCHINDUCTOR_CACHE_DIR=/tmp/jetrl-cache/inductor DG_JIT_CACHE_DIR=/tmp/jetrl-cache/deep_gemm
# jetrl itself, editable from the repo root this is sourced in (each call gets a fresh copy of the
# tree), so vLLM's plugin entry point (vllm.general_plugins) finds jetrl_fp8 in worker processes too
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null
ENV
# shellcheck disable=SC1091
source "$root/env.sh"
python3 -c 'import vllm, jetrl; print("vllm", vllm.__version__, "from", vllm.__file__)'
echo "ready: source $root/env.sh"
