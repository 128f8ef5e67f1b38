"""Every bad input ends in one line naming the file/field/layer and what to do, a non-zero exit, no output,
and every input unchanged.

`ROWS` is the source of docs/bad-inputs.md's table (`make bad-input-table` regenerates it; a test below
fails when the document drifts from it). Each row builds its bad input in a temp dir (also the current folder
while it runs) and gives the CLI args of its command; every file the setup made is hashed before and after.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from calib.cli import main
from helpers import overflowing_model
from tiny import fp8_weight_checkpoint, random_sequences, tiny_causal_lm


@dataclass(frozen=True)
class Row:
    input: str                                   # what the user did (the table's column)
    setup: Callable[[Path], list[str]]           # builds the case under a temp dir, returns CLI args
    message: str                                 # substring of the one-line error
    command: str = "calibrate"                   # the kvcalib command the args are given to
    cpu_only: bool = False                       # the case exists only on a machine without CUDA


def _model(tmp: Path, **kw) -> Path:
    path = tmp / "model"
    if not path.exists():
        tiny_causal_lm("llama", **kw).save_pretrained(path)
    return path


def _tokens(tmp: Path, n: int = 12, lo: int = 20, hi: int = 40) -> Path:
    path = tmp / "tokens.jsonl"
    path.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in random_sequences(n, lo=lo, hi=hi)))
    return path


def _base(tmp: Path, model: Path | None = None, data: Path | None = None) -> list[str]:
    return ["--model", str(model or _model(tmp)), "--data", str(data or _tokens(tmp)), "--seq-len", "32",
            "--samples", "8", "--device", "cpu", "--out", str(tmp / "out")]


def _write(tmp: Path, name: str, text: str | bytes) -> Path:
    path = tmp / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _config_only(tmp: Path, config: dict) -> Path:
    path = tmp / "cfgmodel"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def _bin_only(tmp: Path) -> Path:
    """A model whose weights are a pickle `pytorch_model.bin` (what older hub repos ship)."""
    path = tmp / "binmodel"
    model = tiny_causal_lm("llama")
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    return path


def _nan_layer(tmp: Path) -> Path:
    path = tmp / "nanmodel"
    model = tiny_causal_lm("llama")
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight[0, 0] = math.nan
    model.save_pretrained(path)
    return path


def _sharded_missing(tmp: Path) -> Path:
    path = tmp / "sharded"
    tiny_causal_lm("llama").save_pretrained(path, max_shard_size="100KB")
    sorted(path.glob("model-*.safetensors"))[-1].unlink()
    return path


def _corrupt_index(tmp: Path) -> Path:
    path = tmp / "sharded"
    tiny_causal_lm("llama").save_pretrained(path, max_shard_size="100KB")
    (path / "model.safetensors.index.json").write_text("{not json")
    return path


def _yaml_bomb() -> str:
    """441 bytes that expand to ~10^9 strings through anchors and aliases."""
    return "# billion laughs 441 bytes\n" + "\n".join(
        ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
        + [f"{c}: &{c} [" + ", ".join([f"*{p}"] * 9) + "]" for p, c in zip("abcdefgh", "bcdefghi")]) + "\n"


def _edited_config(tmp: Path, **changes) -> Path:
    """The tiny model with config.json fields changed (None removes a field)."""
    path = _model(tmp)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    cfg = {k: v for k, v in cfg.items() if v is not None}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _edited_weights(tmp: Path, edit: Callable[[dict], dict]) -> Path:
    """The tiny model whose model.safetensors holds `edit(tensors)` instead."""
    from safetensors.torch import load_file, save_file

    path = _model(tmp)
    tensors = load_file(path / "model.safetensors")
    save_file(edit(tensors), str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _int8_weights(tensors: dict) -> dict:
    return {k: (v * 100).round().clamp(-127, 127).to(torch.int8) if k.endswith("proj.weight") else v
            for k, v in tensors.items()}


def _hostile_index(tmp: Path, name: str) -> Path:
    path = _model(tmp)
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
    wmap = {k: "model.safetensors" for k in keys}
    wmap[keys[0]] = name
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return path


def _escaping_link(tmp: Path) -> Path:
    path = _model(tmp)
    outside = tmp / "elsewhere.safetensors"
    (path / "model.safetensors").rename(outside)
    (path / "model.safetensors").symlink_to(outside)
    return path


def _patched_header(tmp: Path, patch: Callable[[dict], None]) -> Path:
    """The tiny model with its shard's JSON header rewritten by `patch` (same data bytes)."""
    import struct

    path = _model(tmp)
    raw = (path / "model.safetensors").read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    patch(header)
    new = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])
    return path


def _broken_config(tmp: Path) -> Path:
    path = _model(tmp)
    (path / "config.json").write_text('{"model_type": "llama",')
    return path


