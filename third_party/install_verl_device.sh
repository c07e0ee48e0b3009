#!/usr/bin/env bash
# On the device, after install_vllm_device.sh on the same warm machine: unpack the folder made by
# pack_verl_device.sh into the same /tmp/site as vLLM and check that verl and jetrl.verl import.
# Idempotent. Afterwards `source /tmp/jetrl-vllm/env.sh` gives vLLM, verl and Ray.
#
#   bash third_party/install_verl_device.sh .device/verl
set -euo pipefail
src=${1:?usage: install_verl_device.sh CARRIED_FOLDER}
root=/tmp/jetrl-vllm
site=/tmp/site
[ -f "$root/env.sh" ] || { echo "install vLLM first (third_party/install_vllm_device.sh), same warm machine"; exit 1; }
if [ ! -f "$root/verl.done" ]; then
  xz -dc "$src/verl-deps.tar.xz" | tar -x -C "$site"
  touch "$root/verl.done"
  echo "verl + Ray unpacked into $site"
fi
# shellcheck disable=SC1091
source "$root/env.sh"
python3 -c 'import verl, ray, math_verify, jetrl.verl.plugin; print("verl", verl.__version__, "ray", ray.__version__)'
