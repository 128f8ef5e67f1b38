"""K/V capture: right tensors for every architecture, all tokens counted, padding ignored, outputs untouched."""

from __future__ import annotations

import pytest
import torch

from calib.capture import hook as observe
from calib.scales.stats import Stats
from calib.model.load import find_attention_layers
from calib.pipeline import batches
from tiny import ARCHS, random_sequences, tiny_causal_lm
from helpers import reference_amax


def _captured(model, seqs, batch_size: int) -> Stats:
    base = model.model if hasattr(model, "model") else model
    with observe.capture_kv(base, find_attention_layers(base)) as cap, torch.inference_mode():
        for ids, mask in batches(seqs, batch_size):
            with cap.masking(mask.bool()):
                base(input_ids=ids, attention_mask=mask, use_cache=False)
    return cap.stats()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_capture_matches_projection_plus_rope_reference(arch):
    model = tiny_causal_lm(arch)
    seqs = random_sequences(6, seed=1)
    ref = reference_amax(model, seqs)
    stats = _captured(model, seqs, batch_size=3)
    assert sorted(stats) == list(range(model.config.num_hidden_layers)) == sorted(ref)
    for i, s in stats.items():
        assert s.k_amax.shape == (model.config.num_key_value_heads,)
        torch.testing.assert_close(s.k_amax, ref[i][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.v_amax, ref[i][1], rtol=1e-5, atol=1e-6)


def test_k_is_captured_after_rope_not_before():
    """Guard against the classic mistake (hooking k_proj): pre-RoPE and post-RoPE maxima differ here."""
    model = tiny_causal_lm("llama")
    seqs = random_sequences(4, seed=2)
    stats = _captured(model, seqs, batch_size=2)
    pre = []
    h = model.model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, o: pre.append(o.abs().max()))
    with torch.no_grad():
        for s in seqs:
            model(input_ids=torch.tensor([s]), use_cache=False)
    h.remove()
    assert not torch.isclose(stats[0].k_amax.max(), torch.stack(pre).max(), rtol=1e-4)


def test_statistics_cover_all_batches_and_ignore_padding():
    model = tiny_causal_lm("qwen2")
    seqs = random_sequences(7, lo=3, hi=30, seed=3)
    one_by_one = _captured(model, seqs, batch_size=1)     # no padding at all
    padded = _captured(model, seqs, batch_size=4)         # padded batches, last one partial
    for i in one_by_one:
        torch.testing.assert_close(padded[i].k_amax, one_by_one[i].k_amax, rtol=1e-6, atol=0)
        torch.testing.assert_close(padded[i].v_amax, one_by_one[i].v_amax, rtol=1e-6, atol=0)
    # the union equals the max over per-batch results: the last batch alone does not decide
    per_seq = [_captured(model, [s], 1) for s in seqs]
    for i in one_by_one:
        torch.testing.assert_close(torch.stack([p[i].k_amax for p in per_seq]).amax(0), one_by_one[i].k_amax)


def test_padding_values_never_reach_statistics():
    """Huge activations at padded positions would show up if the mask were ignored."""
    cap = observe.KVCapture([0])
    k = torch.ones(2, 2, 5, 4)
    k[1, :, 3:] = 1e6                      # positions that are padding in row 1
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    with cap.masking(mask) as masked:
        assert masked is cap and cap.token_mask is mask
        cap.record(0, k, k, k)
    assert cap.token_mask is None                   # cleared after: the next pass never inherits it
    assert cap.stats()[0].k_amax.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_logits_bit_identical_and_hook_removed(impl):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_causal_lm("gemma2" if impl == "eager" else "llama")
    model.set_attn_implementation(impl)
    ids = torch.tensor(random_sequences(2, lo=20, hi=21, seed=4))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0
    with torch.inference_mode():
        before = model(input_ids=ids, attention_mask=mask).logits
        keys_before = set(ALL_ATTENTION_FUNCTIONS.valid_keys())
        with observe.capture_kv(model, find_attention_layers(model)) as cap, cap.masking(mask.bool()):
            during = model(input_ids=ids, attention_mask=mask).logits
        after = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert model.config._attn_implementation == impl
    assert set(ALL_ATTENTION_FUNCTIONS.valid_keys()) == keys_before


def test_hook_removed_on_exception():
    model = tiny_causal_lm("llama")
    with pytest.raises(KeyError):
        with observe.capture_kv(model, find_attention_layers(model)):
            raise KeyError("boom")
    assert model.config._attn_implementation == "sdpa"


def test_unseen_layers_are_a_hard_error_naming_them():
    cap = observe.KVCapture([0, 1, 2])
    cap.record(1, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    with pytest.raises(observe.CaptureError, match=r"\[0, 2\]"):
        cap.stats()


def test_non_finite_values_are_an_error_naming_the_layer():
    cap = observe.KVCapture([0])
    k = torch.ones(1, 2, 3, 4)
    k[0, 1, 2, 3] = float("nan")
    cap.record(0, k, k, torch.ones(1, 2, 3, 4))
    with pytest.raises(observe.CaptureError, match="layer 0: K"):
        cap.stats()


def test_observer_merge_equals_single_pass():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(2, 3, 5, 4, generator=g) * (i + 1) for i in range(4)]
    whole, a, b = observe.AbsMaxObserver(), observe.AbsMaxObserver(), observe.AbsMaxObserver()
    for i, x in enumerate(xs):
        whole.update(x, None)
        (a if i % 2 else b).update(x, None)
    a.merge(b)
    brute = torch.stack([x.abs().amax(dim=(0, 2, 3)) for x in xs]).amax(0)
    assert torch.equal(whole.amax(), brute) and torch.equal(a.amax(), brute)
    # amax() is a pure read
    assert torch.equal(whole.amax(), whole.amax())