def _truncated_shard(tmp: Path) -> Path:
    path = _model(tmp)
    raw = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(raw[: len(raw) // 2])
    return path


def _with_file(tmp: Path, name: str, text: str) -> Path:
    path = _model(tmp)
    (path / name).write_text(text)
    return path


def _chat(tmp: Path, messages: list) -> Path:
    return _write(tmp, "d.jsonl", json.dumps({"messages": messages}) + "\n")


def _fifo(tmp: Path, name: str) -> Path:
    path = tmp / name
    os.mkfifo(path)   # nobody writes to it: a reader that opened it would hang
    return path


def _first_tensor(header: dict) -> dict:
    return header[next(k for k in header if k != "__metadata__")]


def _recipe(tmp: Path, text: str) -> list[str]:
    return [*_base(tmp), "--recipe", str(_write(tmp, "r.yaml", text))]


def _folder(tmp: Path, name: str, files: dict[str, str] | None = None) -> Path:
    path = tmp / name
    path.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {}).items():
        _write(path, rel, text)
    return path


def _stats_file(tmp: Path, name: str) -> Path:
    """A file kvcalib recognises as one of its statistics files (safetensors with a `kvcalib` header)."""
    from safetensors.torch import save_file

    path = tmp / name
    save_file({"stats.x": torch.zeros(1)}, str(path), metadata={"kvcalib": "{}"})
    return path


_HELD: list[int] = []     # lock files held for the duration of one row (closed by run_row)


def _locked_by_another_run(tmp: Path) -> list[str]:
    """Another process is writing OUT: its flock on OUT's lock file is held (a separate open file
    description conflicts exactly as another process's would)."""
    fd = os.open(tmp / ".out.kvcalib-lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"4242\n")
    _HELD.append(fd)
    return _base(tmp)


def _user_file(tmp: Path) -> Path:
    return _write(tmp, "thesis.txt", "years of work\n")


def _lock_planted(tmp: Path, out: str, how: str) -> None:
    """OUT's lock path taken by a link to (`symlink`) or a second name of (`hardlink`) a user's file."""
    lock = tmp / f".{out}.kvcalib-lock"
    (lock.symlink_to if how == "symlink" else lambda target: os.link(target, lock))(_user_file(tmp))


_UNDO: list[Callable[[], None]] = []    # process settings changed for one row (restored by run_row)


def _file_size_limit(limit: int) -> None:
    """Files this process writes may not grow past `limit` bytes while the row's command runs (RLIMIT_FSIZE:
    the write fails with EFBIG, exactly as on a full disk; Python ignores SIGXFSZ)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    _UNDO.append(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard)))


def _full_disk_merge(tmp: Path) -> list[str]:
    args = [str(_real_stats(tmp, "a.safetensors")), str(_real_stats(tmp, "b.safetensors")), "--out",
            str(tmp / "m.safetensors")]
    _file_size_limit(1000)
    return args


def _full_disk_calibrate(tmp: Path) -> list[str]:
    args = _base(tmp)
    _file_size_limit(1000)
    return args


def _export(tmp: Path, out: Path, *extra: str) -> list[str]:
    return ["--stats", str(_stats_file(tmp, "s.safetensors")), "--model", str(_model(tmp)), "--out", str(out), *extra]


def _tune(tmp: Path, out: Path | None = None) -> list[str]:
    data = str(_tokens(tmp))
    held = _write(tmp, "held-out.jsonl", "".join(json.dumps({"input_ids": s}) + "\n"
                                                for s in random_sequences(6, lo=20, hi=40, seed=7)))
    return ["--model", str(_model(tmp)), "--data", data, "--eval-data", str(held), "--samples", "8", "--seq-len", "32",
            "--eval-samples", "4", "--buckets", "32", "--observers", "absmax", "--headrooms", "1.0",
            "--no-plots", "--no-progress", "--out", str(out or tmp / "tuned")]


def _eval(tmp: Path, *extra: str) -> list[str]:
    return ["--model", str(_model(tmp)), "--data", str(_tokens(tmp)), "--samples", "4", "--buckets", "32",
            "--device", "cpu", "--no-plots", "--out", str(tmp / "report"), *extra]


def _plan(tmp: Path, routes: str = "chat: {data: tokens.jsonl, buckets: [32], samples: 4}", *extra: str) -> list[str]:
    """plan's arguments: a routes file of `routes` (YAML lines under `routes:`) beside the tiny model and its data."""
    _tokens(tmp)
    path = _write(tmp, "routes.yaml", "routes:\n" + "".join(f"  {line}\n" for line in routes.splitlines()))
    return ["--routes", str(path), "--model", str(_model(tmp)), "--device", "cpu", "--no-plots", "--no-progress",
            "--out", str(tmp / "plan"), *extra]


def _real_stats(tmp: Path, name: str = "real.safetensors", edit: Callable[[dict, dict], None] | None = None,
                cut: int = 0) -> Path:
    """A statistics file as kvcalib writes it (observers fed random K/V), optionally damaged: `edit(header,
    metadata)` rewrites its safetensors header, `cut` drops trailing bytes."""
    import struct

    from calib.capture import hook as observe, statsfile
    from calib.capture.spec import capture_spec
    from calib.recipe.recipe import Recipe

    cap = observe.KVCapture([0, 1], capture_spec(Recipe(), rotary_dim=16))
    g = torch.Generator().manual_seed(0)
    for i in (0, 1):
        cap.record(i, *(torch.randn(1, h, 4, 16, generator=g) for h in (4, 2, 2)))
    path = statsfile.save(tmp / name, cap, {"producer": "kvcalib", "model_config_sha256": "sha256:x",
                                            "rotary_dim": 16, "recipe": Recipe().to_dict(), "data": {}})
    raw = path.read_bytes()
    if edit is not None:
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        edit(header, header["__metadata__"])
        text = json.dumps(header).encode()
        raw = struct.pack("<Q", len(text)) + text + raw[8 + n:]
    path.write_bytes(raw[:len(raw) - cut])
    return path


def _header_field(**fields) -> Callable[[dict, dict], None]:
    def edit(header: dict, meta: dict) -> None:
        meta["kvcalib"] = json.dumps({**json.loads(meta["kvcalib"]), **fields})
    return edit


def _doubled_range(header: dict, meta: dict) -> None:
    """Point the stored k_amax of layer 0 at the v_amax bytes (another value), checksum removed."""
    from calib.capture import statsfile

    meta.pop(statsfile.CHECKSUM)
    k, v = header["stats.layers.0.k_amax"], header["stats.layers.0.v_amax"]
    k["data_offsets"], v["data_offsets"] = v["data_offsets"], k["data_offsets"]


def _exported(tmp: Path, target: str = "vllm", edit: Callable[[Path], None] | None = None) -> Path:
    """The tiny model exported with made-up scales (no calibration), then `edit`ed."""
    from calib import export
    from calib.export import trtllm
    from calib.scales.fold import LayerScales

    scales = {i: LayerScales(torch.tensor(0.1), torch.tensor(0.1), torch.ones(2), torch.ones(2)) for i in range(3)}
    out = tmp / f"ckpt-{target}"
    (export.export_vllm if target == "vllm" else trtllm.export_trtllm)(_model(tmp), out, scales, {"producer": "kvcalib"})
    if edit is not None:
        edit(out)
    return out


def _set_json(name: str, value) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        (folder / name).write_text(value if isinstance(value, str) else json.dumps(value))
    return edit


def _with_qc(qc) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg["quantization_config"] = qc
        (folder / "config.json").write_text(json.dumps(cfg))
    return edit


def _renamed_scale(old: str, new: str) -> Callable[[Path], None]:
    """An exported checkpoint's scale tensor `old` stored under `new` (the index follows)."""
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "kv_scales.safetensors")
        tensors[new] = tensors.pop(old)
        save_file(tensors, str(folder / "kv_scales.safetensors"))
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        index["weight_map"][new] = index["weight_map"].pop(old)
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return edit


def _scale_value(name: str, value: float) -> Callable[[Path], None]:
    """An exported checkpoint whose scale tensor `name` holds `value`."""
    def edit(folder: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / "kv_scales.safetensors")
        tensors[name] = torch.tensor(value, dtype=torch.float32)
        save_file(tensors, str(folder / "kv_scales.safetensors"))
    return edit


def _other_fp8(tmp: Path, **config) -> Path:
    """A weight-quantized (FP8) checkpoint of another model of the llama architecture (another seed, `config`)."""
    other = tmp / "other"
    tiny_causal_lm("llama", seed=1, **config).save_pretrained(other)
    return fp8_weight_checkpoint(other, tmp / "other-fp8")


def _stats_on_weights(tmp: Path, name: str, seed: int) -> Path:
    """A statistics file of the tiny model's config.json recorded on the weights of the tiny model of `seed`
    (its header rewritten, checksum dropped as older files have none)."""
    from calib.capture import statsfile
    from calib.ckpt import fingerprint

    other = tmp / f"weights-{seed}"
    if not other.exists():
        tiny_causal_lm("llama", seed=seed).save_pretrained(other)

    def edit(header: dict, meta: dict) -> None:
        meta.pop(statsfile.CHECKSUM)
        meta["kvcalib"] = json.dumps({**json.loads(meta["kvcalib"]),
                                      "model_config_sha256": statsfile.config_sha256(_model(tmp)),
                                      "model_weights_sha256": fingerprint.weights_sha256(other)})
    return _real_stats(tmp, name, edit=edit)


def _resume_after_data_changed(tmp: Path) -> list[str]:
    """A run saved after its first batch and killed in its second; then DATA changes under the same name."""
    from calib.capture import hook as observe

    args = [*_base(tmp), "--checkpoint-every", "1", "--target", ""]
    real, calls = observe.KVCapture.record, [0]

    def failing(self, *a, **k):
        calls[0] += 1
        if calls[0] > 3:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    observe.KVCapture.record = failing
    try:
        r = CliRunner().invoke(main, ["calibrate", *args])
    finally:
        observe.KVCapture.record = real
    assert outputs_resume(tmp / "out").is_file(), r.output
    data = tmp / "tokens.jsonl"
    records = [json.loads(ln) for ln in data.read_text().splitlines()]
    for r in records:                       # the first token of every record: the saved batch reads another text
        r["input_ids"][0] = (r["input_ids"][0] + 1) % 257
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    return [*args, "--resume"]


def outputs_resume(out: Path) -> Path:
    from calib.safety import outputs
    return outputs.resume_path(out)


def _twice(tmp: Path, how: str) -> list[str]:
    """merge's arguments: one statistics file, then the same file again (as written, a symlink, a hard link)."""
    first = _real_stats(tmp, "a.safetensors")
    second = tmp / "b.safetensors"
    if how == "symlink":
        second.symlink_to(first)
    elif how == "hardlink":
        os.link(first, second)
    else:
        second = first
    return [str(first), str(second), "--out", str(tmp / "m.safetensors")]


def _resume_damaged(tmp: Path) -> list[str]:
    out = tmp / "out"
    _real_stats(tmp, "out.kvcalib-resume.safetensors", cut=5)
    return [*_base(tmp), "--out", str(out), "--checkpoint-every", "1", "--resume"]


ROWS = [
    Row("MODEL path does not exist", lambda t: [*_base(t), "--model", "./no-such-model"],
        "MODEL ./no-such-model not found"),
    Row("MODEL folder without config.json", lambda t: [*_base(t), "--model", str(t)], "has no config.json"),
    Row("MODEL with only pickle .bin weights", lambda t: _base(t, _bin_only(t)), "no .safetensors weights"),
    Row("MODEL with an MLA cache (DeepSeek-V3)", lambda t: _base(t, _config_only(t, {"model_type": "deepseek_v3"})),
        "multi-head latent attention"),
    Row("MODEL with state-space layers (Mamba)", lambda t: _base(t, _config_only(t, {"model_type": "mamba"})),
        "not plain K/V"),
    Row("MODEL with NaN weights in one layer", lambda t: _base(t, _nan_layer(t)), "layer 1: K holds NaN/Inf"),
    Row("MODEL config: heads not divisible by KV heads", lambda t: _base(t, _edited_config(t, num_key_value_heads=3)),
        "'num_attention_heads' = 4 is not a multiple of 'num_key_value_heads' = 3"),
    Row("MODEL config: zero attention heads", lambda t: _base(t, _edited_config(t, num_attention_heads=0)),
        "'num_attention_heads' = 0 must be a positive integer"),
    Row("MODEL config: hidden_size not divisible by heads, no head_dim",
        lambda t: _base(t, _edited_config(t, hidden_size=66, head_dim=None)),
        "'hidden_size' = 66 is not divisible by 'num_attention_heads' = 4"),
    Row("MODEL config: layer_types disagrees with num_hidden_layers",
        lambda t: _base(t, _edited_config(t, layer_types=["full_attention"] * 2)),
        "'layer_types' has 2 entries but 'num_hidden_layers' = 3"),
    Row("MODEL config: a size beyond any real model", lambda t: _base(t, _edited_config(t, hidden_size=10**9)),
        "'hidden_size' = 1000000000 is beyond any real model"),
    Row("MODEL config.json is not JSON", lambda t: _base(t, _broken_config(t)),
        "config.json is not valid JSON (line 1"),
    Row("MODEL config has more layers than the weights", lambda t: _base(t, _edited_config(t, num_hidden_layers=4)),
        "config.json describes 164,480 parameters but the weight files hold 143,936"),
    Row("MODEL weights lack a tensor the config needs", lambda t: _base(t, _edited_weights(
        t, lambda ts: {k.replace("layers.2.mlp.up_proj", "layers.2.mlp.upp_proj"): v for k, v in ts.items()})),
        "the weight files lack 1 tensor(s) config.json needs (layers.2.mlp.up_proj.weight)"),
    Row("MODEL weight of another shape than the config", lambda t: _base(t, _edited_weights(
        t, lambda ts: {k: v.T.contiguous() if k.endswith("layers.1.mlp.up_proj.weight") else v for k, v in ts.items()})),
        "have another shape than config.json implies (layers.1.mlp.up_proj.weight"),
    Row("MODEL config's hidden_size differs from the weights",
        lambda t: _base(t, _edited_config(t, hidden_size=128, head_dim=32, intermediate_size=256)),
        "config.json describes"),
    Row("MODEL weight file holds no model tensors", lambda t: _base(t, _edited_weights(
        t, lambda ts: {"unrelated.weight": torch.zeros(4)})), "config.json describes"),
    Row("MODEL weights hold an extra tensor", lambda t: _base(t, _edited_weights(
        t, lambda ts: {**ts, "layers.0.self_attn.extra.weight": torch.zeros(4)})),
        "does not have (layers.0.self_attn.extra.weight)"),
    Row("MODEL int8 weights without a quantization_config", lambda t: _base(t, _edited_weights(t, _int8_weights)),
        "hold I8 values"),
    Row("MODEL index names a file outside the folder (..)", lambda t: _base(t, _hostile_index(t, "../../../../etc/passwd")),
        "leaves the model folder"),
    Row("MODEL index names an absolute path", lambda t: _base(t, _hostile_index(t, "/etc/passwd")),
        "leaves the model folder"),
    Row("MODEL shard is a symlink out of the folder", lambda t: _base(t, _escaping_link(t)), "outside the model folder"),
    Row("MODEL shard header offsets past the end of the file", lambda t: _base(t, _patched_header(
        t, lambda h: _first_tensor(h).update(data_offsets=[0, 10**9]))), "the file is corrupt"),
    Row("MODEL shard header with an unknown dtype", lambda t: _base(t, _patched_header(
        t, lambda h: _first_tensor(h).update(dtype="F128"))), "unknown dtype 'F128'"),
    Row("MODEL shard truncated", lambda t: _base(t, _truncated_shard(t)), "truncated"),
    Row("MODEL tokenizer.json is not JSON", lambda t: _base(t, _with_file(t, "tokenizer.json", "{")),
        "tokenizer.json is not valid JSON"),
    Row("MODEL index names a missing shard", lambda t: _base(t, _sharded_missing(t)), "names shard(s)"),
    Row("MODEL index is not valid JSON", lambda t: _base(t, _corrupt_index(t)), "not a valid safetensors index"),
    Row("DATA path does not exist", lambda t: [*_base(t), "--data", "./missing.jsonl"], "DATA ./missing.jsonl not found"),
    Row("DATA file is empty", lambda t: _base(t, data=_write(t, "empty.jsonl", "")), "the source holds no records"),
    Row("DATA has no usable column", lambda t: _base(t, data=_write(t, "d.jsonl", '{"body": "x"}\n')),
        "no usable column"),
    Row("DATA samples all shorter than min_tokens", lambda t: _base(t, data=_tokens(t, lo=3, hi=5)),
        "shorter than min_tokens=16"),
    Row("DATA file is not UTF-8", lambda t: _base(t, data=_write(t, "d.jsonl", b"\xff\xfe\x00bad\n")), "not UTF-8"),
    Row("DATA mixes formats", lambda t: _base(t, data=_write(
        t, "d.jsonl", "".join(json.dumps({"input_ids": list(range(20))}) + "\n" for _ in range(3)) + '{"text": "hi"}\n')),
        "all records of a DATA source must share one format"),
    Row("DATA chat: empty conversation", lambda t: _base(t, data=_chat(t, [])), "d.jsonl:1: empty conversation"),
    Row("DATA chat: message without content", lambda t: _base(t, data=_chat(t, [
        {"role": "user", "content": "hi"}, {"role": "assistant"}])), "d.jsonl:1: message 1 (assistant) has no content"),
    Row("DATA chat: content part with null text", lambda t: _base(t, data=_chat(t, [
        {"role": "user", "content": [{"type": "text", "text": None}]}])),
        "d.jsonl:1: message 0 (user) part 0 (text) has null text"),
    Row("DATA chat: message holding only image parts", lambda t: _base(t, data=_chat(t, [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}])),
        "has only image_url parts and no text"),
    Row("DATA chat: content part of an unknown type", lambda t: _base(t, data=_chat(t, [
        {"role": "user", "content": [{"type": "hologram", "data": 1}]}])), "part 0 has type 'hologram'"),
    Row("DATA text is null", lambda t: _base(t, data=_write(t, "d.jsonl", '{"text": null}\n')),
        "d.jsonl:1: 'text' is null"),
    Row("DATA is a pipe in a format that needs seeking", lambda t: _base(t, data=_fifo(t, "d.parquet")),
        "is a pipe, and '.parquet' needs a seekable file"),
    Row("DATA text holds a lone surrogate (JSON \\ud800)", lambda t: _base(t, data=_write(
        t, "d.jsonl", '{"text": "the cat \\ud800 sat"}\n')), "d.jsonl:1: the text holds a lone surrogate (U+D800"),
    Row("DATA line is not JSON", lambda t: _base(t, data=_write(t, "d.jsonl", "{oops\n")), "not valid JSON"),
    Row("DATA token ids beyond the vocabulary", lambda t: _base(t, data=_write(
        t, "d.jsonl", json.dumps({"input_ids": [5] * 19 + [99999]}) + "\n")), "token id out of range"),
    Row("DATA is text but the model has no tokenizer", lambda t: _base(t, data=_write(
        t, "d.jsonl", json.dumps({"text": "some words " * 20}) + "\n")), "the model has no tokenizer"),
    Row("SEQ_LEN larger than the model's context", lambda t: [*_base(t), "--seq-len", "4096"],
        "exceeds the model's context"),
    Row("SAMPLES 0", lambda t: [*_base(t), "--samples", "0"], "'samples' = 0"),
    Row("SAMPLES negative", lambda t: [*_base(t), "--samples", "-3"], "'samples' = -3"),
    Row("RECIPE with an unknown key", lambda t: _recipe(t, "headrom: 2\n"), "unknown field(s) 'headrom'"),
    Row("RECIPE field of the wrong type", lambda t: _recipe(t, "batch_size: four\n"), "has the wrong type"),
    Row("RECIPE asks INT8 for vLLM", lambda t: _recipe(t, "dtype: int8\n"), "vLLM has no static INT8 KV cache"),
    Row("RECIPE exports a statistics-only granularity", lambda t: _recipe(t, "granularity: channel\n"),
        "cannot be exported"),
    Row("RECIPE is a YAML bomb (anchors and aliases)", lambda t: _recipe(t, _yaml_bomb()),
        "anchors and aliases are not allowed"),
    Row("RECIPE repeats a key", lambda t: _recipe(t, "headroom: 2\nsamples: 8\nheadroom: 1\n"),
        "line 3: duplicate key 'headroom'"),
    Row("RECIPE observer parameter out of bounds", lambda t: _recipe(t, "observer: mse\nobserver_params: {grid: 1000000000}\n"),
        "'observer_params.grid' = 1000000000: must be an integer in [2, 4096]"),
    Row("RECIPE skips a layer the model lacks", lambda t: [*_base(t), "--skip-layers", "7"], "has layer 7"),
    Row("OUT already exists", lambda t: [*_base(t), "--out", str(_folder(t, "old"))], "already exists; pass --force"),
    Row("OUT inside a path that is a file", lambda t: [*_base(t), "--out", str(_write(t, "f", "x") / "out")],
        "is a file, not a directory"),
    # where outputs go: --force replaces only a previous kvcalib output, never an input or other files
    Row("OUT --force: a folder holding the model and the data", lambda t: [*_base(
        t, _model(_folder(t, "proj")), _tokens(t / "proj")), "--out", str(t / "proj"), "--force"],
        "contains the model folder"),
    Row("OUT --force: a folder of other files", lambda t: [*_base(t), "--out", str(_folder(
        t, "docs", {"notes.txt": "mine"})), "--force"], "holds files kvcalib did not write (notes.txt)"),
    Row("OUT --force: a kvcalib output the user added a file to", lambda t: [*_base(t), "--out", str(_folder(
        t, "prev", {".kvcalib-output.json": json.dumps({"producer": "kvcalib", "files": ["a.json"]}),
                    "a.json": "{}", "notes.txt": "mine"})), "--force"], "holds files kvcalib did not write (notes.txt)"),
    Row("OUT is the current folder", lambda t: [*_base(t), "--out", ".", "--force"], "is the current folder"),
    Row("OUT is a parent of the current folder", lambda t: [*_base(t), "--out", "..", "--force"],
        "holds the current folder"),
    Row("OUT is the model folder", lambda t: [*_base(t), "--out", str(_model(t)), "--force"], "is the model folder"),
    Row("OUT inside the model folder", lambda t: [*_base(t), "--out", str(_model(t) / "kv")], "is inside the model folder"),
    Row("OUT --force: a folder holding the recipe", lambda t: [
        *_base(t), "--recipe", str(_write(_folder(t, "proj"), "r.yaml", "samples: 8\n")), "--out", str(t / "proj"),
        "--force"], "contains the recipe"),
    Row("OUT inside the DATA folder", lambda t: [*_base(t), "--data", str(_folder(t, "corpus", {
        "a.jsonl": _tokens(t).read_text()})), "--out", str(t / "corpus" / "out")], "is inside the data"),
    Row("OUT is being written by another run", _locked_by_another_run, "another kvcalib run (pid 4242) is writing"),
    # nothing is written through a link: the pid once went into whatever file the lock path pointed to
    Row("OUT's lock path is a link to another file", lambda t: _base(t) if _lock_planted(t, "out", "symlink") is None
        else [], ".out.kvcalib-lock is a symbolic link where kvcalib writes"),
    Row("OUT's lock path is a second name of another file (hard link)", lambda t: _base(t) if _lock_planted(
        t, "out", "hardlink") is None else [], ".out.kvcalib-lock is a file with 2 hard links"),
    Row("merge --out's lock path is a link to another file", lambda t: [
        str(_real_stats(t, "a.safetensors")), str(_real_stats(t, "b.safetensors")), "--out", str(t / "m.safetensors")]
        if _lock_planted(t, "m.safetensors", "symlink") is None else [],
        ".m.safetensors.kvcalib-lock is a symbolic link where kvcalib writes", command="merge"),
    # a full disk (a file-size limit) while writing: one line, nothing left
    Row("OUT's disk fills while the checkpoint is written", _full_disk_calibrate,
        "writing failed (File too large); nothing was written"),
    Row("merge --out's disk fills while writing", _full_disk_merge,
        "writing failed (File too large); nothing was written", command="merge"),
    Row("--stats-out over the model's weights", lambda t: [
        *_base(t), "--stats-out", str(_model(t) / "model.safetensors")], "is inside the model folder"),
    Row("--stats-out over a file kvcalib did not write", lambda t: [
        *_base(t), "--stats-out", str(_write(t, "notes.safetensors", b"not ours"))], "is a file kvcalib did not write"),
    Row("--stats-out over the DATA file", lambda t: [*_base(t), "--stats-out", str(_tokens(t))], "is the data"),
    Row("--stats-out over a statistics file, no --force", lambda t: [
        *_base(t), "--stats-out", str(_stats_file(t, "old.safetensors"))], "already exists; pass --force"),
    Row("--stats-out inside OUT", lambda t: [*_base(t), "--stats-out", str(t / "out" / "s.safetensors")],
        "is inside the --out folder"),
    Row("resume file is a file kvcalib did not write", lambda t: [
        *_base(t), "--checkpoint-every", "2", "--stats-out", str(t / "s.safetensors")] if _write(
        t, "out.kvcalib-resume.safetensors", "x") else [], "is a file kvcalib did not write"),
    Row("--offload-folder is the model folder", lambda t: [
        *_base(t), "--device-map", "auto", "--offload-folder", str(_model(t))], "is the model folder"),
    # options, before any model loads
    Row("--device not a device name", lambda t: [*_base(t), "--device", "gpu0"], "'gpu0' is not a device name"),
    Row("--device cuda without a CUDA GPU", lambda t: [*_base(t), "--device", "cuda"], "torch sees no CUDA GPU",
        cpu_only=True),
    Row("--device-map cuda:0 without a CUDA GPU", lambda t: [*_base(t), "--device-map", "cuda:0"],
        "--device-map cuda:0: torch sees no CUDA GPU", cpu_only=True),
    Row("--max-memory names a GPU without a CUDA GPU", lambda t: [*_base(t), "--device-map", "auto", "--max-memory",
        "0=1GiB,cpu=8GiB"], "--max-memory cuda:0: torch sees no CUDA GPU", cpu_only=True),
    Row("--device meta", lambda t: [*_base(t), "--device", "meta"], "runs models on cpu, cuda or mps"),
    Row("--batch-size 0", lambda t: [*_base(t), "--batch-size", "0"], "'batch_size' = 0"),
    Row("--max-batch-tokens 0", lambda t: [*_base(t), "--max-batch-tokens", "0"],
        "--max-batch-tokens = 0: expected a whole"),
    Row("--max-batch-tokens below --seq-len", lambda t: [*_base(t), "--max-batch-tokens", "16"],
        "is below --seq-len 32"),
    Row("--checkpoint-every 0", lambda t: [*_base(t), "--checkpoint-every", "0"],
        "--checkpoint-every = 0: expected a whole"),
    # merge, export, eval
    Row("merge --out over a file kvcalib did not write", lambda t: [
        str(_stats_file(t, "a.safetensors")), str(_stats_file(t, "b.safetensors")), "--out",
        str(_write(t, "notes.txt", "mine")), "--force"], "is a file kvcalib did not write", command="merge"),
    Row("merge --out is one of its inputs", lambda t: [
        str(_stats_file(t, "a.safetensors")), str(_stats_file(t, "b.safetensors")), "--out", str(t / "a.safetensors"),
        "--force"], "is an input statistics file", command="merge"),
    Row("merge --out inside a model folder", lambda t: [
        str(_stats_file(t, "a.safetensors")), str(_stats_file(t, "b.safetensors")), "--out",
        str(_model(t) / "m.safetensors")], "is inside a model checkpoint folder", command="merge"),
    Row("export --out --force: a folder of other files", lambda t: _export(
        t, _folder(t, "docs", {"notes.txt": "mine"}), "--force"), "holds files kvcalib did not write", command="export"),
    Row("export --out holds the statistics file", lambda t: [
        "--stats", str(_stats_file(_folder(t, "runs"), "s.safetensors")), "--model", str(_model(t)), "--out",
        str(t / "runs"), "--force"], "contains the statistics file", command="export"),
    Row("eval --out inside the model folder", lambda t: [*_eval(t), "--out", str(_model(t) / "report")],
        "is inside the model folder", command="eval"),
    Row("eval --out --force: a --scales checkpoint", lambda t: [
        *_eval(t), "--scales", str(_folder(t, "ckpt", {"config.json": "{}"})), "--out", str(t / "ckpt"), "--force"],
        "is a --scales checkpoint", command="eval"),
    Row("eval --samples 0", lambda t: [*_eval(t), "--samples", "0"], "--samples = 0: expected a whole number",
        command="eval"),
    Row("eval --dominance below 1", lambda t: [*_eval(t), "--dominance", "0.5"],
        "--dominance = 0.5: expected a finite number >= 1", command="eval"),
    Row("eval --device not a device name", lambda t: [*_eval(t), "--device", "gpu"], "'gpu' is not a device name",
        command="eval"),
    Row("eval --engine vllm without --vllm-venv", lambda t: [*_eval(t), "--engine", "vllm"],
        "--engine vllm needs --vllm-venv PATH", command="eval"),
    Row("eval --engine-timeout nan", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t),
        "--engine-timeout", "nan"], "--engine-timeout = nan: expected a finite number in [1, ", command="eval"),
    Row("eval --engine-timeout negative", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t),
        "--engine-timeout", "-5"], "--engine-timeout = -5.0: expected a finite number in [1, ", command="eval"),
    Row("eval --engine-timeout inf", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t),
        "--engine-timeout", "inf"], "--engine-timeout = inf: expected a finite number in [1, ", command="eval"),
    Row("eval --vllm-venv not a virtual environment", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t)],
        "no bin/python there", command="eval"),
    # files kvcalib parses: statistics, resume, other tools' configs, kvcalib.json
    Row("STATS file truncated", lambda t: [
        "--stats", str(_real_stats(t, cut=9)), "--model", str(_model(t)), "--out", str(t / "o")],
        "the file is truncated", command="export"),
    Row("STATS file edited after writing", lambda t: [
        "--stats", str(_real_stats(t, edit=_header_field(model="other"))), "--model", str(_model(t)), "--out",
        str(t / "o")], "does not match its checksum", command="export"),
    Row("STATS ranges that disagree with the observer states", lambda t: [
        "--stats", str(_real_stats(t, edit=_doubled_range)), "--model", str(_model(t)), "--out", str(t / "o")],
        "disagrees with the observer states", command="export"),
    Row("STATS header with an unbounded recipe", lambda t: [
        "--stats", str(_real_stats(t, edit=_header_field(recipe={"observer": "mse", "observer_params": {
            "grid": 10**9}}))), "--model", str(_model(t)), "--out", str(t / "o")],
        "'observer_params.grid' = 1000000000", command="export"),
    Row("STATS header layers not a list", lambda t: [
        str(_real_stats(t, edit=_header_field(layers="all"))), str(_real_stats(t, "b.safetensors")), "--out",
        str(t / "m.safetensors")], "field 'layers' must list", command="merge"),
    Row("STATS is a model's weights file", lambda t: [
        str(_model(t) / "model.safetensors"), str(_real_stats(t)), "--out", str(t / "m.safetensors")],
        "no kvcalib header", command="merge"),
    Row("RESUME file damaged", _resume_damaged, "--resume: the saved state"),
    Row("CKPT kvcalib.json is not an object", lambda t: [str(_exported(t, edit=_set_json("kvcalib.json", "[]")))],
        "kvcalib.json: must hold a JSON object", command="inspect"),
    Row("CKPT kvcalib.json field of the wrong kind", lambda t: [str(_exported(
        t, edit=_set_json("kvcalib.json", {"skipped_layers": "1,2"})))], "field 'skipped_layers' must list layer",
        command="inspect"),
    Row("CKPT kv_cache_scheme is not an object", lambda t: [str(_exported(
        t, edit=_with_qc({"quant_method": "compressed-tensors", "kv_cache_scheme": [8]})))],
        "kv_cache_scheme must be an object", command="inspect"),
    Row("CKPT hf_quant_config.json is not JSON", lambda t: [str(_exported(
        t, "trtllm", _set_json("hf_quant_config.json", "{")))], "hf_quant_config.json is not valid JSON",
        command="inspect"),
    Row("eval --scales checkpoint with a damaged kvcalib.json", lambda t: [
        *_eval(t), "--scales", str(_exported(t, edit=_set_json("kvcalib.json", '{"producer": "kvcalib",')))],
        "kvcalib.json is not valid JSON", command="eval"),
    Row("--into checkpoint whose quantization_config is a list", lambda t: [
        *_base(t), "--into", str(_exported(t, edit=_with_qc(["fp8"])))], "quantization_config must be an object"),
    Row("tune --max-skip beyond the model's layers", lambda t: [*_tune(t), "--max-skip", "64"], "the model has",
        command="tune"),
    Row("tune --target trtllm with layer skips", lambda t: [*_tune(t), "--target", "trtllm", "--max-skip", "1"],
        "TensorRT-LLM applies one KV dtype to every layer", command="tune"),
    Row("tune --observers with an unknown observer", lambda t: [*_tune(t), "--observers", "absmax,histogram"],
        "unknown observer 'histogram'", command="tune"),
    Row("tune --headrooms below 1", lambda t: [*_tune(t), "--headrooms", "0.5"], "must be a number >= 1",
        command="tune"),
    Row("tune --stats and --stats-dir together", lambda t: [*_tune(t), "--stats", str(_stats_file(t, "s.safetensors")),
        "--stats-dir", str(t / "new")], "--stats-dir with --stats", command="tune"),
    Row("tune --eval-data missing", lambda t: [*_tune(t), "--eval-data", str(t / "held.jsonl")], "held.jsonl",
        command="tune"),
    Row("tune OUT holds other files, --force", lambda t: [*_tune(t, _folder(t, "docs", {"notes.txt": "mine"})),
        "--force"], "holds files kvcalib did not write", command="tune"),
    Row("tune OUT inside the model folder", lambda t: [*_tune(t, _model(t) / "tuned")], "inside the model",
        command="tune"),
    Row("eval --scales checkpoint whose scale name no engine maps (layer '01')", lambda t: [*_eval(t), "--scales", str(
        _exported(t, edit=_renamed_scale("model.layers.1.self_attn.k_scale", "model.layers.01.self_attn.k_scale")))],
        "layer index '01' has a leading zero", command="eval"),
    Row("eval --scales checkpoint whose scale sits under another attention module", lambda t: [*_eval(t), "--scales",
        str(_exported(t, edit=_renamed_scale("model.layers.0.self_attn.v_scale", "model.layers.0.attn.v_scale")))],
        "no engine loads it as a KV scale", command="eval"),
    Row("merge the same statistics file twice", lambda t: _twice(t, "path"), "are the same path: merging it twice",
        command="merge"),
    Row("merge a statistics file and a symlink to it", lambda t: _twice(t, "symlink"),
        "are one file (through a link): merging it twice", command="merge"),
    Row("merge a statistics file and a hard link to it", lambda t: _twice(t, "hardlink"),
        "are one file (through a link): merging it twice", command="merge"),
    Row("--into a checkpoint of another model (same architecture and sizes, other weights)", lambda t: [
        *_base(t), "--into", str(_other_fp8(t))], "holds other weights than"),
    Row("--into a checkpoint of another model (other intermediate_size and vocab)", lambda t: [
        *_base(t), "--into", str(_other_fp8(t, intermediate_size=96, vocab_size=300))],
        "intermediate_size, vocab_size differ"),
    Row("export --stats recorded on another model (same config.json, other weights)", lambda t: [
        "--stats", str(_stats_on_weights(t, "s.safetensors", 1)), "--model", str(_model(t)), "--out", str(t / "o")],
        "was recorded on other weights than --model", command="export"),
    Row("merge statistics of two models (same config.json, other weights)", lambda t: [
        str(_stats_on_weights(t, "a.safetensors", 1)), str(_stats_on_weights(t, "b.safetensors", 2)), "--out",
        str(t / "m.safetensors")], "was recorded on other weights than", command="merge"),
    Row("tune --stats recorded on another model (same config.json, other weights)", lambda t: [
        *_tune(t), "--stats", str(_stats_on_weights(t, "s.safetensors", 1))], "was recorded on other weights than --model",
        command="tune"),
    Row("--resume after DATA changed under the same name", _resume_after_data_changed,
        "was saved from other batches than this run's first"),
    Row("tune --eval-data equal to --data", lambda t: [*_tune(t), "--eval-data", str(_tokens(t))],
        "is the calibration --data", command="tune"),
    Row("eval of a model whose logits overflow (NaN/inf numbers)", lambda t: [*_eval(overflowing_model(t, "model").parent)],
        "cannot measure: `fp32` (the reference) bucket <= 32", command="eval"),
    # every input of every command, plan's included (issue 38)
    Row("plan --out --force: a --scales checkpoint (a kvcalib output)", lambda t: [
        *_plan(t), "--scales", str(_exported(t)), "--out", str(t / "ckpt-vllm"), "--force"],
        "is a --scales checkpoint", command="plan"),
    Row("plan --out --force: a route's data folder", lambda t: [
        *_plan(t, "chat: {data: held, buckets: [32]}"), "--out", str(_folder(t, "held", {"a.jsonl": "{}\n"})),
        "--force"], "is route 'chat' data", command="plan"),
    Row("plan --out inside a --scales checkpoint", lambda t: [
        *_plan(t), "--scales", str(_exported(t)), "--out", str(t / "ckpt-vllm" / "plan")],
        "is inside a --scales checkpoint", command="plan"),
    Row("plan route named like the plan's own file (plan.json)", lambda t: _plan(
        t, "chat: {data: tokens.jsonl, buckets: [32]}\nplan.json: {data: tokens.jsonl, buckets: [32]}"),
        "route name 'plan.json' is the plan's own file", command="plan"),
    Row("plan routes whose names differ only in case", lambda t: _plan(
        t, "chat: {data: tokens.jsonl, buckets: [32]}\nCHAT: {data: tokens.jsonl, buckets: [32]}"),
        "differ only in case", command="plan"),
    Row("plan route data under ~nosuchuser/", lambda t: _plan(t, "chat: {data: '~nosuchuser/d.jsonl', buckets: [32]}"),
        "~nosuchuser/d.jsonl: no user 'nosuchuser' on this machine", command="plan"),
    Row("plan a second route beyond the model's context", lambda t: _plan(
        t, "chat: {data: tokens.jsonl, buckets: [32]}\nlong: {data: tokens.jsonl, buckets: [100000]}"),
        "route 'long': --buckets 100000: longer than the context", command="plan"),
    Row("plan a second route whose records are all shorter than min_tokens", lambda t: _plan(
        t, "chat: {data: tokens.jsonl, buckets: [32]}\nshort: {data: short.jsonl, buckets: [32]}") if _write(
        t, "short.jsonl", '{"input_ids": [1, 2, 3]}\n' * 4) else [],
        "route 'short': DATA", command="plan"),
    Row("plan one route whose records are all shorter than min_tokens", lambda t: _plan(
        t, "chat: {data: short.jsonl, buckets: [32], pack: false}") if _write(
        t, "short.jsonl", '{"input_ids": [1, 2]}\n' * 64) else [],
        "route 'chat': DATA", command="plan"),
    Row("eval --data under ~nosuchuser/", lambda t: [*_eval(t), "--data", "~nosuchuser/d.jsonl"],
        "the data ~nosuchuser/d.jsonl: no user 'nosuchuser' on this machine", command="eval"),
    Row("eval --out under ~nosuchuser/", lambda t: [*_eval(t), "--out", "~nosuchuser/report"],
        "--out ~nosuchuser/report: no user 'nosuchuser' on this machine", command="eval"),
    Row("calibrate --model under ~nosuchuser/", lambda t: [*_base(t), "--model", "~nosuchuser/m"],
        "MODEL ~nosuchuser/m: no user 'nosuchuser'"),
    # numeric options: finite and within range at the edge, for every command (issue 38 item 5)
    Row("eval --budget-minutes inf", lambda t: [*_eval(t), "--budget-minutes", "inf"],
        "--budget-minutes = inf: expected a finite number > 0", command="eval"),
    Row("eval --budget-minutes 1e308", lambda t: [*_eval(t), "--budget-minutes", "1e308"],
        "--budget-minutes = 1e+308: expected a finite number > 0 and <= 527040", command="eval"),
    Row("eval --emulate-up-to below every bucket", lambda t: [*_eval(t), "--buckets", "32,64", "--emulate-up-to", "16"],
        "--emulate-up-to 16 is below every bucket (32, 64)", command="eval"),
    Row("eval --emulate-up-to below every bucket that holds samples", lambda t: [
        *_eval(t, "--buckets", "16,64", "--emulate-up-to", "16")],
        "--emulate-up-to 16: no held-out sample lies in a bucket of at most 16 tokens", command="eval"),
    Row("eval --engine-kv-gib beyond any machine", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t),
        "--engine-kv-gib", str(1 << 40)], "--engine-kv-gib = 1099511627776: expected a whole number in [1, ",
        command="eval"),
    Row("eval --engine-timeout 1e308", lambda t: [*_eval(t), "--engine", "vllm", "--vllm-venv", str(t),
        "--engine-timeout", "1e308"], "--engine-timeout = 1e+308: expected a finite number in [1, ", command="eval"),
    Row("tune --budget-minutes inf", lambda t: [*_tune(t), "--budget-minutes", "inf"],
        "--budget-minutes = inf: expected a finite number > 0", command="tune"),
    Row("tune --buckets longer than the model's context", lambda t: [*_tune(t), "--buckets", "32,100000"],
        "--buckets 100000: longer than the context of MODEL", command="tune"),
    Row("plan --passkey-trials beyond any run", lambda t: [*_plan(t), "--passkey-trials", str(1 << 40)],
        "--passkey-trials = 1099511627776: expected a whole number in [0, ", command="plan"),
    # --engine-version: one grammar for every command; scales the engines cannot use (issue 38 item 6)
    Row("--engine-version with a garbage suffix", lambda t: [*_base(t), "--engine-version", "vllm=0.34garbage"],
        "engine version '0.34garbage': give numbers"),
    Row("--engine-version given twice for one engine", lambda t: [*_base(t), "--engine-version", "vllm=0.32,vllm=0.33"],
        "vllm is given twice"),
    Row("--engine-version for an engine that is not a target", lambda t: [*_base(t), "--engine-version",
        "sglang=0.5.18"], "sglang is not a target here (vllm)"),
    Row("eval --engine-version of another engine than --target", lambda t: [*_eval(t), "--target", "sglang",
        "--engine-version", "vllm=0.32"], "--target sglang: --engine-version 'vllm=0.32': vllm is not a target here",
        command="eval"),
    Row("export --engine-version with a garbage suffix", lambda t: _export(t, t / "o", "--engine-version", "0.34.x"),
        "engine version '0.34.x': give numbers", command="export"),
    Row("eval --scales checkpoint with a subnormal k_scale (1e-45)", lambda t: [*_eval(t), "--scales", str(_exported(
        t, edit=_scale_value("model.layers.1.self_attn.k_scale", 1e-45)))],
        "scales must be finite and at least the smallest normal float32", command="eval"),
    Row("tune of a model whose logits overflow (NaN/inf numbers)", lambda t: [*_tune(overflowing_model(t, "model").parent)],
        "cannot measure: `fp32` (the reference) bucket <= 32", command="tune"),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones included) -> sha256 of its bytes; links as their targets."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[p.relative_to(root).as_posix()] = "->" + str(p.readlink())
        elif p.is_file():
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_row(row: Row, tmp: Path) -> tuple[int, str, list[str], list[str]]:
    """Run the row with `tmp` as the current folder: (exit code, output, paths left behind, inputs changed)."""
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        args = row.setup(tmp)
        before = snapshot(tmp)
        dirs = {p for p in tmp.rglob("*") if p.is_dir()}
        result = CliRunner().invoke(main, [row.command, *args])
    finally:
        os.chdir(cwd)
        while _HELD:
            os.close(_HELD.pop())
        while _UNDO:
            _UNDO.pop()()
    after = snapshot(tmp)
    left = sorted({*after.keys() - before.keys(), *(str(p.relative_to(tmp)) for p in tmp.rglob("*")
                                                   if p.is_dir() and p not in dirs)})
    changed = sorted(k for k in before if after.get(k) != before[k])
    output = result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):   # CliRunner caught it
        output += "".join(traceback.format_exception(result.exception))
    return result.exit_code, output, left, changed


