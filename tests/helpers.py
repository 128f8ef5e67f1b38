"""Helpers shared by the test modules: reference computations, data writers, small calibration and eval
runs, made-up scales. One home, so no test module imports another (tiny.py builds the tiny models and
checkpoints; conftest.py holds the fixtures)."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import signal
from pathlib import Path

import torch

from calib import pipeline
from calib.data import sources as D
from calib.evaluation import passkey
from calib.evaluation.config import EvalConfig
from calib.recipe import recipe as recipe_mod
from calib.scales import fp8
from calib.scales.fold import LayerScales
from tiny import random_sequences, tiny_causal_lm


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def made_up_scales(n: int = 3, *, skip=(), heads: int = 2,
                   amax_per_layer: tuple[float, float] | None = None) -> dict[int, LayerScales]:
    """Scales 0.01·(i+1) (K) and 0.02·(i+1) (V) for layers 0..n-1 but `skip`; per-head ranges of `heads` ones,
    or `amax_per_layer` (k, v) times (i+1)."""
    def amax(i: int, which: int) -> torch.Tensor:
        return torch.ones(heads) if amax_per_layer is None else torch.full((heads,), amax_per_layer[which] * (i + 1))

    return {i: LayerScales(torch.tensor(0.01 * (i + 1)), torch.tensor(0.02 * (i + 1)), amax(i, 0), amax(i, 1))
            for i in range(n) if i not in skip}


# ------------------------------------------------------------------ capture references (K/V from the projections)

def rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def reference_kv(module, hidden: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """K (after k-norm and RoPE, applied here by the test) and V of one attention module, [b, kvh, s, d]."""
    b, s, _ = hidden.shape
    kvh = module.config.num_key_value_heads
    d = module.head_dim
    if hasattr(module, "qkv_proj"):  # Phi-3: fused q|k|v
        qkv = module.qkv_proj(hidden)
        q_size = module.config.num_attention_heads * d
        k, v = qkv[..., q_size:q_size + kvh * d], qkv[..., q_size + kvh * d:]
    else:
        k, v = module.k_proj(hidden), module.v_proj(hidden)
    k = k.view(b, s, kvh, d)
    if hasattr(module, "k_norm"):
        k = module.k_norm(k)
    k, v = k.transpose(1, 2), v.view(b, s, kvh, d).transpose(1, 2)
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)
    rot = cos.shape[-1]
    k_rot, k_pass = k[..., :rot], k[..., rot:]
    k = torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1)
    return k, v


def reference_amax(model, seqs: list[list[int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer, per-head max |K|, |V| from the projections, one unpadded sequence at a time."""
    seen: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def pre_hook(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        k, v = reference_kv(module, hidden, kwargs["position_embeddings"])
        seen.setdefault(module.layer_idx, []).append((k.abs().amax(dim=(0, 2, 3)), v.abs().amax(dim=(0, 2, 3))))

    attn = [m for m in model.modules() if "Attention" in type(m).__name__ and hasattr(m, "layer_idx")]
    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in attn]
    try:
        with torch.no_grad():
            for s in seqs:
                model(input_ids=torch.tensor([s]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {i: (torch.stack([k for k, _ in r]).amax(0), torch.stack([v for _, v in r]).amax(0)) for i, r in seen.items()}


def used_sequences(data_path, recipe, vocab):
    """The token sequences a calibration with `recipe` uses, and the data report (the pipeline's own reader)."""
    rep = D.DataReport()
    return list(D.samples(data_path, None, seq_len=recipe.seq_len, max_samples=recipe.samples,
                          min_tokens=recipe.min_tokens, pack=recipe.pack, seed=recipe.seed,
                          vocab_size=vocab, report=rep)), rep


# ------------------------------------------------------------------ data files

def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, rows: list[dict]) -> Path:
    path.write_text(json.dumps(rows, ensure_ascii=False, indent=1), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    cols = list(rows[0])
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for r in rows:
            w.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in r.items()})
    return path


def read_samples(source, tokenizer=None, *, seq_len=64, max_samples=10**6, min_tokens=1, pack=False, seed=0,
        vocab_size=None):
    report = D.DataReport()
    seqs = list(D.samples(source, tokenizer, seq_len=seq_len, max_samples=max_samples, min_tokens=min_tokens,
                          pack=pack, seed=seed, vocab_size=vocab_size, report=report))
    return seqs, report


# ------------------------------------------------------------------ tokenizer trained on the project's sample text

SAMPLE_TEXT = Path(__file__).resolve().parent.parent / "data" / "sample_text.jsonl"


