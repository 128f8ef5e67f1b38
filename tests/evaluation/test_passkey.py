"""Passkey generator and scorer: the key sits at the asked depth, prompts land in their bucket, scoring is exact."""

from __future__ import annotations

import os

import pytest
import torch

from calib.evaluation import passkey
from tiny import tiny_causal_lm
from helpers import train_tokenizer

@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.mark.parametrize("depth", passkey.DEPTHS)
def test_key_sits_at_the_requested_depth(tokenizer, depth):
    p = passkey.build(tokenizer, 400, depth, "40718", bucket=512)
    text = tokenizer.decode(p.ids, skip_special_tokens=True)
    needle = passkey.NEEDLE.format(key="40718")
    assert text.count(needle) == 1 and text.count("40718") == 1
    before, after = text.split(needle)
    assert before.startswith(passkey.INTRO) and after.endswith(passkey.QUESTION)
    lines_before = before.count(passkey.FILLER)
    assert lines_before == round(depth * p.filler_lines)
    assert lines_before + after.count(passkey.FILLER) == p.filler_lines
    # in tokens: the needle starts where its depth puts it within the filler span
    intro = len(tokenizer(passkey.INTRO)["input_ids"])
    filler_tokens = len(p.ids) - intro - len(tokenizer(needle + passkey.QUESTION)["input_ids"])
    assert abs((p.needle_token - intro) / filler_tokens - depth) < 0.03
    assert tuple(tokenizer(text)["input_ids"]) == p.ids


def test_prompt_is_the_longest_that_fits(tokenizer):
    per_line = len(tokenizer(passkey.FILLER * 10)["input_ids"]) / 10
    for target in (130, 250, 400):
        p = passkey.build(tokenizer, target, 0.5, "55555", bucket=target)
        assert target - 2 * per_line < len(p.ids) <= target
    assert passkey.build(tokenizer, 20, 0.5, "55555", bucket=32) is None     # not even the question fits
    with pytest.raises(ValueError, match="depth"):
        passkey.build(tokenizer, 200, 1.5, "55555", bucket=256)


def test_prompts_land_in_their_bucket_and_are_deterministic(tokenizer):
    buckets = (40, 160, 256)
    ps, notes = passkey.prompts(tokenizer, buckets, trials=2, seed=3)
    assert len(notes) == 1 and "bucket 40" in notes[0]          # too small for intro + needle + question
    assert {p.bucket for p in ps} == {160, 256}
    for p in ps:
        lower = max(b for b in (0, *buckets) if b < p.bucket)
        assert lower < len(p.ids) <= p.bucket - passkey.MAX_NEW_TOKENS
        assert len(p.key) == 5 and p.key.isdigit()
    assert sorted({p.depth for p in ps}) == sorted(passkey.DEPTHS)
    assert len(ps) == 2 * len(passkey.DEPTHS) * 2
    again, _ = passkey.prompts(tokenizer, buckets, trials=2, seed=3)
    assert again == ps
    other, _ = passkey.prompts(tokenizer, buckets, trials=2, seed=4)
    assert [p.key for p in other] != [p.key for p in ps]


@pytest.mark.parametrize("text,ok", [
    (" 40718. Remember it.", True), ("40718", True), (" 40718 is the key", True),
    (" 407180", False), (" 4071", False), (" 12345 40718", False), (" the key", False), ("40 718", False),
])
def test_scoring_is_exact_match_of_the_first_number(text, ok):
    assert passkey.correct(text, "40718") is ok


def test_answer_extraction():
    assert passkey.answer("no digits here") is None
    assert passkey.answer(" 0042x") == "0042"


def test_summary_counts_per_bucket_and_depth():
    o = [passkey.Outcome(128, 0.0, "11111", "11111", True), passkey.Outcome(128, 0.5, "22222", "2", False),
         passkey.Outcome(256, 0.5, "33333", "33333", True)]
    s = passkey.summarize(o)
    assert s["128"] == {"correct": 1, "total": 2, "accuracy": 0.5,
                        "by_depth": {"0": {"correct": 1, "total": 1}, "0.5": {"correct": 0, "total": 1}},
                        "outcomes": [{"depth": 0.0, "correct": True}, {"depth": 0.5, "correct": False}]}
    assert s["256"]["accuracy"] == 1.0


def test_greedy_with_cache_equals_recomputing_every_step():
    model = tiny_causal_lm("llama")
    prompt = list(range(3, 40))
    got = passkey.greedy(model, prompt, max_new_tokens=6)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert got == ids[len(prompt):]
    assert passkey.greedy(model, prompt, max_new_tokens=6, eos_id=got[0]) == got[:1]


