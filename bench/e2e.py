"""End to end on one checkpoint saved on local disk: kvcalib against llm-compressor, and eval against a forward.

Why: bench/run.py times calibration inside one process on a model already in memory; a user pays for the
whole job — starting Python, loading the checkpoint, reading the data, the calibration pass and writing the
output. This script times that job for both tools on the same files, and `kvcalib eval` against the plain
forward pass its measurements are built on:
  (a) save   a random-weight checkpoint of `--shape` (bench/run.py's shapes; bf16) with a word tokenizer
             (bench/run.py's `word_tokenizer`) to WORKDIR/model, and the data: WORKDIR/calib.jsonl and
             WORKDIR/eval.jsonl, pre-tokenized `input_ids` records (ids >= 4: no special tokens), so both
             tools read exactly the same token ids;
  (b) kvcalib  `python -m calib.cli calibrate` in a subprocess: load + samples x seq-len tokens + export;
  (c) llmc   llm-compressor's `oneshot(model=PATH, dataset=..., output_dir=..., save_compressed=True)` in a
             subprocess of this script (default observer and static_minmax; skipped, saying why, where
             llmcompressor is not importable — on the GPU machine its wheels come from bench/gpu/llmc_wheels.sh);
  (d) eval   `python -m calib.cli eval` on eval.jsonl with the calibrated checkpoints as arms; each arm's
             measuring seconds (from report.json) against one plain causal-LM forward over the same tokens in
             the same batches, timed here.
Stages run in that order; `--stages` picks some (a later call reuses WORKDIR's checkpoint and outputs).

    python bench/e2e.py --shape tiny --workdir /tmp/e2e --json e2e.json                # CPU smoke run
    python bench/e2e.py --shape llama-3.1-8b --samples 512 --seq-len 2048 --workdir W --json e2e.json  # one H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

STAGES = ("save", "kvcalib", "llmc", "eval")
LLMC_OBSERVERS = ("default", "static_minmax")
FIRST_ID = 4                                       # run.word_tokenizer's ids 0-3 are special tokens


def write_ids(path: Path, n: int, length: int, vocab: int, seed: int) -> int:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(FIRST_ID, vocab) for _ in range(length)]}) + "\n")
    return n * length


def read_ids(path: Path) -> list[list[int]]:
    return [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line.strip()]


def stage_save(args, w: Path) -> dict:
    """A random-weight checkpoint with a tokenizer, and the calibration and evaluation data."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import run as bench

    spec = dict(bench.SHAPES[args.shape])
    config = AutoConfig.for_model(spec.pop("model_type", "llama"), **spec)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for old in ["model", "kvcalib-out", "eval", *(f"llmc-{o}" for o in LLMC_OBSERVERS)]:   # a new checkpoint: no stale outputs
        shutil.rmtree(w / old, ignore_errors=True)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    check_room(w, sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30, "the checkpoint")
    model.save_pretrained(w / "model")
    bench.word_tokenizer(config.vocab_size).save_pretrained(w / "model")
    del model
    seconds = time.perf_counter() - t0
    cal = write_ids(w / "calib.jsonl", args.samples, args.seq_len, config.vocab_size, seed=1)
    ev = write_ids(w / "eval.jsonl", args.eval_samples, args.eval_seq_len, config.vocab_size, seed=2)
    gib = sum(f.stat().st_size for f in (w / "model").iterdir()) / 2**30
    return {"seconds": seconds, "checkpoint_gib": gib, "calib_tokens": cal, "eval_tokens": ev}


def check_room(w: Path, gib: float, what: str) -> None:
    """Fail before a stage that writes a checkpoint-sized output the disk cannot hold."""
    free = shutil.disk_usage(w).free / 2**30
    if free < gib * 1.05:
        raise SystemExit(f"{what} needs about {gib:.1f} GiB in {w}, {free:.1f} GiB free; free space or pick another "
                         "--workdir")


