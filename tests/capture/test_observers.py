"""Range observers against brute-force references: exact where they claim exactness, within the
documented bound where they approximate, and RoPE's position-independent bound on real rotations."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.capture.observers import (AbsMaxObserver, EmptyObserverError, MSEObserver, PercentileObserver,
                                     RopeBoundObserver, RotaryLayout, make_observer)
from calib.recipe.dtypes import FP8_E4M3, INT8
from calib.scales.quant import fake_quant

NAMES = ["absmax", "percentile", "mse", "rope_bound"]
H, D = 3, 16
LAYOUT = RotaryLayout(rotary_dim=12)                                     # partial: 4 pass-through channels


def _new(name: str, dtype=FP8_E4M3, layout: RotaryLayout = LAYOUT):
    return make_observer(name, {}, dtype, layout)


def _batches(seed: int, n: int, heavy: bool = False, growth: float = 1.3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches [2, H, s, D] of growing range, ~20% padding; heavy: Student-t(2) plus planted outliers."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = int(rng.integers(4, 40))
        x = rng.standard_t(2, size=(2, H, s, D)) if heavy else rng.normal(size=(2, H, s, D))
        x *= growth ** i * np.array([1.0, 7.0, 0.05])[None, :, None, None]
        if heavy and i % 4 == 1:
            x[0, :, 0, :2] *= 300
        mask = rng.random((2, s)) < 0.8
        out.append((torch.tensor(x, dtype=torch.float32), torch.tensor(mask)))
    return out


def _real_abs(batches) -> list[np.ndarray]:
    """Per head, every |x| of a real token (the brute-force view of what an observer saw)."""
    return [np.abs(np.concatenate([x[:, h].numpy()[m.numpy()].ravel() for x, m in batches])) for h in range(H)]


def _feed(obs, batches):
    for x, m in batches:
        obs.update(x, m)
    return obs


def _assert_same_state(a: dict, b: dict) -> None:
    """Integer and max-based state bit-identical; float64 bin sums up to summation order."""
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        if a[k].dtype == torch.float64:
            assert torch.allclose(a[k], b[k], rtol=1e-12, atol=0), k
        else:
            assert torch.equal(a[k], b[k]), k


DATA = _batches(0, 8)


# ---- shared contract -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_padding_never_changes_state(name: str) -> None:
    rng = np.random.default_rng(1)
    lens = [5, 17, 9, 1]
    seqs = [torch.tensor(rng.normal(size=(1, H, n, D)) * 3, dtype=torch.float32) for n in lens]
    padded = torch.full((len(lens), H, max(lens), D), 1e30)
    padded[0, 1, -1, 3] = float("nan")
    mask = torch.zeros(len(lens), max(lens), dtype=torch.bool)
    for i, (s, n) in enumerate(zip(seqs, lens)):
        padded[i, :, :n], mask[i, :n] = s[0], True
    one_by_one = _new(name)
    for s in seqs:
        one_by_one.update(s, None)
    _assert_same_state(_feed(_new(name), [(padded, mask)]).state_dict(), one_by_one.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_merge_equals_single_pass_and_state_round_trips(name: str) -> None:
    single = _feed(_new(name), DATA)
    left, right = _feed(_new(name), DATA[:3]), _feed(_new(name), DATA[3:])
    left.merge(right)
    left.merge(_new(name))                                                # merging an empty one is a no-op
    _assert_same_state(left.state_dict(), single.state_dict())
    empty = _new(name)
    empty.merge(single)
    _assert_same_state(empty.state_dict(), single.state_dict())
    resumed = _new(name)
    resumed.load_state_dict(_feed(_new(name), DATA[:5]).state_dict())   # checkpoint, reload, continue
    _assert_same_state(_feed(resumed, DATA[5:]).state_dict(), single.state_dict())


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(range(len(DATA))), cut=st.integers(0, len(DATA)))
def test_batch_order_and_merge_tree_do_not_matter(order: list[int], cut: int) -> None:
    """Exact for every observer: histogram bins are float-aligned, so re-binning loses nothing."""
    shuffled = [DATA[i] for i in order]
    for name in NAMES:
        reference = _feed(_new(name), DATA)
        a, b = _feed(_new(name), shuffled[:cut]), _feed(_new(name), shuffled[cut:])
        b.merge(a)
        _assert_same_state(b.state_dict(), reference.state_dict())
        if name != "mse":                                                 # mse: argmin over float64 sums
            assert torch.equal(b.amax(), reference.amax())


@pytest.mark.parametrize("dtype", [FP8_E4M3, INT8])
@pytest.mark.parametrize("name", NAMES)
def test_all_zero_input_gives_zero_and_reads_are_pure(name: str, dtype) -> None:
    obs = _new(name, dtype)
    with pytest.raises(EmptyObserverError):
        obs.amax()
    assert not obs.seen
    obs.update(torch.zeros(2, H, 5, D), torch.tensor([[True] * 5, [True, True, False, False, False]]))
    before = obs.state_dict()
    first, second = obs.amax(), obs.amax()
    assert obs.seen and first.dtype == torch.float32 and first.shape == (H,)
    assert first.tolist() == [0.0] * H and torch.equal(first, second)
    _assert_same_state(obs.state_dict(), before)
    before = _feed(obs, DATA).state_dict()
    assert torch.equal(obs.amax(), obs.amax()) and (obs.amax() > 0).all()
    _assert_same_state(obs.state_dict(), before)


@pytest.mark.parametrize("name", NAMES)
def test_update_never_reads_values_on_the_host(name: str) -> None:
    """On the meta device any .item()/.tolist()/branch on a value raises: update must get through."""
    obs = _new(name)
    x = torch.empty(2, H, 7, D, device="meta")
    obs.update(x, torch.ones(2, 7, dtype=torch.bool, device="meta"))
    obs.update(x, None)
    assert all(t.device.type == "meta" for t in obs.state_dict().values())


@pytest.mark.parametrize("name", NAMES)
def test_transposed_bf16_keys_as_transformers_passes_them(name: str) -> None:
    x = torch.randn(2, 9, H, D, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).transpose(1, 2)
    mask = torch.rand(2, 9, generator=torch.Generator().manual_seed(10)) < 0.7
    a, b = _feed(_new(name), [(x, mask)]), _feed(_new(name), [(x.float().contiguous(), mask)])
    _assert_same_state(a.state_dict(), b.state_dict())


@pytest.mark.parametrize("name", NAMES)
def test_head_count_change_is_an_error(name: str) -> None:
    obs = _feed(_new(name), DATA[:1])
    with pytest.raises(ValueError):
        obs.update(torch.ones(1, H + 1, 3, D), None)


def test_factory_rejects_unknown_names_and_params() -> None:
    with pytest.raises(ValueError, match="minmax.*absmax.*mse.*percentile.*rope_bound"):
        make_observer("minmax", {}, FP8_E4M3, None)
    with pytest.raises(ValueError, match="'q'.*accepted.*'p'"):
        make_observer("percentile", {"q": 99}, FP8_E4M3, None)
    with pytest.raises(ValueError, match="'grid' must be int"):
        make_observer("mse", {"grid": 2.5}, FP8_E4M3, None)
    with pytest.raises(ValueError, match="rotary"):
        make_observer("rope_bound", {}, FP8_E4M3, None)
    with pytest.raises(ValueError, match="percentile p"):
        make_observer("percentile", {"p": 120}, FP8_E4M3, None)
    obs = make_observer("mse", {"grid": 10, "min_ratio": 0.5, "bins": 256}, INT8, None)
    assert (obs.grid, obs.min_ratio, obs.bins, obs.dtype) == (10, 0.5, 256, INT8)
    assert make_observer("percentile", {"p": 99}, INT8, None).p == 99.0


def test_mismatched_merges_and_states_are_errors() -> None:
    with pytest.raises(ValueError):
        _new("percentile").merge(_new("mse"))
    with pytest.raises(ValueError):
        _new("percentile").merge(PercentileObserver(bins=256))
    with pytest.raises(ValueError, match="rotary layout"):
        RopeBoundObserver(RotaryLayout(8)).merge(RopeBoundObserver(RotaryLayout(8, interleaved=True)))
    with pytest.raises(ValueError, match="keys"):
        _new("absmax").load_state_dict({"max": torch.zeros(3)})
    with pytest.raises(ValueError, match="histogram"):
        _new("mse").load_state_dict({"counts": torch.zeros(3, 2048)})


# ---- absmax ----------------------------------------------------------------------------------------

def test_absmax_equals_brute_force() -> None:
    got = _feed(_new("absmax"), DATA).amax()
    assert got.tolist() == [np.float32(v.max()) for v in _real_abs(DATA)]


# ---- histogram (percentile, mse) ------------------------------------------------------------------

def test_histogram_equals_one_pass_brute_force_binning() -> None:
    """Counts after 24 batches of growing range (re-binned many times) equal a direct numpy binning of
    all values at the final range: bin = (float32 bits >> 16) - bin-0 key, clipped into [0, bins)."""
    data = _batches(7, 24, heavy=True)
    state = _feed(_new("percentile"), data).state_dict()
    for h, values in enumerate(_real_abs(data)):
        e = int(np.frexp(values.max())[1])
        assert state["exponent"][h].item() == e and state["amax"][h].item() == values.max()
        base = ((e + 127) << 7) - 2048
        idx = np.clip((values.astype(np.float32).view(np.int32) >> 16) - base, 0, 2047)
        assert np.array_equal(state["counts"][h].numpy(), np.bincount(idx, minlength=2048))
        sums = np.bincount(idx, weights=values.astype(np.float64), minlength=2048)
        np.testing.assert_allclose(state["sums"][h].numpy(), sums, rtol=1e-12)


# ---- percentile ------------------------------------------------------------------------------------

@pytest.mark.parametrize("heavy", [False, True])
@pytest.mark.parametrize("p", [99.99, 99.9, 99.0, 50.0])
def test_percentile_within_documented_bound_of_exact(p: float, heavy: bool) -> None:
    data = _batches(2, 24, heavy=heavy)
    left, right = PercentileObserver(p), PercentileObserver(p)
    for i, batch in enumerate(data):                                      # two observers, then merged
        (left if i % 3 else right).update(*batch)
    left.merge(right)
    got = left.amax().double().numpy()
    for h, values in enumerate(_real_abs(data)):
        assert abs(got[h] - _exact(values, p)) <= _bound(values, p, left.bins), (h, got[h], _exact(values, p))
    if p >= 99.9:                                                        # measured: well inside the bound
        exact = np.array([_exact(v, p) for v in _real_abs(data)])
        assert np.max(np.abs(got - exact) / exact) < 4e-3


def _exact(values: np.ndarray, p: float) -> float:
    return float(np.percentile(values.astype(np.float64), p))


def _bound(values: np.ndarray, p: float, bins: int) -> float:
    """The class docstring's bound: 2^-7 of the upper order statistic plus the underflow bin's reach."""
    v = np.sort(values.astype(np.float64))
    upper = v[min(int(np.floor(p / 100 * (len(v) - 1))) + 1, len(v) - 1)]
    e = np.frexp(v[-1])[1]
    return 2.0 ** -7 * upper + 2.0 ** (e - bins // 128) * (1 + 2.0 ** -7)


def test_percentile_100_is_amax_and_few_octaves_still_bounded() -> None:
    assert torch.equal(_feed(PercentileObserver(100.0), DATA).amax(), _feed(_new("absmax"), DATA).amax())
    data = _batches(6, 12, heavy=True)
    obs = _feed(PercentileObserver(50.0, bins=256), data)                 # 2 octaves: the median underflows
    for h, values in enumerate(_real_abs(data)):
        assert abs(obs.amax()[h].item() - _exact(values, 50.0)) <= _bound(values, 50.0, 256)


# ---- mse -------------------------------------------------------------------------------------------

def _true_mse(values: np.ndarray, clips, dtype) -> np.ndarray:
    """Mean squared cache error of the raw values at each clip (scale = clip / qmax), brute force."""
    v = torch.from_numpy(values.astype(np.float32))[None, :]
    scale = torch.as_tensor(np.atleast_1d(clips), dtype=torch.float32)[:, None] / dtype.qmax
    return (fake_quant(v, scale, dtype) - v).double().square().mean(-1).numpy()


@pytest.mark.parametrize("dtype", [FP8_E4M3, INT8])
@pytest.mark.parametrize("heavy", [False, True])
def test_mse_clip_is_near_the_brute_force_optimum(dtype, heavy: bool) -> None:
    """Brute force over the raw values: on the observer's own 100 candidates the histogram costs ~nothing;
    a 4x finer grid finds at most a few percent more (FP8 with outliers: lucky alignments of the outliers)."""
    data = _batches(3, 4, heavy=heavy, growth=1.0)
    obs = _feed(MSEObserver(dtype), data)
    chosen = obs.amax().numpy()
    for h, values in enumerate(_real_abs(data)):
        mine = _true_mse(values, chosen[h], dtype)[0]
        same = np.linspace(obs.min_ratio, 1.0, obs.grid) * values.max()
        fine = np.linspace(obs.min_ratio, 1.0, 4 * obs.grid) * values.max()
        assert mine <= 1.01 * _true_mse(values, same, dtype).min(), h
        assert mine <= 1.10 * _true_mse(values, fine, dtype).min(), h
        assert 0.3 * values.max() * (1 - 1e-6) <= chosen[h] <= values.max()


@pytest.mark.parametrize("dtype", [FP8_E4M3, INT8])
def test_mse_with_outliers_clips_and_beats_absmax(dtype) -> None:
    """A large bulk and two outliers: INT8's uniform grid pays for range, so the clip drops well below
    amax; FP8's error is relative to |x|, so its clip stays near amax — never worse than absmax."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 1, 6250, 32))
    x[0, 0, 0, :2] = 12.0
    x = torch.tensor(x, dtype=torch.float32)
    clip = _feed(MSEObserver(dtype), [(x, None)]).amax().item()
    values = x.abs().numpy().ravel()
    mine, at_amax = _true_mse(values, [clip, values.max()], dtype)
    if dtype is INT8:
        assert clip < 0.8 * values.max() and mine < 0.7 * at_amax
    else:                                                                # flat landscape: within 0.1%
        assert clip > 0.9 * values.max() and mine <= 1.001 * at_amax