def _unequal_prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 200, (n,), generator=g).tolist() for n in (37, 40, 33, 40, 21)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"])
def test_prompts_decoded_together_give_what_each_gives_alone(arch):
    """Left padding, masks and per-row positions: batched greedy decoding equals decoding each prompt alone, also
    where a sliding window (8 tokens in the tiny Gemma-3 / Mistral configs) is far shorter than the prompts, and
    with an end-of-sequence token that stops one row early."""
    model = tiny_causal_lm(arch)
    prompts = _unequal_prompts()
    alone = [passkey.greedy(model, p, max_new_tokens=6) for p in prompts]
    assert passkey.greedy_batch(model, prompts, max_new_tokens=6, pad_id=1) == alone
    eos = alone[2][1]
    alone_eos = [passkey.greedy(model, p, max_new_tokens=6, eos_id=eos) for p in prompts]
    assert passkey.greedy_batch(model, prompts, max_new_tokens=6, eos_id=eos) == alone_eos
    assert any(len(r) < 6 for r in alone_eos) and alone_eos != alone


def test_a_chunked_attention_model_decodes_unequal_prompts_one_at_a_time(monkeypatch):
    """Chunked-local attention cuts its chunks by cache index, so left padding would move every boundary: prompts
    of unequal length go one at a time there (equal lengths still together)."""
    model = tiny_causal_lm("llama")
    monkeypatch.setattr(model.config, "attention_chunk_size", 16, raising=False)
    prompts = _unequal_prompts()[:3]
    seen = []
    hook = model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[0]), with_kwargs=True)
    try:
        assert passkey.greedy_batch(model, prompts, max_new_tokens=2) == \
            [passkey.greedy_batch(model, [p], max_new_tokens=2)[0] for p in prompts]
        assert set(seen) == {1}
        seen.clear()
        passkey.greedy_batch(model, [prompts[0]] * 3, max_new_tokens=2)
        assert set(seen) == {3}
    finally:
        hook.remove()


@pytest.mark.parametrize("emulation,arm,kernel", [("vllm-fa3", "default", False), ("vllm-fa3", "default", True),
                                                  ("vllm-cpu", "default", False),
                                                  ("vllm-fa3", "fp8_per_token_head", False)])
def test_batched_decoding_under_an_emulated_fp8_cache_equals_each_prompt_alone(emulation, arm, kernel, monkeypatch):
    """The same under the fake-quant hook: FlashAttention-3's FP8 attention (Q and P rounded, left-padded rows
    masked), vLLM CPU's truncating cache write, a dynamic per-token-head cache. K is blown up so FP8 changes
    the continuations (checked: they differ from the unquantised ones). `kernel`: FA3's attention through the
    fused Triton kernel (Triton's interpreter on CPU tensors: the padding mask and one-query decode steps as a
    GPU runs them) instead of the float32 blockwise reference."""
    from calib.evaluation import fa3, fa3_kernel
    if kernel:
        if fa3_kernel.triton is None or os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs Triton's interpreter")
        monkeypatch.setattr(fa3_kernel, "KERNELS_ON_CPU", True)
        monkeypatch.setattr(fa3, "_failed", {})
        monkeypatch.setattr(fa3, "_reference", lambda *a: pytest.fail("the fused kernel fell back"))
    from calib.evaluation import emulate
    from calib.evaluation.arms import Geometry, default_arm, format_arms
    from calib.evaluation.fakequant import fake_quant_kv
    from calib.recipe.dtypes import FP8_E4M3

    model = tiny_causal_lm("llama", scale_k=400.0)
    geo = Geometry((0, 1, 2), 2, 16)
    a = default_arm(geo, FP8_E4M3) if arm == "default" else format_arms(geo, [arm])[0]
    prompts = _unequal_prompts(3)[:3] if kernel else _unequal_prompts(3)      # the interpreter is slow: fewer
    steps = 4 if kernel else passkey.MAX_NEW_TOKENS
    plain = [passkey.greedy(model, p, max_new_tokens=steps) for p in prompts]
    with fake_quant_kv(model, emulate.by_name(emulation)) as hook, hook.applying(a):
        alone = [passkey.greedy(model, p, max_new_tokens=steps) for p in prompts]
        together = passkey.greedy_batch(model, prompts, max_new_tokens=steps)
    assert together == alone
    assert alone != plain


def test_run_batches_consecutive_prompts_of_one_bucket_and_keeps_their_order(tokenizer, monkeypatch):
    """`run` decodes up to batch_size prompts of one bucket at a time; outcomes come back in prompt order and
    equal the one-at-a-time outcomes."""
    model = tiny_causal_lm("llama", vocab_size=len(tokenizer))
    items, _ = passkey.prompts(tokenizer, [160, 256], trials=2, seed=1, depths=(0.0, 0.5, 1.0))
    one = passkey.run(model, tokenizer, items)
    seen, calls = [], []
    real = passkey.greedy_batch

    def spy(m, prompts, *a, **k):
        calls.append([len(p) for p in prompts])
        return real(m, prompts, *a, **k)

    monkeypatch.setattr(passkey, "greedy_batch", spy)
    four = passkey.run(model, tokenizer, items, on_done=seen.append, batch_size=4)
    assert four == one and seen == list(items)
    assert [p.bucket for p in items] == [160] * 6 + [256] * 6
    assert [len(c) for c in calls] == [4, 2, 4, 2]
    assert len({n for c in calls for n in c}) > 2          # unequal lengths inside a batch: padding was exercised
