#!/usr/bin/env bash
# Extract DeepGEMM 2.5.0 from the vllm 0.26.0 wheel into .dg/deep_gemm (git-ignored).
# Usage: bash third_party/fetch_deep_gemm.sh [PYVER]   (PYVER defaults to 312, the device image's Python)
set -euo pipefail
PYVER=${1:-312}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$tmp" vllm==0.26.0
(cd "$tmp" && unzip -q vllm-0.26.0-*.whl 'vllm/third_party/deep_gemm/*')
find "$tmp/vllm/third_party/deep_gemm" -maxdepth 1 -name '_C.cpython-*.so' ! -name "_C.cpython-${PYVER}-*" -delete
rm -rf .dg/deep_gemm && mkdir -p .dg && cp -r "$tmp/vllm/third_party/deep_gemm" .dg/
du -sh .dg/deep_gemm
