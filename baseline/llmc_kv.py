"""llm-compressor's KV-only FP8 calibration on exactly kvcalib's samples, for a head-to-head `kvcalib eval`.

Why a separate script in a separate venv (`make baseline-llmc`): llm-compressor 0.14 pins
transformers <= 5.17 and compressed-tensors 0.19, which kvcalib's own environment does not share. It
imports only `calib.data.sources` (pure Python) so both tools see the same token sequences; everything else here
is llm-compressor's own API. Each observer writes one checkpoint that `kvcalib eval --scales` reads.

    python baseline/llmc_kv.py --model M --data D --out-dir out/llmc [--samples 128 --seq-len 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from calib.data import sources as data_mod  # noqa: E402  (pure Python: no torch, no transformers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--observers", default="default,static_minmax",
                    help="comma list: default (llm-compressor's own choice) and/or observer names")
    args = ap.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir) if (model_dir / "tokenizer_config.json").is_file() else None
    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    report = data_mod.DataReport()
    seqs = list(data_mod.samples(args.data, tokenizer, seq_len=args.seq_len, max_samples=args.samples,
                                 min_tokens=args.min_tokens, pack=False, seed=args.seed, vocab_size=vocab,
                                 report=report))
    ds = Dataset.from_list([{"input_ids": s, "attention_mask": [1] * len(s)} for s in seqs])
    print(f"{report.used} samples, {report.tokens} tokens ({report.to_dict()['fingerprint']})", flush=True)
    for name in args.observers.split(","):
        scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
        if name != "default":
            scheme["observer"] = name
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
        t0 = time.perf_counter()
        oneshot(model=model, dataset=ds, recipe=QuantizationModifier(kv_cache_scheme=scheme),
                num_calibration_samples=len(seqs), max_seq_length=args.seq_len)
        seconds = time.perf_counter() - t0
        out = args.out_dir / f"llmc-{name}"
        model.save_pretrained(out, save_compressed=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        print(f"llm-compressor observer={name}: {seconds:.1f} s -> {out}", flush=True)
        del model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