def train_tokenizer(vocab_size: int = 1000, max_length: int = 256):
    """A small byte-level BPE tokenizer (BOS added to every text) trained on the project's sample text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [json.loads(line)["text"] for line in SAMPLE_TEXT.read_text().splitlines() if line.strip()]
    texts += [passkey.INTRO, passkey.FILLER * 4, passkey.NEEDLE.format(key="12345"), passkey.QUESTION]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   model_max_length=max_length)


# ------------------------------------------------------------------ evaluation on tiny models

SMALL_RECIPE = dict(samples=24, seq_len=64, min_tokens=8, batch_size=8)


def boosted(model, factor: float = 10.0):
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


def k_beyond_fp8_model(scale_k: float = 3000.0, sharpness: float = 30.0):
    """|K| reaches ~2000: k_proj x scale_k, q_proj / (scale_k / sharpness) so attention stays trained-model sharp."""
    model = boosted(tiny_causal_lm("llama", scale_k=scale_k))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.div_(scale_k / sharpness)
    return model


def save_model_and_data(tmp: Path, model, name: str) -> tuple[Path, Path]:
    model.save_pretrained(tmp / name)
    data = tmp / "tokens.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(64, lo=10, hi=60, seed=3)))
    return tmp / name, data


def calibrate_small(src: Path, data: Path, out: Path, **overrides) -> Path:
    r = recipe_mod.load(None).replace(**SMALL_RECIPE, **overrides)
    return pipeline.calibrate(src, data, r, out, device="cpu").out


def eval_config(src: Path, data: Path, out: Path, samples: int = 24, **kw) -> EvalConfig:
    return EvalConfig(model=str(src), data=str(data), out=out, buckets=(16, 32, 64), samples=samples, min_tokens=8,
                         batch_size=8, **kw)


# ------------------------------------------------------------------ report.json's shape

def json_shape(doc, path: str = "") -> list[str]:
    """Every key path of a JSON value with its type, in document order, once each: dict keys that are numbers
    (buckets, layers, depths) or paths (arm names with a directory) become `*`, list items `[]`. Two reports
    of the same run have the same shape whatever code wrote them; a renamed, moved or retyped key changes it."""
    import re

    out: list[str] = []

    def walk(x, p):
        kind = ("obj" if isinstance(x, dict) else "list" if isinstance(x, list) else "null" if x is None else
                "bool" if isinstance(x, bool) else "num" if isinstance(x, (int, float)) else "str")
        line = f"{p or '.'}: {kind}"
        if line not in seen:
            seen.add(line)
            out.append(line)
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, p + "/" + ("*" if re.fullmatch(r"[0-9.]+", k) or "/" in k else k))
        elif isinstance(x, list):
            for v in x:
                walk(v, f"{p}[]")

    seen: set[str] = set()
    walk(doc, path)
    return out


# ------------------------------------------------------------------ typed evaluation results with round numbers

def bucket_row(kl: float = 0.001, ppl_rel: float = 0.001, ppl: float = 10.0, top1: float = 0.99, samples: int = 2,
               tokens: int = 126):
    from calib.engine.metrics import BucketRow

    ref = ppl / (1 + ppl_rel)
    return BucketRow(samples, tokens, kl, top1, ppl, ref, ppl - ref, ppl_rel)


def summary_row(max_bucket_kl: float | None = None, **kw):
    from calib.engine.metrics import Summary

    row = bucket_row(**kw)
    return Summary(**row.to_dict(), max_bucket_kl=row.kl if max_bucket_kl is None else max_bucket_kl)


def engine_numbers(entry=None, **kw):
    """calib.engine.metrics.EngineNumbers from an engine entry as report.json holds it (`entry`, a dict, plus `kw`);
    None stays None. Keys the type derives (tokens_per_gib) are dropped."""
    from dataclasses import fields

    from calib.engine.metrics import BucketRow, EngineNumbers, Summary
    from calib.evaluation.results import passkey_rows

    if entry is None and not kw:
        return None
    d = {"engine": "vllm", "version": "0", **(entry or {}), **kw}

    def typed(cls, row):
        return cls(**{k: v for k, v in row.items() if k in {f.name for f in fields(cls)}})
    d["buckets"] = {b: typed(BucketRow, r) for b, r in (d.get("buckets") or {}).items()}
    d["summary"] = typed(Summary, d["summary"]) if d.get("summary") else None
    d["passkey"] = passkey_rows(d["passkey"]) if d.get("passkey") else None
    d["sample_nll"] = tuple(d.get("sample_nll") or ())
    return EngineNumbers(**{k: v for k, v in d.items() if k in {f.name for f in fields(EngineNumbers)}})


def arm_metrics(kind: str = "checkpoint", dtype: str | None = "fp8_e4m3", *, granularity: str = "tensor",
                shippable: bool = True, source: str | None = "ck", skip=(), serve_skip=(), layers=None, kl: float = 0.001,
                ppl_rel: float = 0.001, ppl: float = 10.0, sample_nll=(), passkey=None, engine=None):
    """An arm's numbers: one bucket "64" and the summary at `kl` / `ppl_rel` / `ppl`, no failures."""
    from calib.evaluation.results import ArmInfo, ArmMetrics, Seconds

    info = ArmInfo(kind, dtype, granularity, shippable, source, tuple(skip), tuple(serve_skip), (),
                   {"k": {}, "v": {}, "q": {}})
    return ArmMetrics(info, {"64": bucket_row(kl, ppl_rel, ppl)}, summary_row(kl=kl, ppl_rel=ppl_rel, ppl=ppl),
                      tuple(sample_nll), tuple(0.0 for _ in sample_nll), layers or {}, (), Seconds(1.0), passkey,
                      engine_numbers(engine) if isinstance(engine, dict) else engine)


