"""Load the model to calibrate and decide whether its KV cache is one we can calibrate.

Why the checks come first: an architecture whose cache is not plain per-layer K and V (DeepSeek's MLA
latent cache, Mamba/linear-attention layers) would produce scales that mean nothing to the engine. We
refuse those from the config alone, before a single weight is read.

Only the base model (no LM head) is loaded: calibration needs K and V, not logits, and the head of a
large-vocabulary model costs memory and time for nothing. On a GPU the model runs in bf16 (what the
engines serve). On CPU it runs in `Placement.cpu_dtype`: float32 by default, because most CPUs lack
fast bf16 matrix units (a bf16 forward of the default model took 6x as long as float32 on a 2-core AVX2 machine);
bfloat16 reproduces the engines' arithmetic, at that cost.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from calib.ckpt import integrity
from calib.ckpt.names import is_kv_scale
from calib.ckpt.source import SourceFiles
from calib.errors import KvcalibError, first_line
from calib.model import geometry
from calib.safety.readers import raising

KV_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# model_type values whose cache is not (only) plain K/V: hybrid recurrent / state-space models.
NOT_PLAIN_KV = frozenset({
    "mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "falcon_h1",
    "nemotron_h", "granitemoehybrid", "qwen3_next", "lfm2", "recurrent_gemma", "xlstm", "minimax",
})


class ModelError(KvcalibError, ValueError):
    """The model cannot be calibrated; the message says which and what to do."""


@dataclass
class LoadedModel:
    model: torch.nn.Module          # the base model (no LM head), eval mode
    tokenizer: Any | None           # None when the directory has no tokenizer files
    source_dir: Path                # local directory holding the checkpoint files
    config: Any                     # the text config (num_hidden_layers, head_dim, ...)
    attention_layers: list[int]     # layer_idx of every attention module, ascending
    device: torch.device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype


def resolve_source(model_id: str | Path) -> Path:
    """A local checkpoint directory; a hub id is downloaded (config, weights, tokenizer) first."""
    path = Path(model_id)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"MODEL {path} has no config.json; point MODEL at a Hugging Face model directory")
        with raising(ModelError, integrity.IntegrityError):
            integrity.contained(path, "config.json", f"MODEL {path}")
        return path
    if str(model_id).startswith((".", "/", "~")) or str(model_id).count("/") > 1:
        raise ModelError(f"MODEL {model_id} not found; give a model directory or a hub id like org/name")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(model_id), allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]))
    except Exception as e:
        raise ModelError(f"MODEL {model_id}: not a local directory and the hub download failed "
                         f"({type(e).__name__}: {first_line(e)})") from None


def check_cache_kind(config: Any, where: str) -> None:
    """Refuse configs whose KV cache is not plain per-layer K/V (raises ModelError)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    mtype = getattr(text, "model_type", "?")
    if getattr(text, "kv_lora_rank", None):
        raise ModelError(f"{where}: {mtype} uses multi-head latent attention (MLA); its cache stores a compressed "
                         "latent, not K and V, so per-layer K/V scales do not apply — not supported")
    if mtype in NOT_PLAIN_KV or getattr(config, "model_type", None) in NOT_PLAIN_KV:
        raise ModelError(f"{where}: {mtype} has recurrent/state-space layers whose cache is not plain K/V — not supported")
    if kinds := set(getattr(text, "layer_types", None) or []) - KV_LAYER_TYPES:
        raise ModelError(f"{where}: layer types {sorted(kinds)} keep no plain K/V cache — not supported "
                         f"(only {sorted(KV_LAYER_TYPES)})")


def find_attention_layers(model: torch.nn.Module) -> list[int]:
    """layer_idx of every attention module (modules named *Attention that carry a layer_idx)."""
    return sorted({m.layer_idx for m in model.modules()
                   if "Attention" in type(m).__name__ and isinstance(getattr(m, "layer_idx", None), int)})


def pick_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


@dataclass(frozen=True)
class Placement:
    """Where the weights live. `device_map` (e.g. "auto") spreads a model larger than one accelerator over
    GPUs, CPU memory (`max_memory`, e.g. {"0": "70GiB", "cpu": "200GiB"}) and disk (`offload_folder`)."""
    device: str | None = None
    device_map: str | None = None
    max_memory: dict[str, str] | None = None
    offload_folder: str | None = None
    cpu_dtype: str | None = "float32"   # the model's dtype on CPU: float32, bfloat16, None = the checkpoint's