def _env() -> dict:
    """The child's environment: this checkout first on the path, whatever PYTHONPATH held kept after it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def timed_subprocess(cmd: list[str], log: Path) -> dict:
    t0 = time.perf_counter()
    with log.open("w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {r.returncode}); log {log}:\n" + "\n".join(tail))
    return {"seconds": seconds, "log": str(log)}


def stage_kvcalib(args, w: Path) -> dict:
    out = w / "kvcalib-out"
    cmd = [sys.executable, "-m", "calib.cli", "calibrate", "--model", str(w / "model"), "--data", str(w / "calib.jsonl"),
           "--samples", str(args.samples), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
           "--out", str(out), "--force"]
    r = timed_subprocess(cmd, w / "kvcalib.log")
    r["tokens"] = args.samples * args.seq_len
    r["out"] = str(out)
    return r


def llmc_available() -> str | None:
    """None when llmcompressor and datasets import here, else why not."""
    try:
        import datasets  # noqa: F401
        import llmcompressor  # noqa: F401
    except ImportError as e:
        return f"llmcompressor not importable in this environment ({e})"
    return None


def stage_llmc(args, w: Path) -> dict:
    why = llmc_available()
    if why:
        return {"skipped": why}
    out = {}
    for observer in args.llmc_observers.split(","):
        dest = w / f"llmc-{observer}"
        shutil.rmtree(dest, ignore_errors=True)
        check_room(w, sum(f.stat().st_size for f in (w / "model").iterdir()) / 2**30,
                   f"llm-compressor's save_compressed ({observer})")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--llmc-child", str(w / "model"), str(w / "calib.jsonl"),
               str(dest), str(args.samples), str(args.seq_len), str(args.batch_size), observer]
        r = timed_subprocess(cmd, w / f"llmc-{observer}.log")
        r.update(json.loads((w / f"llmc-{observer}.json").read_text()), out=str(dest))
        out[observer] = r
        print(f"llm-compressor {observer}: {r['seconds']:.1f} s", flush=True)
    return out


def llmc_child(model: str, data: str, dest: str, samples: str, seq_len: str, batch_size: str, observer: str) -> None:
    """llm-compressor's own end-to-end flow: the checkpoint by path, the records as a Dataset, save_compressed."""
    t0 = time.perf_counter()
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    import run as bench

    t_import = time.perf_counter()
    seqs = read_ids(Path(data))[:int(samples)]
    ds = Dataset.from_dict({"input_ids": seqs, "attention_mask": [[1] * len(s) for s in seqs]})
    t_data = time.perf_counter()
    scheme = bench.llmc_scheme(None if observer == "default" else observer, "tensor")
    oneshot(model=model, dataset=ds, recipe=QuantizationModifier(kv_cache_scheme=scheme),
            num_calibration_samples=len(seqs), max_seq_length=int(seq_len), batch_size=int(batch_size),
            output_dir=dest, save_compressed=True)
    t_end = time.perf_counter()
    Path(f"{dest}.json").write_text(json.dumps({
        "import_seconds": t_import - t0, "data_seconds": t_data - t_import, "oneshot_and_save_seconds": t_end - t_data,
        "tokens": sum(map(len, seqs))}))


