"""Statistics as a file: calibrate once, merge runs, try recipes without running the model again.

Why: the forward pass is the expensive part; folding statistics into scales is not. A statistics file holds
every observer's full state (exact maxima, histograms, counts), not just the final ranges, so `merge` combines
runs over different data exactly as one run over all of it would have, and `export --stats` forms scales for
another dtype, granularity, headroom or target from the same pass.

Layout (safetensors): `stats.layers.{i}.{field}` (the readable ranges, `LayerStats` fields) and
`state.layers.{i}.{observer}.{key}` (the observer states); metadata `kvcalib` holds a JSON header (the run's
provenance, `layers`) and `kvcalib_sha256` a checksum over the header and every tensor.

Reading (`read`, `load`, `build_capture`) is the one way in for statistics files, the resume file and
eval --stats: the safetensors header, the kvcalib header field by field (its recipe with the recipe's own
bounds), the checksum, every tensor's name and the observer states against the ranges stored beside them are
checked. A damaged or edited file is one StatsError naming it — never a traceback, never other statistics.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from calib.capture import hook as observe
from calib.capture.spec import capture_spec
from calib.ckpt.names import STATS_FILE
from calib.errors import KvcalibError
from calib.provenance import RESUME, STATS, Provenance, ProvenanceError
from calib.recipe.recipe import Recipe, RecipeError, from_dict
from calib.safety import files, outputs
from calib.safety.readers import raising, whole
from calib.scales.stats import LayerStats, Stats, stats_to_tensors

# Recipe fields that decide what the observers recorded; runs must agree on them to be merged.
OBSERVED = ("dtype", "granularity", "observer", "observer_params", "q_scale")


class StatsError(KvcalibError, ValueError):
    """A statistics file cannot be read, merged or exported as asked; the message says why."""


@dataclass
class StatsFile:
    header: dict[str, Any]          # as stored: the run's provenance (`Provenance.stats_header`) and `layers`
    capture: observe.KVCapture

    @property
    def recipe(self) -> Recipe:
        return from_dict(self.header["recipe"], source="statistics file recipe")

    @property
    def provenance(self) -> Provenance:
        """The run the statistics were recorded in (model, its config digest, data, recipe, rotary_dim)."""
        return Provenance.from_dict(self.header, "statistics file header", STATS)

    def stats(self) -> Stats:
        return self.capture.stats()


def config_sha256(model_dir: Path) -> str:
    """What a statistics file records of its model: the digest of config.json (calib.ckpt.integrity.digest)."""
    from calib.ckpt import integrity

    return integrity.digest((Path(model_dir) / "config.json").read_bytes())


def save(path: Path, capture: observe.KVCapture, header: dict[str, Any], option: str = "--out") -> Path:
    """Write `capture`'s statistics and observer states to `path` (a .safetensors file), atomically."""
    path = Path(path)
    with outputs.atomic_file(path, option) as tmp:
        write(tmp, capture, header)
    return path


def write(path: Path, capture: observe.KVCapture, header: dict[str, Any]) -> None:
    """The statistics file as a new file at `path` (a caller's temporary name: `save` or a larger atomic step)."""
    tensors = {f"stats.{k}": v for k, v in stats_to_tensors(capture.stats()).items()}
    tensors.update({f"state.{k}": v.contiguous() for k, v in capture.state_dict().items()})
    text = json.dumps({**header, "layers": capture.layers})
    files.save_tensors(path, tensors, {"kvcalib": text, CHECKSUM: _checksum(text, tensors)})


CHECKSUM = "kvcalib_sha256"   # over the header text and every tensor: an edited or damaged file is refused


