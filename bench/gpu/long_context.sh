#!/usr/bin/env bash
# The long-context runs behind bench/RESULTS.md's "long context" section, as steps on the GPU machine (run from
# the repository root; each step fits one device call and leaves what the next needs under /tmp):
#   kernels RES   - calib/evaluation/fa3.py's CUDA tests, then bench/gpu/longctx.py: an emulated FP8 arm against
#                   the bf16 reference at 8K (default model's shape), 32K and 128K (Llama-3.1-8B shape)
#   model SHAPE   - a random-weight checkpoint of SHAPE (bench/gpu/random_model.py) in /tmp/kvcalib-SHAPE, with
#                   the tokenizer carried in .tok/
#   checkpoints RES - the default model and three calibrations of it (before vLLM is installed)
#   default RES [eval args] - `kvcalib eval` of 8 arms at 2K/8K (BF16, 1.0, three checkpoints, three skip trials)
#   long RES SHAPE BUCKETS [validate args] - `kvcalib validate` of a random-weight model (BF16 vs FP8 1.0)
#   routes RES [plan args] - `kvcalib plan --routes`: short chat vs long documents on the default model, plan.json
#   formats RES [eval args] - the engine's own KV formats (issue 25) on the default model at 2K/8K
#   hybrid RES [validate args] - a Gemma-3-4B-like hybrid (random weights) at 8K/32K: capacity per arm from the
#                   engine next to the bytes model, the sliding-window skip arm in GPU vLLM (issue 28)
#   rest RES      - routes, formats, formats on the 8B shape and hybrid as four processes at once (times are
#                   shared-device times: report capacities and quality from it, not TTFT/TPOT)
# Order for a fresh machine: kernels (with part-0), models (part-1: model llama-3.1-8b; model gemma3-4b-hybrid),
# checkpoints (part-2), then part-3 + install + default, then rest; one call each.
# vLLM comes from bench/gpu/vllm_setup.sh (stage the four parts, then install).
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
ck=/tmp/kvcalib-ck data=/tmp/kvcalib-data

venv() {     # kvcalib runs the engine as <venv>/bin/python: the image's python3 here
  [ -x /tmp/vllm-env/bin/python ] && return 0
  mkdir -p /tmp/vllm-env/bin
  printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > /tmp/vllm-env/bin/python && chmod +x /tmp/vllm-env/bin/python
}

