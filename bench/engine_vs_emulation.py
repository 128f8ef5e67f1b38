"""Does `kvcalib eval`'s emulation predict what the engine does? Perplexity rise of an FP8 e4m3 KV cache with
scale 1.0, per emulation mode, against real vLLM on exactly the same token ids.

    .venv/bin/python bench/engine_vs_emulation.py [--model M] [--data D] [--samples 4] [--seq-len 1024]
        [--vllm-venv DIR] [--out DIR]

Emulated side (this venv): the model in its checkpoint dtype, every token's K and V through each mode's cache
write (`calib/evaluation/emulate.py`; `vllm-fa3` also runs FlashAttention-3-style FP8 attention), perplexity over every
position after the first, against the same model unquantised.

Engine side (`bench/vllm_ppl.py` in the vLLM venv, when one is given or found): vLLM with a BF16 cache; the
same engine with each K/V-only mode's cache write injected into its BF16 cache path (vLLM's own RoPE and
attention kernel on the emulated cache contents); and vLLM's own FP8 cache. vLLM's CPU build runs an FP8 cache
only on x86 with AVX-512 or AMX: on other CPUs that column holds the engine's refusal, and the script says so.

Writes OUT/results.json and OUT/results.md (a table: mode, emulated rise, engine-with-injected-cache rise,
real engine FP8 rise). Token ids come from `calib.data.sources.samples` with packing (every sample exactly --seq-len
tokens), seed 0, so a run is reproducible and the ids can be handed to any engine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def token_ids(model: str, data: str, samples: int, seq_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from calib.data import sources as data_mod

    tok = AutoTokenizer.from_pretrained(model)
    seqs = list(data_mod.samples(data, tok, seq_len=seq_len, max_samples=samples, min_tokens=seq_len, pack=True,
                                 seed=0, vocab_size=None, report=data_mod.DataReport()))
    if len(seqs) < samples:
        sys.exit(f"DATA {data} gives only {len(seqs)} packed samples of {seq_len} tokens; ask for fewer --samples")
    return [list(s) for s in seqs]


def emulated(model: str, ids: list[list[int]], modes: list[str], cpu_dtype: str | None = None) -> dict:
    """{"reference": {"ppl", "nll", "tokens"}, mode: {...}} with the default arm (scale 1.0) per mode."""
    import torch

    from calib.evaluation import emulate
    from calib.evaluation.arms import Geometry, default_arm
    from calib.evaluation.fakequant import fake_quant_kv
    from calib.evaluation.run import load_causal_lm
    from calib.recipe.dtypes import FP8_E4M3

    loaded = load_causal_lm(model, "cpu", False, cpu_dtype)
    lm = loaded.model
    geo = Geometry.of(loaded.config, loaded.attention_layers)

    def nll(hook, arm) -> tuple[float, int, float]:
        t0, total, n = time.perf_counter(), 0.0, 0
        with hook.applying(arm):
            for s in ids:
                x = torch.tensor([s])
                logp = torch.log_softmax(lm(input_ids=x, use_cache=False).logits[0, :-1].float(), dim=-1)
                total -= float(logp.gather(-1, x[0, 1:, None]).sum())
                n += len(s) - 1
        return total, n, time.perf_counter() - t0

    out = {"model_dtype": str(loaded.dtype).removeprefix("torch.")}
    with torch.inference_mode():
        for mode in modes:
            with fake_quant_kv(lm, emulate.by_name(mode)) as hook:
                if "reference" not in out:
                    t, n, sec = nll(hook, None)
                    out["reference"] = {"ppl": math.exp(t / n), "nll": t, "tokens": n, "seconds": sec}
                t, n, sec = nll(hook, default_arm(geo, FP8_E4M3))
                ppl = math.exp(t / n)
                out[mode] = {"ppl": ppl, "nll": t, "tokens": n, "seconds": sec,
                             "ppl_rel": ppl / out["reference"]["ppl"] - 1}
                print(f"emulated {mode}: ppl {ppl:.4f} ({100 * out[mode]['ppl_rel']:+.2f} %)", flush=True)
    return out


def engine(model: str, ids: list[list[int]], venv: Path, injects: list[str], work: Path) -> dict:
    ids_file, res_file = work / "ids.json", work / "vllm.json"
    ids_file.write_text(json.dumps(ids))
    cmd = [str(venv / "bin" / "python"), str(ROOT / "bench" / "vllm_ppl.py"), "--model", model, "--ids", str(ids_file),
           "--out", str(res_file), "--kv-cache-dtype", "auto", "--kv-cache-dtype", "fp8"]
    for m in injects:
        cmd += ["--inject", m]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run(cmd, env=env, text=True, capture_output=True)
    if r.returncode != 0 or not res_file.is_file():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": f"vLLM run failed (exit {r.returncode}): {tail[0]}"}
    doc = json.loads(res_file.read_text())
    base = next((x for x in doc["runs"] if x["kv_cache_dtype"] == "auto" and x.get("inject") is None), None)
    for x in doc["runs"]:
        if base and "ppl" in x:
            x["ppl_rel"] = x["ppl"] / base["ppl"] - 1
    return doc


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:+.2f} %"


def table(emu: dict, eng: dict, modes: list[str]) -> list[str]:
    runs = eng.get("runs", [])
    inj = {x.get("inject"): x for x in runs if x["kv_cache_dtype"] == "auto"}
    real = next((x for x in runs if x["kv_cache_dtype"] == "fp8"), None)
    real_txt = _pct(real.get("ppl_rel")) if real and "ppl" in real else \
        f"not run here: {real['error']}" if real else eng.get("error", "no vLLM venv")
    lines = ["| mode | emulated ppl rise | vLLM BF16 kernel, injected cache write | vLLM FP8 cache |",
             "|---|---|---|---|"]
    for m in modes:
        lines.append(f"| `{m}` | {_pct(emu[m]['ppl_rel'])} | {_pct(inj.get(m, {}).get('ppl_rel'))} | {real_txt} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from calib.evaluation import emulate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: `kvcalib default-model`)")
    ap.add_argument("--data", default=str(ROOT / "data" / "sample_text.jsonl"))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--modes", default=",".join(emulate.names()))
    ap.add_argument("--cpu-dtype", default=None, help="model dtype for the emulation (default: the checkpoint's, "
                    "bf16 for the default model, as vLLM runs it)")
    ap.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", str(ROOT / ".venv-vllm")))
    ap.add_argument("--out", default=str(ROOT / "out" / "engine-vs-emulation"))
    a = ap.parse_args(argv)
    if a.model is None:                 # the CLI's stable answer, whatever the default model is
        r = subprocess.run([sys.executable, "-m", "calib.cli", "default-model"], capture_output=True, text=True,
                           check=True)
        a.model = r.stdout.strip().splitlines()[-1]
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    for m in modes:
        emulate.by_name(m)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = token_ids(a.model, a.data, a.samples, a.seq_len)
    emu = emulated(a.model, ids, modes, a.cpu_dtype)
    (out / "ids.json").write_text(json.dumps(ids))
    (out / "results.json").write_text(json.dumps({"emulated": emu}, indent=2))   # kept if the engine run dies
    venv = Path(a.vllm_venv)
    kv_only = [m for m in modes if emulate.by_name(m).attention == "model"]
    if (venv / "bin" / "python").is_file():
        eng = engine(a.model, ids, venv, kv_only, out)
    else:
        eng = {"error": f"no vLLM venv at {venv} (make engine-venv, or --vllm-venv DIR)"}
    for x in eng.get("runs", []):
        if "error" in x:
            print(f"vLLM kv_cache_dtype={x['kv_cache_dtype']}: the engine refused on this machine: {x['error']}")
    doc = {"model": a.model, "data": a.data, "samples": a.samples, "seq_len": a.seq_len, "scale": 1.0,
           "emulated": emu, "engine": eng,
           "modes": {m: emulate.by_name(m).describe() for m in modes}}
    (out / "results.json").write_text(json.dumps(doc, indent=2))
    base = next((x for x in eng.get("runs", []) if x["kv_cache_dtype"] == "auto" and x.get("inject") is None), {})
    md = [f"Model `{a.model}`, data `{a.data}`: {a.samples} x {a.seq_len} tokens, FP8 e4m3 KV, scale 1.0.",
          f"Perplexity unquantised: emulation reference {emu['reference']['ppl']:.4f} ({emu['model_dtype']}), "
          f"vLLM BF16 cache {base.get('ppl', float('nan')):.4f}.", ""] + table(emu, eng, modes)
    (out / "results.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
