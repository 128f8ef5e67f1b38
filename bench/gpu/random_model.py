"""Write a random-weight checkpoint of a real architecture's shape, with a working tokenizer, for engine runs.

Why: the long-context questions (time, memory, KV capacity, TTFT/TPOT at 32K-128K) depend on the model's
shape, not its values, and no 8B checkpoint can travel to the GPU machine. kvcalib and vLLM both need real
files (vLLM's `load_format="dummy"` would leave kvcalib's own transformers side without weights), so this
writes bf16 safetensors built on the GPU and borrows the tokenizer of a model already there (the default
model's), with the vocabulary sized to it.

    python bench/gpu/random_model.py --shape llama-3.1-8b --tokenizer DIR --out DIR
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

SHAPES = {
    "llama-3.1-8b": ("llama", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # a Gemma-3-270M-like hybrid: 15 sliding-window layers (window 512) and 3 global; 1 KV head, 4 query heads
    "gemma3-270m-hybrid": ("gemma3_text", dict(
        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, max_position_embeddings=32768, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        rope_theta=1000000.0, rms_norm_eps=1e-6, query_pre_attn_scalar=256)),
    # a Gemma-3-4B-like hybrid: 5 sliding-window layers (window 1024) per global layer
    "gemma3-4b-hybrid": ("gemma3_text", dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, max_position_embeddings=131072, sliding_window=1024,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(34)],
        rope_theta=1000000.0, rms_norm_eps=1e-6, query_pre_attn_scalar=256)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")


def main() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--tokenizer", required=True, help="a model folder whose tokenizer the checkpoint uses")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t0 = time.perf_counter()
    packed = Path(args.tokenizer) / "tokenizer.json.gz"        # a tokenizer carried compressed
    if packed.exists() and not (Path(args.tokenizer) / "tokenizer.json").exists():
        import gzip

        (Path(args.tokenizer) / "tokenizer.json").write_bytes(gzip.decompress(packed.read_bytes()))
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    kind, spec = SHAPES[args.shape]
    config = AutoConfig.for_model(kind, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **spec)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer) / name).exists():
            shutil.copy(Path(args.tokenizer) / name, out / name)
    tc = out / "tokenizer_config.json"      # the borrowed tokenizer's length limit is the donor's: use the shape's
    if tc.exists():
        import json

        doc = json.loads(tc.read_text())
        doc["model_max_length"] = int(spec["max_position_embeddings"])
        tc.write_text(json.dumps(doc, indent=1))
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.shape}: {params / 1e9:.2f} B parameters written to {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