@pytest.mark.parametrize("row", ROWS, ids=[r.input for r in ROWS])
def test_bad_input(row: Row, tmp_path: Path):
    if row.cpu_only and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    code, output, left, changed = run_row(row, tmp_path)
    errors = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert code == 1 and "Traceback" not in output, output          # the table says exit code 1 (errors.ERROR)
    assert len(errors) == 1 and row.message in errors[0], output
    assert left == [], f"left behind: {left}"
    assert changed == [], f"inputs changed: {changed}"


def test_disk_too_small_is_refused_before_writing(tmp_path, monkeypatch):
    import calib.safety.outputs as outputs
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    code, output, left, changed = run_row(Row("disk", _base, ""), tmp_path)
    assert code == 1 and "GiB free but the output needs" in output and left == [] and changed == []


def markdown_table() -> str:
    lines = ["| input | error (one line, exit code 1, nothing written) |", "|---|---|"]
    lines += [f"| {r.input} | `...{r.message}...` |" for r in ROWS]
    return "\n".join(lines)


def test_the_docs_table_is_generated_from_these_rows():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "bad-inputs.md").read_text()
    assert markdown_table() in doc, "docs/bad-inputs.md's table is stale: run `make bad-input-table`"


if __name__ == "__main__":  # prints the docs/bad-inputs.md table
    print(markdown_table())


def test_pickle_weights_only_with_allow_pickle(tmp_path):
    model = _bin_only(tmp_path)
    args = _base(tmp_path, model)
    ok = CliRunner().invoke(main, ["calibrate", *args, "--allow-pickle", "--target", "", "--force"])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "out" / "stats.safetensors").is_file()
    shutil.rmtree(tmp_path / "out")
    r = CliRunner().invoke(main, ["calibrate", *args, "--allow-pickle"])
    assert r.exit_code == 1 and "no .safetensors weights" in r.output and not (tmp_path / "out").exists()