TOKENIZER_JSON = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                  "added_tokens.json", "generation_config.json")


def read_config(src: Path) -> dict[str, Any]:
    """config.json as a dict, strict JSON, its geometry checked (no transformers involved)."""
    return _read_config(src)[0]


def _read_config(src: Path, raw: dict[str, Any] | None = None) -> tuple[dict[str, Any], str | None]:
    """`read_config` and the digest of the bytes read (what a statistics file records of its model); `raw`: the
    config already read (no digest), checked only."""
    where = f"MODEL {src}/config.json"
    with raising(ModelError, integrity.IntegrityError, geometry.GeometryError):
        raw, sha = (raw, None) if raw is not None else integrity.read_json_digest(src / "config.json", where)
        geometry.check(raw, where)
    return raw, sha


@dataclass(frozen=True)
class Preflight:
    """What the checks before a load found, handed to `load` so nothing is read twice: config.json as
    written, transformers' config built from it, and the checked weight headers."""
    path: Path
    raw: dict[str, Any]                        # config.json
    config: Any                                # transformers' config (the whole model's)
    pickled: bool                              # the weights are pickle files (--allow-pickle)
    weights: integrity.Checkpoint | None       # every safetensors header, checked (None when pickled)
    config_sha256: str | None = None           # digest of config.json as read (None: read by another check)

    @property
    def text_config(self) -> Any:
        return self.config.get_text_config()

    @property
    def files(self) -> SourceFiles:
        """config.json and the headers, as the export targets' `prepare` takes them."""
        return SourceFiles(self.path, self.raw, self.weights)

    def check_context(self, seq_len: int) -> None:
        """A sequence longer than the model's context cannot be calibrated (known before any weight loads)."""
        max_pos = getattr(self.text_config, "max_position_embeddings", None)
        if max_pos and seq_len > max_pos:
            raise ModelError(f"seq_len {seq_len} exceeds the model's context "
                             f"(max_position_embeddings = {max_pos}); lower SEQ_LEN")


def preflight(src: Path | SourceFiles, *, trust_remote_code: bool = False, allow_pickle: bool = False) -> Preflight:
    """Checks that need only config.json, file names and safetensors headers (run before any weight is read).
    A SourceFiles (already read for export) is checked without reading its files again."""
    from transformers import AutoConfig

    files = src if isinstance(src, SourceFiles) else None
    src = Path(files.path if files is not None else src)
    raw, sha = _read_config(src, files.config if files is not None else None)
    try:
        config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
    except ValueError as e:
        raise ModelError(f"MODEL {src}: config.json not understood by transformers ({first_line(e)}); "
                         "if the model ships its own code, pass --trust-remote-code") from None
    except Exception as e:  # config classes raise anything (TypeError, KeyError, ...) on odd values
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        why = lines[-1][:200] if lines and lines[0].endswith(":") else first_line(e)  # validators wrap the cause
        raise ModelError(f"MODEL {src}/config.json: transformers cannot build a config from it "
                         f"({type(e).__name__}: {why}); use the model's original config.json") from None
    check_cache_kind(config, f"MODEL {src}")
    pickled = not any(src.glob("*.safetensors"))
    if pickled and not allow_pickle:
        raise ModelError(f"MODEL {src} has no .safetensors weights; kvcalib reads only safetensors, since pickle "
                         "files can run code: convert with transformers' save_pretrained, or pass --allow-pickle "
                         "if you trust the files")
    for name in TOKENIZER_JSON:
        if (src / name).exists():
            with raising(ModelError, integrity.IntegrityError):
                integrity.contained(src, name, f"MODEL {src}")
                integrity.read_json(src / name, f"MODEL {src}/{name}")
    weights = None if pickled else check_weights(src, raw, files.weights if files is not None else None)
    return Preflight(src, raw, config, pickled, weights, sha)


