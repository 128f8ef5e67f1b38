#!/usr/bin/env bash
# On the GPU machine, after `vllm_setup.sh install`: the 8-arm evaluation of the default model at its full 8K
# context, emulated (FlashAttention-3) and in real GPU vLLM, with passkey; the time plan it prints before the
# run is kept next to the measured time.
#   bench/gpu/long_eval.sh RESULTS_DIR [extra eval args]            (run from the repository root)
# Data: the project's own files as the user's domain text — the docs for calibration, the Python sources as
# held-out documents (one .txt per file, packed into the buckets). Arms: BF16, FP8 scale 1.0, three
# checkpoints (per tensor; per head + q_scale; mse observer), three measured skip trials.
set -uo pipefail
res=${1:?RESULTS_DIR}; shift
mkdir -p "$res"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
ck=/tmp/kvcalib-ck data=/tmp/kvcalib-data
mkdir -p "$ck" "$data/calib" "$data/held"
cp docs/*.md "$data/calib/" && cp README.md "$data/calib/readme.md"
for f in docs/*.md "$data"/calib/*.md; do mv -f "$f" "${f%.md}.txt" 2>/dev/null; done
find calib -name '*.py' | while read -r f; do cp "$f" "$data/held/$(echo "$f" | tr / _).txt"; done
mkdir -p /tmp/vllm-env/bin     # kvcalib runs the engine as <venv>/bin/python: the image's python3 here
printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/vllm-env/bin/python && chmod +x /tmp/vllm-env/bin/python
t0=$SECONDS
python3 -m calib.cli default-model > "$res/default-model.log" 2>&1 || { tail -5 "$res/default-model.log"; exit 1; }
echo "default model: $((SECONDS - t0)) s"
for v in "plain:" "head-q:--granularity head --q-scale" "mse:--observer mse"; do
  name=${v%%:*}; flags=${v#*:}; t=$SECONDS
  [ -f "$ck/$name/kvcalib.json" ] && continue
  python3 -m calib.cli calibrate --data "$data/calib" --pack --samples 16 --seq-len 2048 --out "$ck/$name" $flags \
    > "$res/calibrate-$name.log" 2>&1 || { tail -5 "$res/calibrate-$name.log"; exit 1; }
  echo "calibrate $name: $((SECONDS - t)) s"
done
t0=$SECONDS
python3 -m calib.cli eval --engine vllm --vllm-venv /tmp/vllm-env --emulate vllm-fa3 --data "$data/held" --pack \
  --scales "$ck/plain" --scales "$ck/head-q" --scales "$ck/mse" --buckets 2048,8192 --samples 8 --max-skip 3 \
  --out "$res/eval" --no-plots "$@" > "$res/eval.log" 2>&1
rc=$?
echo "eval rc=$rc in $((SECONDS - t0)) s"
grep -iE "plan|estimate|minutes" "$res/eval.log" | head -12
tail -30 "$res/eval.log"
exit $rc
