#!/usr/bin/env bash
# Pack vLLM 0.26.0 (+ the wheels the offline H200 image lacks) into two carryable folders of at most
# ~60 MB each, for the `device` tool's 64 MiB-per-call limit. Nothing here is committed (.device/ is
# git-ignored); third_party/install_vllm_device.sh unpacks it on the device.
#
#   bash third_party/pack_vllm_device.sh          # -> .device/vllm-a, .device/vllm-b
#
# Then, on the device, one call per folder, back to back (the machine stays warm ~30 s; /tmp survives):
#   run(carry=[".device/vllm-a"], command="bash third_party/install_vllm_device.sh .device/vllm-a")
#   run(carry=[".device/vllm-b"], command="bash third_party/install_vllm_device.sh .device/vllm-b && \
#       source /tmp/jetrl-vllm/env.sh && python3 scripts/bench_rollout.py ...")
#
# The vLLM wheel (~300 MB) is stripped of what a dense-model text decode on sm_90 never loads: the
# FlashAttention-2 extension (sm_80; Hopper uses FA3), the MoE extension, the vllm-rs binary, the
# sm_100 FMHA sources and DeepGEMM builds for other Pythons. xz brings the rest to ~75 MB, split in parts.
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=third_party/vllm-device-wheels.txt
OUTDIR=.device
CACHE=$OUTDIR/cache
PART_MB=30
mkdir -p "$CACHE/wheels"
mapfile -t reqs < <(grep -v '^#' "$PINS" | grep -v '^$')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any -d "$CACHE/wheels" "${reqs[@]}"
n_want=${#reqs[@]}
n_have=$(find "$CACHE/wheels" -name '*.whl' | wc -l)
[ "$n_have" -eq "$n_want" ] || { echo "expected $n_want wheels in $CACHE/wheels, found $n_have (stale files?)"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# the dependencies, unzipped into one site tree (the device untars it into its --target folder)
mkdir -p "$work/deps"
for w in "$CACHE"/wheels/*.whl; do
  case "$(basename "$w")" in vllm-*) continue ;; esac
  unzip -q -o "$w" -d "$work/deps"
done
# vLLM, stripped
mkdir -p "$work/vllm"
unzip -q "$CACHE"/wheels/vllm-0.26.0-*.whl -d "$work/vllm"
rm -f "$work/vllm/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$work/vllm/vllm/_moe_C_stable_libtorch.abi3.so" \
  "$work/vllm/vllm/vllm-rs"
rm -rf "$work/vllm/vllm/third_party/fmha_sm100"
find "$work/vllm/vllm/third_party/deep_gemm" -maxdepth 1 -name '_C.cpython-*.so' ! -name '_C.cpython-312-*' -delete

rm -rf "$OUTDIR/vllm-a" "$OUTDIR/vllm-b"
mkdir -p "$OUTDIR/vllm-a" "$OUTDIR/vllm-b"
tar -C "$work/deps" -cf - . | xz -T0 -6 > "$OUTDIR/vllm-a/deps.tar.xz"
tar -C "$work/vllm" -cf - . | xz -T0 -6 | split -b "${PART_MB}M" - "$work/vllm.part."
parts=("$work"/vllm.part.*)
# the first part travels with the dependencies, the rest in the second folder
mv "${parts[0]}" "$OUTDIR/vllm-a/"
for p in "${parts[@]:1}"; do mv "$p" "$OUTDIR/vllm-b/"; done
(cd "$work" && printf '%s\n' "${parts[@]##*/}") > "$OUTDIR/vllm-a/PARTS"
cp "$OUTDIR/vllm-a/PARTS" "$OUTDIR/vllm-b/PARTS"
du -sh "$OUTDIR/vllm-a" "$OUTDIR/vllm-b"
for d in "$OUTDIR/vllm-a" "$OUTDIR/vllm-b"; do
  size=$(du -sm "$d" | cut -f1)
  [ "$size" -le 62 ] || { echo "$d is $size MB: over what one device call can carry beside the repo"; exit 1; }
done
