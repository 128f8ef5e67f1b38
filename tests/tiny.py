"""Tiny models built from configs of real architectures (no hub access needed), shared by the tests."""

from __future__ import annotations

from pathlib import Path


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


if __name__ == "__main__":  # make engine-test: python tests/tiny.py fp8-weights SRC DST
    import sys

    if sys.argv[1:2] == ["fp8-weights"]:
        fp8_weight_checkpoint(sys.argv[2], sys.argv[3])