def stage_eval(args, w: Path, scales: list[Path]) -> dict:
    """`kvcalib eval` with the calibrated checkpoints as arms, and one plain forward over the same tokens."""
    import torch

    from transformers import AutoModelForCausalLM

    import run as bench
    from calib import pipeline

    out = w / "eval"
    cmd = [sys.executable, "-m", "calib.cli", "eval", "--model", str(w / "model"), "--data", str(w / "eval.jsonl"),
           "--buckets", str(args.eval_seq_len), "--samples", str(args.eval_samples), "--batch-size", str(args.batch_size),
           "--passkey-trials", "0", "--max-skip", "0", "--no-plots", "--no-progress", "--out", str(out), "--force"]
    for s in scales:
        cmd += ["--scales", str(s)]
    r = timed_subprocess(cmd, w / "eval.log")
    report = json.loads((out / "report.json").read_text())
    used = report["data"]
    arms = {name.replace(f"{w}/", ""): entry["seconds"]["metrics"] for name, entry in report["arms"].items()}

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # what eval runs the reference in
    lm = AutoModelForCausalLM.from_pretrained(w / "model", dtype=dtype).to(device).eval()
    seqs = read_ids(w / "eval.jsonl")[:args.eval_samples]

    def forward() -> None:
        with torch.inference_mode():
            for ids, mask in pipeline.batches(seqs, args.batch_size):
                lm(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)

    forward()                                            # warm-up, as in bench/run.py
    plain = bench.timed(forward, device, args.repeat)
    tokens = sum(map(len, seqs))
    if used.get("tokens") != tokens:
        raise SystemExit(f"kvcalib eval measured {used.get('tokens')} tokens, the plain forward {tokens}: "
                         f"not the same job; see {out / 'report.json'}")
    r.update(tokens=tokens, eval_tokens=used.get("tokens"), eval_samples=used.get("samples"),
             plain_forward=plain, arms={n: {"seconds": s, "ratio_to_forward": s / plain["seconds"]}
                                        for n, s in arms.items()},
             ratio_to_forward=r["seconds"] / plain["seconds"])
    return r


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--llmc-child":
        llmc_child(*sys.argv[2:])
        return
    import run as bench

    ap = argparse.ArgumentParser(description="kvcalib vs llm-compressor end to end, and eval vs a forward")
    ap.add_argument("--shape", choices=sorted(bench.SHAPES), default="tiny")
    ap.add_argument("--workdir", type=Path, required=True, help="checkpoint, data and outputs (reused by --stages)")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--eval-seq-len", type=int, help="default: --seq-len")
    ap.add_argument("--llmc-observers", default=",".join(LLMC_OBSERVERS),
                    help="llm-compressor runs, one checkpoint each (default: its own default observer, static_minmax)")
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma list of {', '.join(STAGES)}")
    ap.add_argument("--repeat", type=int, default=1, help="timed repetitions of the plain forward (best is kept)")
    ap.add_argument("--json", type=Path, help="results (merged into an existing file of an earlier --stages call)")
    args = ap.parse_args()
    args.eval_seq_len = args.eval_seq_len or args.seq_len
    stages = [s for s in args.stages.split(",") if s]
    if bad := [s for s in stages if s not in STAGES]:
        ap.error(f"--stages: unknown {bad}; choose from {', '.join(STAGES)}")
    w = args.workdir
    w.mkdir(parents=True, exist_ok=True)
    doc = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {}

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(doc, indent=2))

    import torch

    doc.setdefault("env", {}).update(
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        torch=torch.__version__, shape=args.shape, samples=args.samples, seq_len=args.seq_len,
        batch_size=args.batch_size, eval_samples=args.eval_samples, eval_seq_len=args.eval_seq_len)
    if "save" in stages:
        doc["save"] = stage_save(args, w)
        print(f"save: {doc['save']}", flush=True)
        save()
    if not (w / "model" / "config.json").is_file():
        raise SystemExit(f"{w / 'model'} holds no checkpoint: run the save stage first")
    if "kvcalib" in stages:
        doc["kvcalib calibrate"] = stage_kvcalib(args, w)
        print(f"kvcalib calibrate: {doc['kvcalib calibrate']['seconds']:.1f} s", flush=True)
        save()
    if "llmc" in stages:
        r = stage_llmc(args, w)
        prev = doc.get("llm-compressor oneshot", {})
        doc["llm-compressor oneshot"] = r if "skipped" in r or "skipped" in prev else {**prev, **r}
        save()
    if "eval" in stages:
        scales = [p for p in [w / "kvcalib-out", *(w / f"llmc-{o}" for o in LLMC_OBSERVERS)] if p.is_dir()]
        doc["kvcalib eval"] = stage_eval(args, w, scales)
        save()
    print_table(doc)
    save()


def print_table(doc: dict) -> None:
    print(" ".join(f"{k}={v}" for k, v in doc.get("env", {}).items()))
    kv = doc.get("kvcalib calibrate")
    tokens = doc["env"]["samples"] * doc["env"]["seq_len"]
    rows = []
    if kv:
        rows.append(("kvcalib calibrate (load + data + pass + export)", kv["seconds"]))
    llmc = doc.get("llm-compressor oneshot", {})
    if "skipped" in llmc:
        print(f"llm-compressor: skipped: {llmc['skipped']}")
    for obs, r in llmc.items() if "skipped" not in llmc else ():
        rows.append((f"llm-compressor oneshot {obs} (load + data + oneshot + save)", r["seconds"]))
    if rows:
        print(f"{'end to end, ' + str(tokens) + ' calibration tokens':<68} {'seconds':>9} {'tokens/s':>10} {'x kvcalib':>9}")
        base = kv["seconds"] if kv else None
        for name, s in rows:
            ratio = f"{s / base:>9.2f}" if base else f"{'':>9}"
            print(f"{name:<68} {s:>9.2f} {tokens / s:>10,.0f} {ratio}")
    ev = doc.get("kvcalib eval")
    if ev:
        p = ev["plain_forward"]["seconds"]
        print(f"{'eval, ' + str(ev['tokens']) + ' tokens':<68} {'seconds':>9} {'x forward':>10}")
        print(f"{'plain causal-LM forward':<68} {p:>9.3f} {1.0:>10.2f}")
        for name, a in ev["arms"].items():
            print(f"{'eval arm ' + name:<68} {a['seconds']:>9.3f} {a['ratio_to_forward']:>10.2f}")
        print(f"{'kvcalib eval, whole command':<68} {ev['seconds']:>9.3f} {ev['ratio_to_forward']:>10.2f}")


if __name__ == "__main__":
    main()