def _checksum(header_text: str, tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256(header_text.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return "sha256:" + h.hexdigest()


MAX_LAYERS = 4096                   # calib.model.geometry's bound on num_hidden_layers
EXACT_FIELDS = ("k_amax", "v_amax", "q_amax", "k_channel", "v_channel", "k_over", "v_over")


@dataclass(frozen=True)
class RawFile:
    """A statistics (or resume) file as stored, its structure checked: header, ranges, observer states."""
    path: Path
    header: dict[str, Any]
    recipe: Recipe
    stats: dict[str, torch.Tensor]      # `layers.{i}.{field}` readable ranges
    state: dict[str, torch.Tensor]      # `layers.{i}.{observer}.{key}` observer states


def read(path: Path, what: str = "statistics file") -> RawFile:
    """The one reader of kvcalib statistics files (`--stats-out`, merge, export --stats, eval --stats, the
    resume file): every problem is a StatsError naming the file (module docstring)."""
    from safetensors import safe_open

    from calib.ckpt import integrity

    path = Path(path)
    where = f"{what} {path}"
    if not path.is_file():
        raise StatsError(f"{where} not found")
    with raising(StatsError, integrity.IntegrityError):
        shard = integrity.read_header(path, where)
        if "kvcalib" not in shard.metadata:
            raise StatsError(f"{where} is not a kvcalib statistics file (no kvcalib header); "
                             "write one with `kvcalib calibrate --stats-out FILE`")
        header = integrity.parse_json(shard.metadata["kvcalib"].encode(), f"{where}: its kvcalib header")
    recipe = _check_header(header, where)
    if bad := [k for k, t in shard.tensors.items() if t.dtype not in ("F32", "F64", "I64", "I32")]:
        raise StatsError(f"{where}: tensor {bad[0]!r} has dtype {shard.tensors[bad[0]].dtype}; statistics are "
                         "float32/float64/int64 — the file was not written by kvcalib")
    layers = set(header["layers"])
    stats, state, every = {}, {}, {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            group, _, rest = key.partition(".")
            parts = rest.split(".")
            if group not in ("stats", "state") or len(parts) < 3 or parts[0] != "layers" or \
                    not parts[1].isdigit() or int(parts[1]) not in layers:
                raise StatsError(f"{where}: tensor {key!r} is not stats/state of a layer the header lists "
                                 f"({sorted(layers)[:8]}...); the file was edited or is not kvcalib's")
            every[key] = (stats if group == "stats" else state)[rest] = f.get_tensor(key)
    stored = shard.metadata.get(CHECKSUM)   # files of kvcalib versions before the checksum have none
    if stored is not None and stored != _checksum(shard.metadata["kvcalib"], every):
        raise StatsError(f"{where}: its content does not match its checksum; the file was edited or damaged — "
                         "write it again with kvcalib")
    return RawFile(path, header, recipe, stats, state)


def _check_header(header: Any, where: str) -> Recipe:
    def fail(msg: str) -> StatsError:
        return StatsError(f"{where}: kvcalib header {msg}; the file was edited or is not kvcalib's")

    if not isinstance(header, dict):
        raise fail("is not a JSON object")
    layers = header.get("layers")
    if not (isinstance(layers, list) and 0 < len(layers) <= MAX_LAYERS and
            all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in layers) and
            layers == sorted(set(layers))):
        raise fail(f"field 'layers' must list distinct ascending layer indices in [0, {MAX_LAYERS})")
    data = header.get("data", {})
    if not isinstance(data, dict):
        raise fail("field 'data' must be a JSON object")
    with raising(fail):
        rot = whole(header.get("rotary_dim"), "field 'rotary_dim'", 0, 1 << 16, null=True)
        whole(header.get("batches_done"), "field 'batches_done'", null=True)
        for k in [k for k in ("samples", "tokens", "skipped_short") if k in data]:
            whole(data[k], f"field 'data.{k}'")
    if not isinstance(header.get("recipe"), dict):
        raise fail("has no 'recipe' object")
    try:
        recipe = from_dict(header["recipe"], source=f"{where}: recipe")
    except RecipeError as e:
        msg = str(e)
        raise StatsError(msg if msg.startswith(where) else f"{where}: kvcalib header {msg}") from None
    if recipe.observer_spec.k_only and not rot:
        raise fail(f"has observer {recipe.observer} but no rotary_dim")
    try:
        Provenance.from_dict(header, f"{where}: kvcalib header", STATS)
    except ProvenanceError as e:
        raise StatsError(f"{e}; the file was edited or is not kvcalib's") from None
    return recipe


def build_capture(raw: RawFile) -> observe.KVCapture:
    """Observers of `raw.recipe` holding the file's state, checked: every state tensor is one these observers
    keep, every layer has data, and the readable ranges stored beside the states are what the states give."""
    where = f"{raw.path}"
    rotary_dim = Provenance.from_dict(raw.header, str(raw.path), STATS).rotary_dim
    capture = observe.KVCapture(raw.header["layers"], capture_spec(raw.recipe, rotary_dim=rotary_dim))
    try:
        capture.load_state_dict(raw.state)
        kept = capture.state_dict()
        stats = capture.stats()
        derived = stats_to_tensors(stats)
    except (ValueError, RuntimeError, TypeError, KeyError, IndexError, AttributeError, observe.CaptureError) as e:
        raise StatsError(f"{where}: the observer states do not fit recipe observer {raw.recipe.observer!r} "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160]}); the file was edited or is "
                         "not kvcalib's") from None
    if stray := sorted(set(raw.state) - set(kept)):
        raise StatsError(f"{where}: state tensor {stray[0]!r} belongs to no observer of this recipe; the file was "
                         "edited or is not kvcalib's")
    _check_ranges(derived, raw.stats, where)
    return capture


