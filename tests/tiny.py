"""Tiny models built from configs of real architectures (no hub access needed), shared by the tests."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


# Tiny configs of real architectures, each with a feature that changes where K lives.
ARCHS = {
    "llama": dict(cls="LlamaConfig"),
    "qwen2": dict(cls="Qwen2Config"),                                  # k/v bias
    "qwen3": dict(cls="Qwen3Config"),                                  # k-norm before RoPE
    "mistral": dict(cls="MistralConfig", sliding_window=8),
    "gemma2": dict(cls="Gemma2Config", sliding_window=8, query_pre_attn_scalar=32),
    "gemma3": dict(cls="Gemma3TextConfig", sliding_window=8, query_pre_attn_scalar=32),  # k-norm, local/global RoPE
    "phi3": dict(cls="Phi3Config", pad_token_id=0),                    # fused qkv_proj
}


def tiny_config(arch: str = "llama", **overrides):
    import transformers

    spec = dict(ARCHS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    kw = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    if arch == "phi3":
        kw.pop("head_dim")
    kw.update(spec)
    kw.update(overrides)
    return cls(**kw)


def tiny_causal_lm(arch: str = "llama", seed: int = 0, scale_k: float | None = None, **overrides):
    """A float32 causal LM with random weights; `scale_k` multiplies k_proj so |K| reaches a chosen range."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32).eval()
    if scale_k is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_proj.weight.mul_(scale_k)
    return model