def reference_metrics(sample_tokens=(), ranges=None, engine=None):
    """The reference's numbers: KL 0, top-1 1, `ranges` {layer: (k_amax, v_amax)}."""
    from calib.evaluation.results import KVRange, Reference, Seconds

    return Reference({"64": bucket_row(0.0, 0.0, 10.0, 1.0)}, summary_row(kl=0.0, ppl_rel=0.0, top1=1.0), Seconds(1.0),
                     (), tuple(sample_tokens),
                     {i: KVRange(tuple(k), tuple(v)) for i, (k, v) in (ranges or {}).items()}, None,
                     engine_numbers(engine) if isinstance(engine, dict) else engine)


def default_sigint() -> None:
    """`preexec_fn` for a child a test interrupts: SIGINT back to its default action, so Python raises
    KeyboardInterrupt in the child even when the test run itself started with SIGINT ignored (as a background job
    of a non-interactive shell is)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def overflowing_model(tmp: Path, name: str = "overflow") -> Path:
    """A tiny Llama saved in tmp/name whose float32 logits overflow (lm_head x 1e38): every perplexity is
    infinite or NaN."""
    path = tmp / name
    model = tiny_causal_lm("llama", tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e38)
    model.save_pretrained(path)
    return path


# ------------------------------------------------------------------ FA3 attention inputs (test_fa3*, reference)

def e4m3_nearest(v: float) -> float:
    """Nearest e4m3fn value from the format's definition: 3 mantissa bits, exponent >= -6, subnormals spaced 2^-9
    apart, ties to even (Python's round), saturating at 448."""
    a = abs(v)
    if a == 0:
        return 0.0
    if a >= 448:
        return math.copysign(448.0, v)
    step = 2.0 ** (max(math.floor(math.log2(a)), -6) - 3)
    return math.copysign(round(a / step) * step, v)


def fa3_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What vLLM's CUDA cache gives back: x / scale rounded to e4m3, times the scale (float32)."""
    s = scale.reshape(1, -1, 1, 1)
    return fp8.quantize(x, s, fp8.E4M3, fp8.RNE, "divide") * s


def fa3_inputs(seed, b=2, h=4, kvh=2, s=45, t=45, d=16, dv=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g) * 2
    k = torch.randn(b, kvh, t, d, generator=g) * 3
    v = torch.randn(b, kvh, t, dv or d, generator=g)
    ks, vs = torch.rand(kvh, generator=g) * 0.05 + 0.01, torch.rand(kvh, generator=g) * 0.01 + 0.002
    return q, fa3_cache(k, ks), fa3_cache(v, vs), ks, vs


def fa3_padding(b, s, t, cut=9):
    """transformers' 4-D mask for right padding: causal, and the last `cut` keys of batch row 1 are padding."""
    m = torch.ones(s, t, dtype=torch.bool).tril(t - s)[None, None].repeat(b, 1, 1, 1)
    m[1, :, :, t - cut:] = False
    return m


def softmax_attention(q, k, v, scaling, mask=None, causal=True, window_left=None, softcap=None):
    """Plain attention in float64: [b, s, h, dv]."""
    rep = q.shape[1] // k.shape[1]
    s, t = q.shape[2], k.shape[2]
    sc = q.double() @ k.double().repeat_interleave(rep, 1).transpose(-1, -2) * scaling
    if softcap:
        sc = torch.tanh(sc / softcap) * softcap
    rows = torch.arange(s)[:, None] + t - s
    cols = torch.arange(t)[None, :]
    keep = torch.ones(s, t, dtype=torch.bool)
    if causal:
        keep &= cols <= rows
    if window_left is not None:
        keep &= cols >= rows - window_left
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        sc = sc + mask.double()
    sc = sc.masked_fill(~keep, -math.inf)
    return (sc.softmax(-1) @ v.double().repeat_interleave(rep, 1)).transpose(1, 2)


def fa3_case(cfg, seed=0, d=16):
    cfg = dict(cfg)
    s = cfg.pop("s", 45)
    q, k, v, ks, vs = fa3_inputs(seed, s=s, d=d)
    kind = cfg.pop("mask", None)
    if kind == "bool":
        cfg["mask"] = fa3_padding(2, s, 45)
    elif kind == "additive":
        m = torch.zeros(2, 1, s, 45)
        m[0, :, :, 30:] = torch.finfo(torch.float32).min
        m[1] = torch.randn(1, s, 45, generator=torch.Generator().manual_seed(seed)) * 0.5   # a real bias
        cfg["mask"] = m
    return q, k, v, ks, vs, cfg


def engine_script(monkeypatch, name: str = "vllm_runner"):
    """calib/engine/<name>.py loaded as the engine's python loads it: a script beside protocol.py and its other
    siblings, outside the calib package."""
    import importlib.util

    from calib.engine import driver

    folder = Path(driver.__file__).parent
    monkeypatch.syspath_prepend(str(folder))
    spec = importlib.util.spec_from_file_location(f"kvcalib_engine_script_{name}", folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------ tune's small runs (tests/tune)

TUNE_SMALL = dict(observers=("absmax", "mse"), headrooms=(1.0,), eval_samples=8, buckets=(16, 32), min_tokens=8,
                  batch_size=8, max_skip=1, plots=False)


def tune_data(tmp: Path) -> Path:
    path = tmp / "tokens.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(48, lo=12, hi=33, seed=3)))
    return path


def tune_held(tmp: Path) -> Path:
    """Held-out records: another file than the calibration data (tune refuses --eval-data equal to --data)."""
    path = tmp / "held.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(48, lo=12, hi=33, seed=6)))
    return path


def tune_config(src: Path, data: Path | None, out: Path, **kw):
    """A small tune run's TuneConfig (calib.tune.search): TUNE_SMALL's settings, `kw` over them."""
    from calib.tune import search

    base = recipe_mod.Recipe().replace(samples=12, seq_len=32, min_tokens=8, batch_size=8)
    return search.TuneConfig(model=str(src), data=None if data is None else str(data),
                             eval_data=str(tune_held(out.parent)), out=out, base=base, **{**TUNE_SMALL, **kw})


# ------------------------------------------------------------------ a TensorRT-LLM checkpoint (trtllm-engine)

def trtllm_engine_ckpt(root: Path, *, tp: int = 2, pp: int = 2, n: int = 5, quant: dict | None = None,
                       extra: dict | None = None) -> Path:
    """A TensorRT-LLM checkpoint as convert_checkpoint.py lays it out: config.json (PretrainedConfig: architecture,
    mapping, quantization) and rank{r}.safetensors per tp x pp rank, layers split over the stages."""
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    config = {"architecture": "LlamaForCausalLM", "dtype": "bfloat16", "num_hidden_layers": n,
              "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 16, "vocab_size": 32,
              "mapping": {"world_size": tp * pp, "tp_size": tp, "pp_size": pp, "cp_size": 1, "gpus_per_node": 8},
              "quantization": quant if quant is not None else {"quant_algo": None, "kv_cache_quant_algo": None,
                                                               "group_size": 128, "exclude_modules": None},
              **(extra or {})}
    (root / "config.json").write_text(json.dumps(config, indent=4))
    g = torch.Generator().manual_seed(7)
    base, more = divmod(n, pp)
    for r in range(tp * pp):
        stage = r // tp
        local = base + (1 if stage < more else 0)
        tensors = {}
        for j in range(local):
            tensors[f"transformer.layers.{j}.attention.qkv.weight"] = torch.randn(8, 16, generator=g).bfloat16()
            tensors[f"transformer.layers.{j}.attention.dense.weight"] = torch.randn(16, 4, generator=g).bfloat16()
            tensors[f"transformer.layers.{j}.input_layernorm.weight"] = torch.randn(16, generator=g).bfloat16()
        if stage == 0:
            tensors["transformer.vocab_embedding.weight"] = torch.randn(32, 16, generator=g).bfloat16()
        save_file(tensors, str(root / f"rank{r}.safetensors"), metadata={"format": "pt"})
    return root
