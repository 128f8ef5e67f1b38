"""Serve a model once per KV configuration with `vllm serve`, sweep the load with `vllm bench serve`, decide.

The serving half of `kvcalib validate` (calib/load) without the quality half, for shapes whose quality means
nothing (random weights) but whose speed and memory are the real model's: every kernel does the same work
whatever the values. Prompts are the project's sample text, cut to `--length` tokens (natural text re-tokenizes
to the same length; random token ids do not), each with its own opening line so no two share a prefix.
Every arm counts as within the quality bar here (random weights: quality is `kvcalib eval`'s job), so the
decision is the speed half of validate's rule.

    python bench/gpu/serve_sweep.py --model DIR --python PY --length 32000 --kv-gib 4 \\
        --arm bf16=auto --arm fp8=fp8 --arm fp8-skip=fp8:sliding_window --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from calib.load import decide, server, sweep  # noqa: E402
from calib.load.spec import LoadSpec  # noqa: E402

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample_text.jsonl"


def prompts(tokenizer_dir: str, length: int, n: int) -> sweep.Bucket:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = " ".join(json.loads(x)["text"] for x in SAMPLE.read_text().splitlines() if x.strip())
    ids = tok(text, add_special_tokens=False)["input_ids"]
    while len(ids) < length:
        ids = ids + ids
    out, counts = [], []
    for i in range(n):
        head = f"Document {i}: notes from shard {i * 7919 % 1000}.\n"
        body = tok.decode(ids[i * 997 % 5000:][: length - 32], skip_special_tokens=True)
        p = head + body
        out.append(p)
        counts.append(len(tok(p)["input_ids"]))
    return sweep.Bucket(length, tuple(out), tuple(counts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--python", required=True, help="the python that imports vllm (a venv's bin/python)")
    ap.add_argument("--length", type=int, required=True, help="prompt tokens")
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--kv-gib", type=int, default=4)
    ap.add_argument("--arm", action="append", required=True, help="NAME=KV_DTYPE[:SKIP,SKIP]")
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--levels", default="", help="explicit levels, comma-separated")
    ap.add_argument("--sweep-minutes", type=float)
    ap.add_argument("--slo-ttft-ms", type=float, default=LoadSpec.slo_ttft_ms)
    ap.add_argument("--slo-tpot-ms", type=float, default=LoadSpec.slo_tpot_ms)
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", action="store_true",
                    help="keep the arms already measured in --out (a run cut by a time limit goes on from there)")
    args = ap.parse_args()
    spec = LoadSpec(args.output_tokens, tuple(int(x) for x in args.levels.split(",") if x), args.max_concurrency,
                    slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                    budget_s=None if args.sweep_minutes is None else 60 * args.sweep_minutes)
    assert not spec.problems(), spec.problems()
    venv = Path(args.python).absolute().parent.parent
    if not (venv / "pyvenv.cfg").exists():          # a system python (vLLM on PYTHONPATH): a folder that names it
        venv = Path(tempfile.mkdtemp(prefix="kvcalib-venv-"))
        (venv / "bin").mkdir()
        (venv / "bin" / "python").symlink_to(args.python)
    bucket = prompts(args.model, args.length, 16)
    base = server.Launch(0, args.kv_gib, "auto", on_cpu=args.cpu, timeout=900)
    results, arms = {}, []
    earlier = json.loads(Path(args.out).read_text())["arms"] if args.resume and Path(args.out).exists() else {}
    earlier = {k: v for k, v in earlier.items() if not any(b.get("error") for b in v["buckets"].values())}  # retried
    t0 = time.time()
    for j, text in enumerate(args.arm):
        name, _, kv = text.partition("=")
        dtype, _, skips = kv.partition(":")
        cfg = server.ServeConfig(args.model, dtype, tuple(int(s) if s.isdigit() else s for s in skips.split(",") if s))
        if name in earlier:
            res = earlier[name]
            print(f"{name}: kept from {args.out}", flush=True)
        else:
            with tempfile.TemporaryDirectory() as work:
                res = sweep.sweep_config(venv, cfg, [bucket], spec, base, None, Path(work), args.model, print)
        results[name] = res
        e = res["buckets"][str(args.length)]
        arms.append(decide.Arm(name, True, 0.0, (e.get("capacity") or {}).get("requests_fit"),
                               (e.get("best") or {}).get("goodput"), e.get("noise") or 0.0, reference=j == 0,
                               why_not=e.get("error")))
        print(f"{name}: {json.dumps({k: e.get(k) for k in ('capacity', 'best', 'noise', 'error')})}", flush=True)
        Path(args.out).write_text(json.dumps({"partial": True, "arms": results}, indent=1))   # kept if cut short
    d = decide.decide(arms, spec.noise)
    doc = {"model": args.model, "length": args.length, "output_tokens": args.output_tokens, "kv_gib": args.kv_gib,
           "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms}, "seconds": time.time() - t0,
           "decision": d.to_dict(), "arms": results}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"decision: {d.recommended}: {d.why}")
    for name, res in results.items():
        e = res["buckets"][str(args.length)]
        for r in e["levels"]:
            if r["status"] == "ok":
                s = r["server"]
                print(f"{name:10s} c={r['level']:3d} req/s {r['request_throughput']:.3g} goodput {r['goodput']:.3g} "
                      f"out tok/s {r['output_throughput']:.4g} TTFT p50 {1000 * r['ttft_s']['p50']:.0f} ms "
                      f"TPOT p50 {1000 * (r['tpot_s']['p50'] or 0):.1f} ms running {s['max_running']} waiting "
                      f"{s['max_waiting']} kv {s['max_kv_usage']} preempt {s['preemptions']}")
            else:
                print(f"{name:10s} c={r['level']:3d} FAILED {r['error']}")


if __name__ == "__main__":
    main()