def _check_ranges(derived: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], where: str) -> None:
    """Stored readable ranges must be the states' own (exact fields: equal; recipe observer ranges: same shape,
    close — a histogram search may land one step apart on another device); all finite and non-negative."""
    if stored.keys() != derived.keys():
        diff = sorted(set(stored) ^ set(derived))
        raise StatsError(f"{where}: range tensor {diff[0]!r} is missing or extra for these observer states; the "
                         "file was edited or is not kvcalib's")
    for key, want in derived.items():
        got = stored[key]
        if got.shape != want.shape or not bool(torch.isfinite(got).all()) or bool((got < 0).any()):
            raise StatsError(f"{where}: range tensor {key!r} is not a finite non-negative {tuple(want.shape)} "
                             "tensor; the file was edited or is corrupt")
        exact = key.rsplit(".", 1)[-1] in EXACT_FIELDS
        if not torch.allclose(got.double(), want.double(), rtol=1e-6 if exact else 5e-2, atol=0):
            raise StatsError(f"{where}: range tensor {key!r} disagrees with the observer states it was computed "
                             "from; the file was edited or is corrupt")


def load(path: Path, what: str = "statistics file") -> StatsFile:
    raw = read(path, what)
    if not raw.state:
        raise StatsError(f"{what} {path} holds no observer states (an older kvcalib wrote it); it can be read by "
                         "eval --stats only — recalibrate with --stats-out to merge or export it")
    return StatsFile(raw.header, build_capture(raw))


def load_output(path: Path, what: str = "--stats") -> StatsFile:
    """A statistics file, or a statistics-only output folder (its stats.safetensors), through `load`."""
    p = Path(path)
    file = p / STATS_FILE if p.is_dir() else p
    if not file.is_file():
        raise StatsError(f"{what} {path}: no {STATS_FILE} (write one with a statistics-only recipe, targets: [])")
    return load(file, what)


@dataclass(frozen=True)
class Resumed:
    """A resume file loaded into the capture: the batches it covers and the hash of their token ids and masks
    (None: written before the stream was hashed). The run resuming replays those batches and checks them."""
    path: Path
    batches: int
    stream_sha256: str | None

    def check_stream(self, replayed: str | None, batches: int | None = None) -> None:
        """Raise when the batches replayed (hash `replayed`; or only `batches` of them, the stream ran out) are
        not those the state was saved from: the data, its batching or the tokenizer changed since."""
        from calib.ckpt.fingerprint import note, short

        if batches is not None:
            raise StatsError(f"--resume: the saved state at {self.path} covers {self.batches} batches, but this run's "
                             f"data gives {batches}: the data or its batching changed since; remove it or run without "
                             "--resume")
        if self.stream_sha256 is None:
            note(f"--resume: the saved state at {self.path} carries no hash of its batches (written by an older "
                 "kvcalib): not checked that this run replays the same data and batching")
        elif replayed != self.stream_sha256:
            raise StatsError(f"--resume: the saved state at {self.path} was saved from other batches than this run's "
                             f"first {self.batches} (token stream {short(self.stream_sha256)} there, "
                             f"{short(replayed)} now): the data, its batching (batch size, max batch tokens, packing, "
                             "seq_len, seed) or the tokenizer changed since; remove it or run without --resume")


def resume_into(capture: observe.KVCapture, path: Path, run: Provenance) -> Resumed:
    """Load the resume file at `path` into `capture`, checked like any statistics file and against `run` (recipe,
    model config and weights, data source); the caller checks the batches it replays (`Resumed.check_stream`)."""
    from calib.ckpt import fingerprint

    if not Path(path).is_file():
        raise StatsError(f"--resume: no saved state at {path}; run without --resume")
    raw = read(path, "--resume: the saved state")
    saved = Provenance.from_dict(raw.header, f"--resume: the saved state at {path}", RESUME)
    for key, mine, theirs in (("recipe", saved.recipe, run.recipe),
                              ("model_config_sha256", saved.model_config_sha256, run.model_config_sha256),
                              ("data_source", saved.data_source, run.data_source)):
        if mine != theirs:
            if key == "recipe":
                fields = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
                mine, theirs = ({k: d.get(k) for k in fields} for d in (mine, theirs))
            raise StatsError(f"--resume: the saved state at {path} is from another run ({key}: {mine!r} there, "
                             f"{theirs!r} now); remove it or run without --resume")
    why = fingerprint.mismatch(saved.model_weights_sha256, run.model_weights_sha256,
                               f"--resume: the saved state at {path}", "this run's model")
    if why:
        raise StatsError(f"{why}; remove it or run without --resume")
    if raw.header["layers"] != capture.layers or raw.header.get("batches_done") is None:
        raise StatsError(f"--resume: the saved state at {path} does not cover this model's "
                         "attention layers or has no batch count; remove it or run without --resume")
    stream = raw.header.get("stream_sha256")
    if stream is not None and not isinstance(stream, str):
        raise StatsError(f"--resume: the saved state at {path}: field 'stream_sha256' must be text; the file was "
                         "edited or is not kvcalib's")
    build_capture(raw)          # every consistency check, on a scratch capture
    capture.load_state_dict(raw.state)
    return Resumed(Path(path), raw.header["batches_done"], stream)