texts() {    # the project's own files as domain text: docs to calibrate on, Python sources held out
  [ -f "$data/held/calib_cli.py.txt" ] && return 0
  mkdir -p "$data/calib" "$data/held"
  cp docs/*.md "$data/calib/" && cp README.md "$data/calib/readme.md"
  for f in "$data"/calib/*.md; do mv -f "$f" "${f%.md}.txt"; done
  find calib -name '*.py' | while read -r f; do cp "$f" "$data/held/$(echo "$f" | tr / _).txt"; done
}

kernels() {
  local res=${1:?RES}; mkdir -p "$res"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/evaluation/test_fa3.py tests/evaluation/test_fa3_kernel.py 2>&1 | tail -6
  timeout 150 python3 bench/gpu/longctx.py --json "$res/longctx-8k.json" --cases smollm2-135m:8192x4 2>&1 | grep -v '^ ' | tail -6
  timeout 240 python3 bench/gpu/longctx.py --json "$res/longctx-8b.json" --variants fused,global --profile \
    --cases llama-3.1-8b:32768x1,llama-3.1-8b:131072x1 --skip-variants-above 32768 2>&1 | grep -v '^ ' | tail -8
}

model() {
  local shape=${1:?SHAPE}
  [ -f "/tmp/kvcalib-$shape/config.json" ] && return 0
  python3 bench/gpu/random_model.py --shape "$shape" --tokenizer .tok --out "/tmp/kvcalib-$shape" 2>&1 | tail -2
}

checkpoints() {   # the default model and three calibrations of it (no engine needed: runs before vLLM is installed)
  local res=${1:?RES}; mkdir -p "$res"; texts
  local t0=$SECONDS
  python3 -m calib.cli default-model > "$res/default-model.log" 2>&1 || { tail -5 "$res/default-model.log"; return 1; }
  for v in "plain:" "head-q:--granularity head --q-scale" "mse:--observer mse"; do
    local name=${v%%:*} flags=${v#*:}
    python3 -m calib.cli calibrate --data "$data/calib" --pack --samples 16 --seq-len 2048 --out "$ck/$name" $flags \
      > "$res/calibrate-$name.log" 2>&1 || { tail -5 "$res/calibrate-$name.log"; return 1; }
  done
  echo "default model + 3 checkpoints: $((SECONDS - t0)) s"
}

default() {      # issue 30's 8-arm evaluation: BF16, scale 1.0, three checkpoints, three skip trials, engine + passkey
                 # (--dominance 1: the trials run whenever no arm passes; no layer of the default model stands out)
  local res=${1:?RES}; shift; mkdir -p "$res"; venv; texts
  [ -d "$ck/mse" ] || checkpoints "$res" || return 1
  local t0=$SECONDS
  python3 -m calib.cli eval --engine vllm --vllm-venv /tmp/vllm-env --emulate vllm-fa3 --data "$data/held" --pack \
    --scales "$ck/plain" --scales "$ck/head-q" --scales "$ck/mse" --buckets 2048,8192 --samples 8 --max-skip 3 \
    --dominance 1 --out "$res/eval" --no-plots "$@" > "$res/eval.log" 2>&1
  local rc=$?
  echo "eval rc=$rc in $((SECONDS - t0)) s"
  grep -E "plan|total|estimat" "$res/eval.log" | head -20
  tail -25 "$res/eval.log"
  return $rc
}

long() {
  local res=${1:?RES} shape=${2:?SHAPE} buckets=${3:?BUCKETS}; shift 3; mkdir -p "$res"; venv; texts
  model "$shape" || return 1
  local t0=$SECONDS
  python3 -m calib.cli validate --vllm-venv /tmp/vllm-env --model "/tmp/kvcalib-$shape" --data "$data/held" --pack \
    --buckets "$buckets" --max-skip 0 --out "$res/validate-$shape" --no-plots "$@" > "$res/validate-$shape.log" 2>&1
  local rc=$?
  echo "validate $shape rc=$rc in $((SECONDS - t0)) s"
  tail -25 "$res/validate-$shape.log"
  return $rc
}

routes() {
  local res=${1:?RES}; shift; mkdir -p "$res"; venv; texts
  cp data/sample_chat.jsonl "$data/chat.jsonl"
  cat > "$data/routes.yaml" <<YAML
routes:
  chat:
    data: chat.jsonl
    buckets: [512, 2048]
    samples: 8
    bar: {max_kl: 0.01, max_ppl_increase: 0.01}
  long-documents:
    data: held
    buckets: [8192]
    samples: 4
    pack: true
    bar: {max_kl: 0.02, max_ppl_increase: 0.02, min_passkey: 0.8}
YAML
  local t0=$SECONDS
  local sc=(); [ -d "$ck/plain" ] && sc=(--scales "$ck/plain")
  python3 -m calib.cli plan --routes "$data/routes.yaml" "${sc[@]}" --engine vllm --vllm-venv /tmp/vllm-env \
    --emulate vllm-fa3 --out "$res/plan" "$@" > "$res/plan.log" 2>&1
  local rc=$?
  echo "plan rc=$rc in $((SECONDS - t0)) s"; tail -15 "$res/plan.log"
  return $rc
}

formats() {
  local res=${1:?RES}; shift; mkdir -p "$res"; venv; texts
  python3 -m calib.cli default-model > /dev/null 2>&1 || return 1
  local t0=$SECONDS sc=(); [ -d "$ck/plain" ] && sc=(--scales "$ck/plain")
  python3 -m calib.cli eval --engine vllm --vllm-venv /tmp/vllm-env --emulate vllm-fa3 --formats all \
    --data "$data/held" --pack "${sc[@]}" --buckets 2048,8192 --samples 4 --passkey-trials 0 --max-skip 0 \
    --out "$res/formats" --no-plots "$@" > "$res/formats.log" 2>&1
  local rc=$?
  echo "formats rc=$rc in $((SECONDS - t0)) s"; grep -A14 "## KV formats" "$res/formats/report.md" | head -20
  return $rc
}

hybrid() {
  local res=${1:?RES}; shift
  model gemma3-4b-hybrid || return 1
  long "$res" gemma3-4b-hybrid 8192,32768 --samples 2 --concurrency 2 --output-tokens 32 --engine-kv-gib 16 \
    --emulate vllm-fa3 --requests 2 "$@"
  grep -A12 "## KV memory" "$res/validate-gemma3-4b-hybrid/eval/report.md" | head -16
}

rest() {         # routes, formats (default model and 8B shape) and hybrid at once: their engine starts overlap
  local res=${1:?RES}; mkdir -p "$res"; venv; texts
  model llama-3.1-8b && model gemma3-4b-hybrid || return 1
  local t0=$SECONDS
  ( timeout "${T:-540}" bash "$0" routes "$res/routes" --passkey-trials 2 --max-skip 0 > "$res/routes.out" 2>&1 ) &
  sleep 15
  ( timeout "$(( ${T:-540} - 15 ))" bash "$0" formats "$res/formats" > "$res/formats.out" 2>&1 ) &
  sleep 15
  ( timeout "$(( ${T:-540} - 30 ))" bash "$0" hybrid "$res/hybrid" --engine-kv-gib "${KV_GIB:-16}" > "$res/hybrid.out" 2>&1 ) &
  sleep 15
  ( timeout "$(( ${T:-540} - 45 ))" bash "$0" long "$res/formats-8b" llama-3.1-8b 32768 --formats all --samples 1 --concurrency 2 \
      --output-tokens 32 --engine-kv-gib "${KV_GIB:-16}" --requests 2 > "$res/formats-8b.out" 2>&1 ) &
  wait
  echo "rest: $((SECONDS - t0)) s (four runs at once)"
  for f in routes formats hybrid formats-8b; do echo "== $f"; tail -12 "$res/$f.out"; done
}

"$@"
