#!/usr/bin/env bash
# Pack verl 0.9.1 + Ray (third_party/verl-device-wheels.txt) into one carryable folder for the offline H200,
# next to pack_vllm_device.sh's two. Nothing here is committed (.device/ is git-ignored).
#
#   bash third_party/pack_verl_device.sh           # -> .device/verl (deps tar.xz, <= 62 MB)
#
# On the device, after vLLM (install_vllm_device.sh, same warm machine, back to back):
#   run(carry=[".device/verl"], command="bash third_party/install_verl_device.sh .device/verl && ...")
#
# Ray's wheel (73.8 MB) is stripped of its Java jars and the dashboard's source maps (ray/jars, *.map),
# which a Python-only job with include_dashboard=False never loads (40.4 MB left, issue 16).
set -euo pipefail
cd "$(dirname "$0")/.."
PINS=third_party/verl-device-wheels.txt
OUTDIR=.device
CACHE=$OUTDIR/cache-verl
mkdir -p "$CACHE/wheels" "$CACHE/sdist"
mapfile -t wheels < <(grep -v '^#' "$PINS" | grep -v '^$' | grep -v '^sdist:')
mapfile -t sdists < <(grep '^sdist:' "$PINS" | sed 's/^sdist://')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$CACHE/wheels" "${wheels[@]}"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$CACHE/sdist" "${sdists[@]}"
for s in "$CACHE"/sdist/*; do
  python3 -m pip wheel -q --no-deps -w "$CACHE/wheels" "$s"
done
n_want=$(( ${#wheels[@]} + ${#sdists[@]} ))
n_have=$(find "$CACHE/wheels" -name '*.whl' | wc -l)
[ "$n_have" -eq "$n_want" ] || { echo "expected $n_want wheels in $CACHE/wheels, found $n_have (stale files?)"; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for w in "$CACHE"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
rm -rf "$work/site/ray/jars"
find "$work/site/ray/dashboard" -name '*.map' -delete
rm -rf "$OUTDIR/verl"
mkdir -p "$OUTDIR/verl"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$OUTDIR/verl/verl-deps.tar.xz"
du -sh "$OUTDIR/verl"
size=$(du -sm "$OUTDIR/verl" | cut -f1)
[ "$size" -le 62 ] || { echo "$OUTDIR/verl is $size MB: over what one device call can carry beside the repo"; exit 1; }