def merge(paths: list[Path], out: Path, *, force: bool = False) -> Path:
    """Combine statistics files of the same model and observers into one, exactly. `out` replaces only a
    statistics file of ours, with `force`, and never one of the inputs."""
    if len(paths) < 2:
        raise StatsError("merge needs at least two statistics files")
    from calib.safety.options import same_file

    for j, p in enumerate(paths):
        twin = next((q for q in paths[:j] if same_file(p, q)), None)
        if twin is not None:
            how = "the same path" if Path(p).absolute() == Path(twin).absolute() else "one file (through a link)"
            raise StatsError(f"{twin} and {p} are {how}: merging it twice would count its data twice; give each "
                             "statistics file once")
    inputs = [("an input statistics file", p) for p in paths]
    outputs.check_file(Path(out), inputs=inputs, option="--out", force=force)
    with outputs.lock(Path(out)):
        return _merge(paths, out)


def _merge(paths: list[Path], out: Path) -> Path:
    files = [load(p) for p in paths]
    first = files[0]
    from calib.ckpt import fingerprint

    weights = [f.provenance.model_weights_sha256 for f in files]
    if unbound := [str(p) for p, w in zip(paths, weights) if w is None]:
        fingerprint.note(f"statistics file(s) {', '.join(unbound)} carry no weights fingerprint (written by an older "
                         "kvcalib): not checked that every input was recorded on the same weights")
    known = [(p, w) for p, w in zip(paths, weights) if w is not None]
    for p, w in known[1:]:
        if w != known[0][1]:
            raise StatsError(f"statistics file {p} was recorded on other weights than {known[0][0]} (weights "
                             f"{fingerprint.short(w)} vs {fingerprint.short(known[0][1])}): it belongs to another "
                             "model; only runs of the same model can be merged")
    for p, f in zip(paths[1:], files[1:]):
        a, b = first.provenance, f.provenance
        for key, mine, theirs in (("model_config_sha256", a.model_config_sha256, b.model_config_sha256),
                                  ("rotary_dim", a.rotary_dim, b.rotary_dim),
                                  ("layers", first.header["layers"], f.header["layers"])):
            if mine != theirs:
                raise StatsError(f"{p}: {key} differs from {paths[0]}; only runs of the same model can be merged")
        if diff := [k for k in OBSERVED if a.recipe.get(k) != b.recipe.get(k)]:
            raise StatsError(f"{p}: recipe field(s) {diff} differ from {paths[0]}; runs must record the same "
                             "statistics to be merged")
        first.capture.merge(f.capture)
    datas = [f.provenance.data for f in files]
    joined = hashlib.sha256("".join(str(d.get("fingerprint")) for d in datas).encode()).hexdigest()
    data = {"sources": [d.get("source") for d in datas],
            **{k: sum(d.get(k, 0) for d in datas) for k in ("samples", "tokens", "skipped_short")},
            "fingerprint": f"sha256:{joined}", "merged_from": [str(p) for p in paths]}
    bound = first.provenance.replace(data=data, model_weights_sha256=known[0][1] if known else None)
    return save(out, first.capture, bound.stats_header())


def stats_for_recipe(sf: StatsFile, recipe: Recipe, where: str) -> Stats:
    """The statistics `recipe` needs from this file; errors say what the file lacks."""
    have = sf.recipe
    if not (recipe.observer_spec.exact or recipe.observer == have.observer) or (
            recipe.observer == have.observer and recipe.observer_params != have.observer_params):
        raise StatsError(f"{where} was recorded with observer {have.observer} {have.observer_params or ''}; "
                         f"it cannot give {recipe.observer} ranges (absmax is always available)")
    if recipe.q_scale and not have.q_scale:
        raise StatsError(f"{where} has no Q statistics; calibrate with q_scale to export q_scale")
    stats = sf.stats()
    if recipe.observer_spec.exact and not have.observer_spec.exact:  # fall back to the exact maxima
        stats = {i: LayerStats(k_amax=s.k_amax, v_amax=s.v_amax, q_amax=s.q_amax, k_over=s.k_over,
                                       v_over=s.v_over) for i, s in stats.items()}
    return stats

