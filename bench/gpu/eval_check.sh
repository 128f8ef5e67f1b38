#!/usr/bin/env bash
# On the GPU machine, after engine_check.sh: `kvcalib eval --engine vllm` on the default model, FA3 emulation
# next to real GPU vLLM on the same token ids, arms BF16 / scale 1.0 / the per-tensor and per-head checkpoints.
#   bench/gpu/eval_check.sh RESULTS_DIR [extra eval args]       (run from the repository root)
set -uo pipefail
res=${1:?RESULTS_DIR}; shift
mkdir -p "$res"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
ck=/tmp/kvcalib-ck
# kvcalib runs the engine as <venv>/bin/python; the image's python3 (with PYTHONPATH) is that environment here.
mkdir -p /tmp/vllm-env/bin
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/vllm-env/bin/python && chmod +x /tmp/vllm-env/bin/python
t0=$SECONDS
python3 -m calib.cli eval --engine vllm --vllm-venv /tmp/vllm-env --emulate vllm-fa3 \
  --scales "$ck/plain" --scales "$ck/head-q" --out "$res/eval" --no-progress "$@" > "$res/eval.log" 2>&1
rc=$?
echo "eval rc=$rc in $((SECONDS - t0)) s"; tail -25 "$res/eval.log"
exit $rc
