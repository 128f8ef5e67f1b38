"""Check support-matrix cells by running GPU vLLM: for each (checkpoint, cache dtype, attention backend) case, does
the engine start, which backend runs, and what scales do its attention layers hold?

Why: the vLLM cells of calib/recipe/support rest on reading vLLM's source. This runs the cases a CUDA build can
answer for itself (FlashAttention vs Triton, per-tensor vs per-head scales, a checkpoint without q_scale, the
per-token-head caches, fp8_e5m2 with an FP8 checkpoint) and writes what it saw; tests/recipe/
test_support_measured.py then checks each observation against the matrix's cell for that version.

On the GPU machine, from the repository root, after `bench/gpu/vllm_setup.sh install` and with PYTHONPATH set:
    python3 bench/gpu/matrix_check.py CKPTS OUT.json     # CKPTS holds kvcalib checkpoints plain/ and head-q/
One child process per case, so a refused case cannot leave the next one without GPU memory.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
PROBE_DIR = HERE.parents[2] / "tests" / "engine"

# name: (checkpoint folder, --kv-cache-dtype, attention backend)
CASES = {
    "fa3-tensor": ("plain", "fp8", "FLASH_ATTN"),
    "fa3-head-q": ("head-q", "fp8", "FLASH_ATTN"),
    "fa3-skip": ("skip", "fp8", "FLASH_ATTN"),
    "triton-tensor": ("plain", "fp8", "TRITON_ATTN"),
    "triton-head-q": ("head-q", "fp8", "TRITON_ATTN"),
    "fa3-e5m2": ("plain", "fp8_e5m2", "FLASH_ATTN"),
    "triton-e5m2": ("plain", "fp8_e5m2", "TRITON_ATTN"),
    "fa3-fp8-per-token-head": ("plain", "fp8_per_token_head", "FLASH_ATTN"),
    "triton-fp8-per-token-head": ("plain", "fp8_per_token_head", "TRITON_ATTN"),
    "triton-int8-per-token-head": ("plain", "int8_per_token_head", "TRITON_ATTN"),
    "triton-int4-per-token-head": ("plain", "int4_per_token_head", "TRITON_ATTN"),
}


def file_scales(ckpt: Path) -> dict[str, dict[str, list[float]]]:
    """Every k/v/q scale tensor in the checkpoint's safetensors, by layer index, flattened."""
    from safetensors import safe_open

    out: dict[str, dict[str, list[float]]] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                m = re.search(r"layers\.(\d+)\..*\.([kvq])_scale$", key)
                if m:
                    t = st.get_tensor(key).float().flatten()
                    out.setdefault(m.group(1), {})[m.group(2)] = [float(x) for x in t]
    return out


def backend_names(model) -> list[str]:
    """`apply_model` target: the attention implementation class of each attention layer."""
    return sorted({type(m.impl).__name__ for _, m in model.named_modules()
                   if hasattr(m, "impl") and hasattr(m, "kv_cache_dtype")})


def one_case(ckpt: Path, dtype: str, backend: str, out: Path) -> int:
    """Child: start the engine for one case and write what it holds (or raise: the parent records the error)."""
    sys.path.insert(0, str(PROBE_DIR))
    sys.path.insert(0, str(HERE.parent))
    import dataclasses

    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    import matrix_check
    import vllm_probe

    fields = {f.name for f in dataclasses.fields(EngineArgs)}
    kw = ({"attention_backend": backend} if "attention_backend" in fields
          else {"attention_config": {"backend": backend}} if "attention_config" in fields else {})
    if not kw:
        os.environ["VLLM_ATTENTION_BACKEND"] = backend
    llm = LLM(model=str(ckpt), kv_cache_dtype=dtype, dtype="bfloat16", enforce_eager=True, max_model_len=512,
              max_num_seqs=4, seed=0, gpu_memory_utilization=0.3,
              kv_cache_dtype_skip_layers=[str(i) for i in vllm_probe.skipped_layers(ckpt)], **kw)
    layers = llm.apply_model(vllm_probe.read_layer_details)[0]
    impls = llm.apply_model(matrix_check.backend_names)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    gen = llm.generate([TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 123, 7, 256, 300])], params, use_tqdm=False)
    out.write_text(json.dumps({"started": True, "impls": impls, "layers": {str(i): d for i, d in layers.items()},
                               "generated": [int(t) for t in gen[0].outputs[0].token_ids]}))
    return 0


def main(argv: list[str]) -> int:
    only = os.environ.get("MATRIX_CASES")
    if argv and argv[0] == "--case":
        return one_case(Path(argv[1]), argv[2], argv[3], Path(argv[4]))
    ckpts, out = Path(argv[0]), Path(argv[1])
    import vllm

    doc = {"vllm": vllm.__version__, "device": _device(), "files": {}, "cases": {}}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    for name, (folder, dtype, backend) in CASES.items():
        if only and name not in only.split(","):
            continue
        ckpt = ckpts / folder
        tmp = out.with_suffix(f".{name}.json")
        t = time.time()
        r = subprocess.run([sys.executable, str(HERE), "--case", str(ckpt), dtype, backend, str(tmp)],
                           capture_output=True, text=True, env=env, timeout=300)
        if folder not in doc["files"]:
            doc["files"][folder] = file_scales(ckpt)
        case = {"checkpoint": folder, "kv_cache_dtype": dtype, "backend": backend, "seconds": round(time.time() - t, 1)}
        if r.returncode == 0 and tmp.is_file():
            case.update(json.loads(tmp.read_text()))
        else:
            lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if re.search(r"\b[\w.]*(Error|Exception): ", ln)]
            case.update(started=False, rc=r.returncode, error=(errors or lines or ["(no output)"])[-1][-600:],
                        log_tail=[ln[-300:] for ln in lines if "Traceback" in ln or not ln.startswith(("INFO", "("))][-25:])
        doc["cases"][name] = case
        print(f"{name}: {'started' if case['started'] else 'refused'} in {case['seconds']} s "
              f"{case.get('impls', '')}{case.get('error', '')[:200]}", flush=True)
        out.write_text(json.dumps(doc, indent=1))
    return 0


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
