#!/usr/bin/env bash
# llm-compressor (the baseline arm of bench/run.py and bench/e2e.py) for the H200 machine of bench/RESULTS.md,
# which has no network and whose image (Python 3.12) already holds torch 2.11, transformers 5.17,
# accelerate 1.15, numpy, pyarrow, pandas, xxhash, requests, huggingface_hub, tokenizers, safetensors, click,
# psutil, pillow, py-cpuinfo, nvidia-ml-py, typing-extensions and the rest of their needs, but not
# llmcompressor, compressed-tensors or datasets.
#
# On a machine with PyPI, from the repository root:
#   bench/gpu/llmc_wheels.sh            # downloads into .whl-llmc/ (about 5 MB; git ignores it)
# then carry .whl-llmc to the GPU machine and, there, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-llmc/*.whl && export PYTHONPATH=/tmp/site
#
# The list is the Requires-Dist closure of llmcompressor 0.14.0.1 and datasets 5.2.0 for CPython 3.12 on
# Linux, resolved 2026-12-04, minus what the image has (its package list); one version of each. Checked on a
# CPU machine by installing exactly these wheels with the same command into a venv holding only the image's
# packages and importing llmcompressor, datasets and oneshot. pydantic 2.14.4 wants typing-extensions >= 4.16;
# the same pydantic ran vLLM on that image (bench/gpu/vllm_setup.sh), so the image's typing-extensions is kept.
# vllm_setup.sh installs compressed-tensors 0.17.0 for vLLM 0.24; this one is 0.19.0 (llmcompressor pins it):
# when both are needed in one run, give this set its own --target and put it first on PYTHONPATH.
set -euo pipefail

WHEELS=(
  llmcompressor==0.14.0.1 compressed-tensors==0.19.0 auto-round==0.15.1 loguru==0.7.3
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
DEST=${1:-.whl-llmc}
PYVER=${LLMC_WHEELS_PYTHON_VERSION:-3.12}   # another value only for the CPU check of the import closure

mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" "${WHEELS[@]}"
ls -1 "$DEST"
du -sh "$DEST"
