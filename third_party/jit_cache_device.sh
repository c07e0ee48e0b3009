#!/usr/bin/env bash
# The device's JIT caches from one lease to the next. A fresh machine compiles everything again: on
# 2026-12-04 a 0.6B jetrl-unified bench_e2e run spent ~470 s of its 590 s call starting (vLLM's
# torch.compile 80 s, DeepGEMM's JIT in the engine and in the training-graph capture, Triton). The env.sh
# of install_vllm_device.sh points every cache (vLLM, Triton, Inductor, DeepGEMM) into /tmp/jetrl-cache;
# this script packs that folder into the call's $OUT and unpacks it from a carried folder.
#
#   device, last call of a lease:  ... && bash third_party/jit_cache_device.sh save $OUT/jit-cache
#   here, after it:                rm -rf .device/jit-cache && cp -r FILES_AT/jit-cache .device/jit-cache
#   device, next lease:            run(carry=[".device/vllm-b", ".device/jit-cache"], command="bash
#     third_party/install_vllm_device.sh .device/vllm-b && bash third_party/jit_cache_device.sh load .device/jit-cache")
#   (vllm-a's 59 MB leave no room for the cache in a call's 64 MiB)
#
# A call brings back at most 8 files of 16 MiB (64 MiB in all) and carries at most 64 MiB with the repo, so
# the cache travels as xz parts of 15 MiB, four at most; `save` refuses more and lists what is large. The
# caches key their entries by source and settings, so an entry that no longer matches is only not used.
set -euo pipefail
cache=${JETRL_JIT_CACHE:-/tmp/jetrl-cache}
part_kb=${JETRL_JIT_CACHE_PART_KB:-15360}  # 15 MiB; both overridable for tests
max_parts=${JETRL_JIT_CACHE_MAX_PARTS:-4}
case "${1:-}" in
  save)
    out=${2:?usage: jit_cache_device.sh save OUT_FOLDER}
    [ -d "$cache" ] || { echo "no $cache to save (was env.sh sourced in the runs?)"; exit 1; }
    mkdir -p "$out"
    tar -C "$cache" -cf - . | xz -T0 -6 | split -b "${part_kb}K" - "$out/jit-cache.part."
    n=$(find "$out" -name 'jit-cache.part.*' | wc -l)
    if [ "$n" -gt "$max_parts" ]; then
      rm -rf "$out"
      echo "the caches pack into $n parts of $part_kb KiB, more than $max_parts; the largest entries (MiB):"
      du -sm "$cache"/*/* 2>/dev/null | sort -rn | head -8
      exit 1
    fi
    echo "saved $(du -sh "$cache" | cut -f1) of caches as $n parts: $(du -sh "$out" | cut -f1)"
    ;;
  load)
    src=${2:?usage: jit_cache_device.sh load CARRIED_FOLDER}
    mkdir -p "$cache"
    cat "$src"/jit-cache.part.* | xz -dc | tar -x -C "$cache"
    echo "caches unpacked into $cache: $(du -sh "$cache" | cut -f1)"
    ;;
  *)
    echo "usage: jit_cache_device.sh save OUT_FOLDER | load CARRIED_FOLDER" >&2
    exit 2
    ;;
esac
