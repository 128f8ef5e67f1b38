"""calib.model.load: what `load` hands the pipeline is the saved model itself (the in-memory model's numbers, bit for
bit), the base model without its head unless the head is asked for, in the dtype asked for; the rotary channels
it reports are those transformers' own rotary embedding rotates. (Refusals are the bad-input table's.)"""

from __future__ import annotations

import pytest
import torch

from calib.model import load as model_mod
from tiny import random_sequences, tiny_causal_lm


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three padded sequences of different lengths and their attention mask."""
    seqs = random_sequences(3, lo=10, hi=20, seed=1)
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "phi3"])
def test_a_saved_model_loads_to_the_same_numbers(tmp_path, arch):
    """From its folder: the causal LM gives the in-memory model's logits, the base model (what calibration runs)
    its last hidden states, both bit for bit; the base model holds exactly the LM's body weights, no head."""
    ref = tiny_causal_lm(arch)
    src = tmp_path / arch
    ref.save_pretrained(src)
    ids, mask = _batch()
    lm = model_mod.load(src, device="cpu", lm_head=True)
    base = model_mod.load(src, device="cpu")
    with torch.inference_mode():
        assert torch.equal(lm.model(input_ids=ids, attention_mask=mask).logits,
                           ref(input_ids=ids, attention_mask=mask).logits)
        assert torch.equal(base.model(input_ids=ids, attention_mask=mask).last_hidden_state,
                           ref.model(input_ids=ids, attention_mask=mask).last_hidden_state)
    body, want = base.model.state_dict(), ref.model.state_dict()
    assert body.keys() == want.keys() and all(torch.equal(body[k], want[k]) for k in want)
    assert not any(k.startswith("lm_head") for k in body) and "lm_head.weight" in lm.model.state_dict()
    n = ref.config.num_hidden_layers
    assert base.attention_layers == lm.attention_layers == list(range(n)) and base.config.num_hidden_layers == n
    assert base.device == torch.device("cpu") and base.source_dir == src and base.tokenizer is None


def test_cpu_dtype_converts_exactly(tmp_path):
    """A bf16 checkpoint runs in float32 on CPU by default: every weight widened exactly; `cpu_dtype=None` keeps
    the checkpoint's bf16 bit for bit; a float32 checkpoint with `cpu_dtype="bfloat16"` holds each weight
    rounded to bf16 as torch rounds it."""
    bf16 = tiny_causal_lm("llama").to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "bf16")
    f32 = tiny_causal_lm("llama", seed=3)
    f32.save_pretrained(tmp_path / "f32")
    cases = [(tmp_path / "bf16", "float32", bf16, torch.float32), (tmp_path / "bf16", None, bf16, torch.bfloat16),
             (tmp_path / "f32", "bfloat16", f32, torch.bfloat16), (tmp_path / "f32", None, f32, torch.float32)]
    for src, cpu_dtype, ref, dtype in cases:
        loaded = model_mod.load(src, placement=model_mod.Placement(device="cpu", cpu_dtype=cpu_dtype))
        assert loaded.dtype == dtype, (src.name, cpu_dtype)
        got = loaded.model.state_dict()
        for name, t in ref.model.state_dict().items():
            assert got[name].dtype == dtype and torch.equal(got[name], t.to(dtype)), (src.name, cpu_dtype, name)


def test_the_tokenizer_comes_from_the_folder(tmp_path, tok):
    """Tokenizer files beside the weights are loaded with them and encode as the tokenizer that wrote them."""
    src = tmp_path / "with-tok"
    tiny_causal_lm("llama").save_pretrained(src)
    tok.save_pretrained(src)
    loaded = model_mod.load(src, device="cpu").tokenizer
    text = "the cat sat on the mat far away"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"] and loaded(text)["input_ids"][0] == tok.bos_token_id


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {}), ("phi3", {"partial_rotary_factor": 0.5}),
                                             ("phi3", {"partial_rotary_factor": 0.75})])
def test_rotary_dim_is_what_the_rotary_embedding_rotates(arch, overrides):
    """Twice the length of the model's own inverse frequencies: the whole head, or its partial share."""
    model = tiny_causal_lm(arch, **overrides)
    rotated = 2 * model.model.rotary_emb.inv_freq.numel()
    assert model_mod.rotary_dim(model.config) == rotated
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    assert (rotated < head_dim) == bool(overrides)
