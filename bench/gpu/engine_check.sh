#!/usr/bin/env bash
# On the GPU machine, after `vllm_setup.sh install`: kvcalib calibrates its default model there (per tensor;
# per head + q_scale; one layer skipped), then real vLLM loads each checkpoint with an FP8 KV cache and
# tests/engine/test_vllm_engine.py checks that the scales its attention layers hold equal the file.
#   bench/gpu/engine_check.sh RESULTS_DIR          (run from the repository root)
set -uo pipefail
res=${1:?RESULTS_DIR}
mkdir -p "$res"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0
ck=/tmp/kvcalib-ck
rm -rf "$ck" && mkdir -p "$ck"
t0=$SECONDS
python3 -m calib.cli default-model || exit 1
echo "default model ready in $((SECONDS - t0)) s"
run="--samples 16 --seq-len 256"
for v in "plain:" "head-q:--granularity head --q-scale" "skip:--skip-layers 1"; do
  name=${v%%:*}; flags=${v#*:}
  t=$SECONDS
  python3 -m calib.cli calibrate --out "$ck/$name" $run $flags > "$res/calibrate-$name.log" 2>&1 || { tail -20 "$res/calibrate-$name.log"; exit 1; }
  echo "calibrate $name: $((SECONDS - t)) s"
done
status=0
check() {  # name min_passed require [pytest args]
  local name=$1 min=$2 req=$3; shift 3
  local t=$SECONDS
  python3 -m pytest -q -rs -p no:cacheprovider -m engine tests/engine/test_vllm_engine.py --ckpt "$ck/$name" \
    --min-passed "$min" --kv-cache-dtype fp8 --require "$req" --basetemp "/tmp/kvcalib-pt-$name" "$@" \
    > "$res/pytest-$name.log" 2>&1
  local rc=$?
  echo "engine test $name: rc=$rc in $((SECONDS - t)) s: $(tail -1 "$res/pytest-$name.log")"
  [ $rc -eq 0 ] || { status=1; grep -E "^(FAILED|ERROR|E )" "$res/pytest-$name.log" | head -30; }
  # the main probe's report (the control test's probe runs on an edited copy of the checkpoint)
  find "/tmp/kvcalib-pt-$name" -path "*probe0/report.json" | head -1 | xargs -r -I{} cp {} "$res/probe-$name.json"
  return 0
}
check plain 7 fp8-kv
check head-q 8 fp8-kv,per-head,q-scale -k "not control"
check skip 7 fp8-kv,skip-layers -k "not control"
for n in plain head-q skip; do cp "$ck/$n/kvcalib.json" "$res/kvcalib-$n.json" 2>/dev/null; done
echo "engine checks done in $((SECONDS - t0)) s, status $status"
exit $status