def check_weights(src: Path, raw_config: dict[str, Any],
                  scanned: integrity.Checkpoint | None = None) -> integrity.Checkpoint:
    """Every shard header checked (`scanned`: already checked); integer/packed weights need a
    quantization_config that says how to read them."""
    with raising(ModelError, integrity.IntegrityError):
        ckpt = scanned if scanned is not None else integrity.scan(src)
    text, _ = geometry.text_part(raw_config)
    qc = raw_config.get("quantization_config") or text.get("quantization_config")
    packed = sorted(n for n in ckpt.weight_map if ckpt.tensor(n).dtype in integrity.PACKED_DTYPES)
    if packed and not (isinstance(qc, dict) and isinstance(qc.get("quant_method"), str)):
        t = ckpt.tensor(packed[0])
        raise ModelError(f"MODEL {src}: {len(packed)} tensor(s) hold {t.dtype} values ({packed[0]}, ...) but "
                         "config.json has no quantization_config saying how to read them; calibrating would use "
                         "raw integer codes as weights. Use the unquantized model, or its original config.json")
    return ckpt


def load(model_id: str | Path | Preflight, *, device: str | None = None, trust_remote_code: bool = False,
         placement: Placement | None = None, allow_pickle: bool = False, lm_head: bool = False) -> LoadedModel:
    """Load for calibration (base model only) or, with `lm_head`, the causal LM (evaluation needs logits). A
    Preflight (the checks' result) is loaded as checked: its folder is not resolved or read again."""
    from transformers import AutoModel, AutoModelForCausalLM

    pre = model_id if isinstance(model_id, Preflight) else \
        preflight(resolve_source(model_id), trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    src, config, pickled = pre.path, pre.config, pre.pickled
    place = placement or Placement(device=device)
    dev = pick_device(place.device)
    on_gpu = dev.type == "cuda" or (place.device_map and torch.cuda.is_available())
    dtype = torch.bfloat16 if on_gpu else getattr(torch, place.cpu_dtype) if place.cpu_dtype else "auto"
    kwargs: dict[str, Any] = {}
    if place.device_map:
        mem = {int(k) if str(k).isdigit() else k: v for k, v in place.max_memory.items()} if place.max_memory else None
        kwargs = {"device_map": place.device_map, "max_memory": mem, "offload_folder": place.offload_folder}
    auto = AutoModelForCausalLM if lm_head else AutoModel
    _check_size(auto, pre, trust_remote_code)
    try:
        with quiet_transformers():  # we check its load report ourselves (check_load_report)
            model, info = auto.from_pretrained(src, config=config, dtype=dtype, trust_remote_code=trust_remote_code,
                                               use_safetensors=not pickled, output_loading_info=True,
                                               ignore_mismatched_sizes=True, **kwargs)
    except OSError as e:
        raise ModelError(f"MODEL {src}: weights could not be loaded ({first_line(e)})") from None
    except (RuntimeError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise ModelError(f"MODEL {src}: weights could not be loaded ({type(e).__name__}: {first_line(e)})") from None
    except ValueError as e:
        if lm_head and not place.device_map:
            raise ModelError(f"MODEL {src}: no causal LM could be loaded ({first_line(e)})") from None
        if not place.device_map:
            raise
        raise ModelError(f"MODEL {src}: device map {place.device_map!r} failed ({first_line(e)}); "
                         "give --max-memory and --offload-folder that fit the model") from None
    check_load_report(info, src, lm_head)
    if place.device_map:
        dev = model.get_input_embeddings().weight.device  # inputs go where the first layer lives
        if dev.type == "meta":  # embeddings offloaded to disk: accelerate moves them to the execution device
            dev = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    else:
        model.to(dev)
    model.eval()
    layers = find_attention_layers(model)
    if not layers:
        raise ModelError(f"MODEL {src}: {type(model).__name__} exposes no attention layers with a layer_idx, so "
                         "K/V cannot be captured through transformers' attention interface — not supported")
    return LoadedModel(model=model, tokenizer=load_tokenizer(src, trust_remote_code), source_dir=src,
                       config=config.get_text_config(), attention_layers=layers, device=dev)


def check_load_report(info: dict[str, Any], src: Path, lm_head: bool) -> None:
    """Missing, unexpected or mismatched tensors mean config.json and the weight files are not one model:
    transformers would initialise the gaps randomly and we would calibrate noise. An error names them."""
    def names(items: list, n: int = 3) -> str:
        shown = [str(x[0] if isinstance(x, tuple) else x) for x in sorted(items, key=str)[:n]]
        return ", ".join(shown) + (f" and {len(items) - n} more" if len(items) > n else "")

    if missing := list(info.get("missing_keys") or []):
        raise ModelError(f"MODEL {src}: the weight files lack {len(missing)} tensor(s) config.json needs "
                         f"({names(missing)}); they would be random — the config and the weights are not one "
                         "model (check num_hidden_layers and the shards)")
    if mismatched := list(info.get("mismatched_keys") or []):
        first = mismatched[0]
        detail = f": file {tuple(first[1])} vs config {tuple(first[2])}" if isinstance(first, tuple) and len(first) == 3 else ""
        raise ModelError(f"MODEL {src}: {len(mismatched)} tensor(s) have another shape than config.json implies "
                         f"({names(mismatched)}{detail}); the config and the weights are not one model")
    unexpected = [k for k in info.get("unexpected_keys") or []
                  if not (not lm_head and k.startswith("lm_head.")) and not is_kv_scale(k)]
    if unexpected:
        raise ModelError(f"MODEL {src}: the weight files hold {len(unexpected)} tensor(s) the model defined by "
                         f"config.json does not have ({names(unexpected)}); the config and the weights are not "
                         "one model")
    if errors := [e for e in info.get("error_msgs") or [] if e]:
        raise ModelError(f"MODEL {src}: loading the weights failed ({str(errors[0]).splitlines()[0][:200]})")


def _check_size(auto: Any, pre: Preflight, trust_remote_code: bool) -> None:
    """Refuse before allocating when config.json describes more parameters than the files hold (an edited
    hidden_size or layer count would otherwise allocate the whole imagined model, then fail)."""
    config, src = pre.config, pre.path
    if pre.pickled or pre.weights is None or getattr(config, "quantization_config", None) is not None:
        return  # packed weights hold several parameters per element: counts do not compare
    try:
        from accelerate import init_empty_weights

        with init_empty_weights(), quiet_transformers():
            meta = auto.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # a model class that cannot be built empty: the load report still checks every tensor
        return
    meta.tie_weights()  # built empty, tied embeddings are two tensors until tied; the files hold one
    need = sum(p.numel() for p in meta.parameters())
    have = sum(math.prod(pre.weights.tensor(n).shape) for n in pre.weights.weight_map)
    if need > have:
        raise ModelError(f"MODEL {src}: config.json describes {need:,} parameters but the weight files hold "
                         f"{have:,}; the config and the weights are not one model (check num_hidden_layers, "
                         "hidden_size and the shards)")


@contextlib.contextmanager
def quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def load_tokenizer(src: Path, trust_remote_code: bool = False) -> Any | None:
    """The model folder's tokenizer without its weights (None when it has no tokenizer files): what a command needs
    to check text data before any weight loads; ModelError (one line) on damaged files."""
    src = Path(src)
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    if not any((src / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(src, trust_remote_code=trust_remote_code)
    except Exception as e:  # tokenizer backends raise anything on damaged files
        present = ", ".join(n for n in (*names, "merges.txt", "special_tokens_map.json") if (src / n).is_file())
        raise ModelError(f"MODEL {src}: the tokenizer files ({present}) cannot be loaded ({type(e).__name__}: "
                         f"{first_line(e)}); repair them, or use pre-tokenized data (input_ids) without them") from None


def rotary_dim(config: Any) -> int:
    """Channels of each head that RoPE rotates (partial rotary models rotate only the first ones)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None)
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None and isinstance(rope, dict):
        factor = rope.get("partial_rotary_factor")
    return int(head_dim * (factor or 1.0))


def resolve_skip_layers(spec: tuple, config: Any, layers: list[int]) -> list[int]:
    """Layer indices a recipe's `skip_layers` names: indices as given, `sliding_window` from the config's
    layer types (or every layer when the whole model slides). Errors name what does not exist."""
    out: set[int] = set()
    for item in spec:
        if item == "sliding_window":
            from calib.model.layer_kinds import layer_kinds

            with raising(ModelError, geometry.GeometryError):
                sliding = list(layer_kinds(config, "MODEL config.json").sliding)
            if not sliding:
                raise ModelError("recipe field 'skip_layers' has sliding_window, but the model has no "
                                 "sliding-window layers; remove it")
            out.update(sliding)
        elif item not in layers:
            raise ModelError(f"recipe field 'skip_layers' has layer {item}, but the model's attention layers are "
                             f"{layers[0]}..{layers[-1]}; remove it")
        else:
            out.add(item)
    return sorted(out)