def random_sequences(n: int, vocab: int = 257, lo: int = 8, hi: int = 40, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


def fp8_weight_checkpoint(src, dst):
    """A compressed-tensors FP8 (channel weights, dynamic token activations) checkpoint of `src`, as
    llm-compressor lays it out: fp8 `weight` + float32 `weight_scale` per output channel."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    src = Path(src)
    dst.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and ".layers." in name:
            scale = t.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448
            out[name] = (t / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            out[name.replace(".weight", ".weight_scale")] = scale.to(torch.float32)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                  "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def modelopt_checkpoint(src, dst, *, hf_quant_config: bool = True):
    """`src` as NVIDIA ModelOpt's Hugging Face export lays out an FP8 checkpoint: config.json gains the flat
    `quantization_config` (`quant_method: modelopt`, config_groups, `ignore`, quant_algo, producer), the shape
    `convert_hf_quant_config_format` writes (modelopt/torch/export/convert_hf_config.py), and
    hf_quant_config.json keeps the legacy `{"producer", "quantization"}` shape beside it. The weight bytes are
    `src`'s (the configs are what kvcalib reads of them)."""
    import json
    import shutil

    dst, src = Path(dst), Path(src)
    shutil.copytree(src, dst)
    producer = {"name": "modelopt", "version": "0.37.0"}
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                      "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                      "targets": ["Linear"]}},
        "ignore": ["lm_head"], "quant_algo": "FP8", "producer": producer, "quant_method": "modelopt"}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    if hf_quant_config:
        (dst / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": {
            "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}, indent=4))
    return dst



# --------------------------------------------------------------------------------- a tiny GGUF file

GGUF_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")     # unk, bos, eos (= pad), as SmolLM2
GGUF_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _rope_rows_interleaved(rows, heads: int):
    """llama.cpp's row order for a Q or K projection: within each head, the two halves RoPE rotates
    together in Hugging Face's layout become adjacent pairs."""
    n = rows.shape[0]
    return rows.reshape(heads, 2, n // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def tiny_gguf(path, texts, *, seed: int = 0):
    """Write a tiny Llama to `path` as llama.cpp lays out a GGUF (byte-level BPE vocabulary with control
    tokens and a chat template, Q4_1 projections and a Q8_0 embedding, Q/K rows in llama.cpp's RoPE order,
    tied output) and return `(tokenizer, model)`: the `tokenizers.Tokenizer` and the float32 Hugging Face
    model the file encodes (weights already rounded through the file's quantisation)."""
    import gguf
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=list(GGUF_SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]

    heads, kv_heads = 4, 2
    model = tiny_causal_lm("llama", seed=seed, vocab_size=len(tokens), num_hidden_layers=2, head_dim=16,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                           max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                           rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    cfg = model.config
    Q = gguf.GGMLQuantizationType
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in GGUF_SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_unk_token_id(vocab[GGUF_SPECIAL[0]])
    w.add_bos_token_id(vocab[GGUF_SPECIAL[1]])
    w.add_eos_token_id(vocab[GGUF_SPECIAL[2]])
    w.add_pad_token_id(vocab[GGUF_SPECIAL[2]])
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(GGUF_CHAT_TEMPLATE)

    def put(name: str, param, qtype=None, rope_heads: int | None = None) -> None:
        data = param.detach().float().numpy()
        if qtype is not None:
            data = gguf.quants.quantize(data, qtype)                  # rows of whole blocks
            with torch.no_grad():                                    # the reference holds what the file holds
                param.copy_(torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)))
        if rope_heads:
            data = _rope_rows_interleaved(data, rope_heads)
        w.add_tensor(name, data, raw_dtype=qtype)

    put("token_embd.weight", model.model.embed_tokens.weight, Q.Q8_0)
    for i, layer in enumerate(model.model.layers):
        for hf, short in names.items():
            module = layer.get_submodule(hf)
            qtype = Q.Q4_1 if hf.endswith("proj") else None
            rope = heads if hf.endswith("q_proj") else kv_heads if hf.endswith("k_proj") else None
            put(f"blk.{i}.{short}.weight", module.weight, qtype, rope)
    put("output_norm.weight", model.model.norm.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tok, model


# ------------------------------------------------------------------ a tiny Llama trained on sample text
# Random weights give near-Gaussian K/V with no structure; a short training run on real text already shows
# what real models do (outlier key channels, layers whose ranges differ, a BOS attention sink). Built once
# (about a minute on two CPU cores), cached in build_dir keyed by the data bytes and every hyperparameter,
# written to a temporary sibling and renamed. head_dim 64 and 2 KV heads for 4 query heads, as vLLM's CPU
# FP8 cache needs. Training is capped by steps, not time, so the same inputs give the same model.

TRAINED_BUILD_VERSION = 1
TRAINED_DIR = "tiny-trained"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

BPE = {"vocab_size": 4096, "min_frequency": 2}
SHAPE = {
    "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
# Small batches win at this budget: 400 steps of 2x256 tokens (~200k tokens, ~5 passes over the data)
# reach a far lower loss than 100 steps of 8x256 for the same compute, about a minute on two CPU cores.
TRAIN = {
    "seed": 0, "seq_len": 256, "batch_size": 2, "steps": 400, "warmup_steps": 40, "lr": 2.5e-3,
    "min_lr_ratio": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.95), "grad_clip": 1.0, "log_every": 50,
}
# Role-tagged turns, each closed by EOS; BOS comes from the template, not from the tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

Log = Callable[[str], Any]


def trained_tiny_model(build_dir: Path, data_file: Path, *, log: Log = print) -> Path:
    """Return `build_dir/tiny-trained`, building it first unless a complete build of the same inputs exists."""
    build_dir, data_file = Path(build_dir), Path(data_file)
    target = build_dir / TRAINED_DIR
    key = _build_key(data_file)
    if _cached_key(target) == key:
        return target
    log(f"tiny model: building into {target} (one time; trains a small Llama on {data_file.name})")
    build_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TRAINED_DIR}-", dir=build_dir))
    tmp.chmod(0o755)
    try:
        info = _build(tmp, _read_texts(data_file), log)
        (tmp / "build_info.json").write_text(json.dumps({"key": key, **info}, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_key(data_file: Path) -> str:
    params = {"version": TRAINED_BUILD_VERSION, "tokenizer": BPE, "model": SHAPE, "train": TRAIN,
              "chat_template": CHAT_TEMPLATE}
    digest = hashlib.sha256(data_file.read_bytes())
    digest.update(json.dumps(params, sort_keys=True).encode())
    return digest.hexdigest()


def _cached_key(target: Path) -> str | None:
    if not all((target / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        return None
    try:
        return json.loads((target / "build_info.json").read_text()).get("key")
    except (OSError, ValueError):
        return None


def _read_texts(data_file: Path) -> list[str]:
    texts = [json.loads(line)["text"] for line in data_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{data_file}: no text records to train the tiny model on")
    return texts


def _build(out: Path, texts: list[str], log: Log) -> dict[str, Any]:
    tokenizer = _train_tokenizer(texts)
    tokenizer.save_pretrained(out)
    return _train_model(out, texts, tokenizer, log)


def _train_tokenizer(texts: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE["vocab_size"], min_frequency=BPE["min_frequency"],
                                  special_tokens=[BOS, EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   chat_template=CHAT_TEMPLATE, model_max_length=SHAPE["max_position_embeddings"])


def _train_model(out: Path, texts: list[str], tokenizer: Any, log: Log) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    cfg = TRAIN
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    shape = {k: v for k, v in SHAPE.items() if k != "rope_theta"}
    config = LlamaConfig(**shape, vocab_size=len(tokenizer), rope_parameters={
        "rope_type": "default", "rope_theta": SHAPE["rope_theta"]},
        bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[2])

    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n_chunks = len(stream) // cfg["seq_len"]
    chunks = torch.tensor(stream[: n_chunks * cfg["seq_len"]]).view(n_chunks, cfg["seq_len"])

    torch.manual_seed(cfg["seed"])
    model = LlamaForCausalLM(config).float().train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optim = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                               {"params": no_decay, "weight_decay": 0.0}], lr=cfg["lr"], betas=cfg["betas"])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_factor)
    gen = torch.Generator().manual_seed(cfg["seed"])
    log(f"tiny model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
        f"{len(stream)} training tokens, {cfg['steps']} steps of {cfg['batch_size']}x{cfg['seq_len']}")

    losses: list[float] = []
    start = time.perf_counter()
    for step in range(1, cfg["steps"] + 1):
        batch = chunks[torch.randint(n_chunks, (cfg["batch_size"],), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optim.step()
        sched.step()
        losses.append(loss.item())
        if step == 1 or step % cfg["log_every"] == 0 or step == cfg["steps"]:
            log(f"tiny model: step {step}/{cfg['steps']} loss {losses[-1]:.3f}")
    seconds = time.perf_counter() - start
    log(f"tiny model: trained in {seconds:.0f}s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")

    model.config.dtype = torch.bfloat16
    model.generation_config = GenerationConfig(bos_token_id=ids[0], eos_token_id=ids[1], pad_token_id=ids[2])
    model.to(torch.bfloat16).eval().save_pretrained(out, safe_serialization=True)
    return {"steps": cfg["steps"], "first_loss": losses[0], "final_loss": losses[-1],
            "train_seconds": round(seconds, 1), "train_tokens": len(stream)}


def _lr_factor(step: int) -> float:
    """Linear warmup, then cosine decay to `min_lr_ratio` of the peak learning rate."""
    warmup, total, floor = TRAIN["warmup_steps"], TRAIN["steps"], TRAIN["min_lr_ratio"]
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


if __name__ == "__main__":  # make engine-test: python tests/tiny.py fp8-weights SRC DST
    import sys

    if sys.argv[1:2] == ["fp8-weights"]:
        fp8_weight_checkpoint(sys.argv[2], sys.argv[3])