# ---- rope_bound ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", [RotaryLayout(D), RotaryLayout(12), RotaryLayout(8, interleaved=True)])
def test_rope_bound_equals_brute_force(layout: RotaryLayout) -> None:
    got = _feed(RopeBoundObserver(layout), DATA).amax().numpy()
    rot = layout.rotary_dim
    pairs = [(2 * i, 2 * i + 1) if layout.interleaved else (i, i + rot // 2) for i in range(rot // 2)]
    for h in range(H):
        best = 0.0
        for x, m in DATA:
            tokens = x[:, h].double().numpy()[m.numpy()]                  # [real tokens, D]
            for i, j in pairs:
                best = max(best, max(math.hypot(a, b) for a, b in zip(tokens[:, i], tokens[:, j])))
            best = max(best, float(np.abs(tokens[:, rot:]).max(initial=0.0)))
        assert got[h] == pytest.approx(best, rel=1e-6)


def _rope_neox(k: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Standard RoPE, rotate_half layout, on k [b, h, s, d] (written here, independent of the observer)."""
    d = k.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = positions.double()[:, None] * inv_freq[None, :]              # [s, d/2]
    cos, sin = torch.cat((angle.cos(), angle.cos()), -1), torch.cat((angle.sin(), angle.sin()), -1)
    k = k.double()
    rotated_half = torch.cat((-k[..., d // 2:], k[..., : d // 2]), -1)
    return (k * cos + rotated_half * sin).float()


def test_rope_bound_from_short_calibration_covers_long_requests() -> None:
    """THE reason for rope_bound: K of fixed content, calibrated at positions 0..15, served at up to 4096."""
    d, pair_scale = 64, torch.ones(2, 32)
    pair_scale[0, 16], pair_scale[1, 20] = 3.0, 5.0                      # slow pairs: ~0.15 / 0.05 rad by pos 15
    pre = torch.cat((pair_scale, pair_scale), -1)[None, :, None, :]     # every pair (a, b) = (s, s)
    short = _rope_neox(pre.expand(1, 2, 16, d), torch.arange(16))
    long = _rope_neox(pre.expand(1, 2, 4096, d), torch.arange(4096))
    absmax_short = _feed(_new("absmax"), [(short, None)]).amax()
    absmax_long = _feed(_new("absmax"), [(long, None)]).amax()
    bound_short = _feed(RopeBoundObserver(RotaryLayout(d)), [(short, None)]).amax()
    true_bound = math.sqrt(2) * torch.tensor([3.0, 5.0])
    assert (absmax_short < 0.82 * absmax_long).all()                     # absmax misses ~20% of the range
    assert torch.allclose(bound_short, true_bound, rtol=1e-6)
    assert (absmax_long <= bound_short * (1 + 1e-6)).all()
    assert (absmax_long >= 0.999 * true_bound).all()                     # and the bound is reached


def _llama_cos_sin(rot: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=4 * rot, num_attention_heads=4, head_dim=rot, max_position_embeddings=8192)
    return LlamaRotaryEmbedding(config)(torch.zeros(1), positions[None])


@pytest.mark.parametrize("layout", [RotaryLayout(D), RotaryLayout(8), RotaryLayout(8, interleaved=True)])
def test_pair_layout_matches_transformers_rope(layout: RotaryLayout) -> None:
    """transformers' own RoPE (Llama rotate_half, GPT-NeoX partial, GPT-J interleaved) leaves every
    pair norm the observer tracks unchanged — and the other layout's pairs are not invariant."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope

    g = torch.Generator().manual_seed(8)
    k, positions = torch.randn(2, H, 300, D, generator=g), torch.randint(0, 8000, (300,), generator=g)
    rot = layout.rotary_dim
    cos, sin = _llama_cos_sin(rot, positions)
    if layout.interleaved:                                                # GPT-J: [b, s, h, rot], half-size sin/cos
        k_rot = gptj_rope(k[..., :rot].transpose(1, 2), sin[..., : rot // 2], cos[..., : rot // 2])
        rotated = torch.cat((k_rot.transpose(1, 2), k[..., rot:]), -1)
    else:
        rotated = neox_rope(k, k, cos, sin)[1]
    still = _feed(RopeBoundObserver(layout), [(k, None)]).state_dict()
    moved = _feed(RopeBoundObserver(layout), [(rotated, None)]).state_dict()
    for name in still:
        assert torch.allclose(still[name], moved[name], rtol=1e-5), name
    wrong = RotaryLayout(layout.rotary_dim, interleaved=not layout.interleaved)
    w_still = _feed(RopeBoundObserver(wrong), [(k, None)]).state_dict()["pair_max"]
    w_moved = _feed(RopeBoundObserver(wrong), [(rotated, None)]).state_dict()["pair_max"]
    assert not torch.allclose(w_still, w_moved, rtol=1e-3)


@contextlib.contextmanager
def _layer0_keys(model, sink: list):
    """Record layer 0's cached K through transformers' attention interface (as calib.capture.hook does)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name, sdpa = "test_observers_layer0", ALL_ATTENTION_FUNCTIONS["sdpa"]

    def record(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            sink.append(key.detach().clone())
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(name, record)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")
        ALL_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.pop(name, None)


def test_rope_bound_on_a_real_llama_layer() -> None:
    """Layer 0's pre-RoPE K depends on the token only: the same 16 tokens at positions 0..15 and
    repeated out to position 1023 have the same pair norms, so the short bound covers the long K."""
    from tiny import tiny_causal_lm

    model = tiny_causal_lm("llama", max_position_embeddings=2048)
    tokens = torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(5))
    keys: list[torch.Tensor] = []
    with _layer0_keys(model, keys), torch.inference_mode():
        model.model(input_ids=tokens, use_cache=False)
        model.model(input_ids=tokens.repeat(1, 64), use_cache=False)
    short, long = keys
    layout = RotaryLayout(model.config.head_dim)
    bound_short = _feed(RopeBoundObserver(layout), [(short, None)]).amax()
    bound_long = _feed(RopeBoundObserver(layout), [(long, None)]).amax()
    absmax_short = _feed(_new("absmax"), [(short, None)]).amax()
    absmax_long = _feed(_new("absmax"), [(long, None)]).amax()
    assert torch.allclose(bound_short, bound_long, rtol=1e-5)
    assert (absmax_long <= bound_short * (1 + 1e-5)).all()
    assert (absmax_short < absmax_long).all()


def test_state_loaded_on_another_device_follows_the_batches() -> None:
    """Resume loads states on the CPU while batches arrive on the GPU; the in-place folds of calib.capture.kernels
    need the state where the batch is. The 'meta' device stands in for the GPU (shapes only)."""
    from calib.capture.hook import OverflowCounter

    x = torch.randn(2, 3, 5, 8)
    exact, rope, over = AbsMaxObserver(), RopeBoundObserver(RotaryLayout(8)), OverflowCounter()
    for obs in (exact, rope, over):
        obs.update(x, None)
    loaded = [type(o)() if o is not rope else RopeBoundObserver(RotaryLayout(8)) for o in (exact, rope, over)]
    for fresh, obs in zip(loaded, (exact, rope, over)):
        fresh.load_state_dict(obs.state_dict())
        fresh.update(x.to("meta"), None)
        assert {t.device.type for t in fresh.state_dict().values()} == {"meta"}, type(fresh).__name__


def test_one_registry_names_every_observer_a_recipe_may_name():
    """Each recipe observer (calib.recipe.dtypes.OBSERVERS: names and the parameters a recipe may set) has
    exactly one class, found by name; make_observer builds that class from the recipe's parameters."""
    from calib.capture import observers
    from calib.recipe import dtypes
    from calib.recipe.recipe import OBSERVERS as RECIPE_OBSERVERS

    assert sorted(observers.REGISTRY) == sorted(dtypes.OBSERVERS) == sorted(RECIPE_OBSERVERS)
    for name, cls in observers.REGISTRY.items():
        assert cls.spec is dtypes.OBSERVERS[name]
        assert set(RECIPE_OBSERVERS[name]) == set(cls.spec.recipe_params())
        obs = make_observer(name, {}, FP8_E4M3, RotaryLayout(8))
        assert type(obs) is cls
    assert make_observer("mse", {"grid": 7, "min_ratio": 0.5}, INT8, None).dtype is INT8
    assert make_observer("percentile", {"p": 99.5}, FP8_E4M3, None).p == 99.5


def test_only_rope_bound_needs_the_rotary_layout():
    """A statistics file of another observer may lack rotary_dim (a damaged header that still parses): rebuilding
    its observers must not reach for a model config (hypothesis found an AttributeError here)."""
    from calib.capture.spec import capture_spec
    from calib.recipe.recipe import Recipe

    spec = capture_spec(Recipe(observer="mse"), None, rotary_dim=None)
    assert spec.k_observer is not None and spec.v_observer is not None
