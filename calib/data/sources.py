"""Calibration samples: user text in, token-id sequences out, streamed.

Why streamed: calibration sets for real deployments are large (domain corpora, chat logs) and a
calibration job should cost one forward pass, not a copy of the dataset in RAM. Every reader here yields
records one at a time; only a bounded shuffle buffer is held.

Sources: a local `.jsonl`, `.json`, `.parquet`, `.csv` or `.txt` file, a folder of them (recursively, in
name order), or a Hugging Face dataset id `name[:config][:split]` read with `streaming=True`.
Columns, decided by the first record and then required of every record:
  `input_ids` — pre-tokenized; used exactly as given (no BOS added), so no tokenizer is needed;
  `messages`  — a chat, rendered with the tokenizer's chat template;
  `text`      — plain text, tokenized with the tokenizer's own special tokens (BOS where the model adds it).
`.txt` files give one sample per paragraph (blank-line separated). A FIFO or a process substitution
(`--data <(zcat data.jsonl.gz)`) is read once, as a stream, by its suffix (none: JSON lines when it starts with
`{`, else text); formats that need a seekable file (parquet, a JSON array) say so. Chat records go through
`calib.data.chat`.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import random
import stat
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from calib.data import chat
from calib.errors import KvcalibError, first_line
from calib.safety.files import expand_user

SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".txt")
COLUMNS = ("input_ids", "messages", "text")
SHUFFLE_BUFFER = 1024


class DataError(KvcalibError, ValueError):
    """Bad calibration data; the message names the file/record and what to do."""


@dataclass(frozen=True)
class Record:
    """One raw record and where it came from (for error messages)."""
    fields: dict[str, Any]
    origin: str


@dataclass
class DataReport:
    """What the stream actually delivered — filled in as samples are consumed."""
    used: int = 0
    tokens: int = 0
    skipped_short: int = 0
    column: str | None = None
    _hash: Any = field(default_factory=hashlib.sha256, repr=False)

    def add(self, ids: list[int]) -> None:
        self.used += 1
        self.tokens += len(ids)
        self._hash.update(len(ids).to_bytes(4, "little"))
        self._hash.update(struct.pack(f"<{len(ids)}i", *ids))  # same bytes as per-token int32 LE, in one call

    @property
    def fingerprint(self) -> str:
        """sha256 over exactly the token ids used (changes when the data or its order changes)."""
        return self._hash.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"samples": self.used, "tokens": self.tokens, "skipped_short": self.skipped_short,
                "column": self.column, "fingerprint": f"sha256:{self.fingerprint}"}


SHORT_SHARE = 0.5          # unpacked samples averaging under this share of the length they could fill: warn


def pack_hint(samples: int, tokens: int, length: int, what: str, padding: float | None = None) -> str | None:
    """One warning line when unpacked samples average under `SHORT_SHARE` of `length` tokens (named `what`) and
    the data could fill one sample of it (`padding`: the share of positions that are padding); else None."""
    if samples <= 0 or tokens < length or tokens / samples >= SHORT_SHARE * length:
        return None
    mean = tokens / samples
    pad = "" if padding is None else f", {padding:.0%} of the computed positions padding"
    return (f"warning: samples average {mean:,.0f} tokens, {mean / length:.0%} of {what} ({length:,}){pad}: "
            f"the records are short; --pack concatenates them into samples that fill it")


# ---------------------------------------------------------------- readers (one record at a time)

def _jsonl_lines(lines: Iterable[str], path: Path, start: int = 1) -> Iterator[Record]:
    for n, line in enumerate(lines, start):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{n}: not valid JSON ({e.msg}); each line must be one JSON object") from None
        except RecursionError:
            raise DataError(f"{path}:{n}: JSON nested too deeply to be a record") from None
        yield Record(_as_fields(obj, f"{path}:{n}"), f"{path}:{n}")


def _read_json(path: Path) -> Iterator[Record]:
    from datasets import load_dataset  # streams both JSON lines and a top-level array

    try:
        ds = load_dataset("json", data_files=str(path), split="train", streaming=True)
        for n, obj in enumerate(ds):
            yield Record(_as_fields(obj, f"{path}[{n}]"), f"{path}[{n}]")
    except DataError:
        raise
    except Exception as e:  # datasets wraps parse errors in many types
        raise DataError(f"{path}: cannot read as JSON ({type(e).__name__}: {first_line(e)})") from None


def _read_parquet(path: Path) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"{path}: not a readable parquet file ({first_line(e)})") from None
    for n, row in enumerate(row for batch in pf.iter_batches(batch_size=256) for row in batch.to_pylist()):
        yield Record(row, f"{path} row {n}")


def _read_csv(path: Path) -> Iterator[Record]:
    with path.open("r", encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        try:
            for n, row in enumerate(reader, 1):
                for col, want in (("input_ids", "a JSON list like [1, 2, 3]"),
                                  ("messages", "a JSON list of {role, content} objects")):
                    if isinstance(row.get(col), str):
                        try:
                            row[col] = json.loads(row[col])
                        except json.JSONDecodeError:
                            raise DataError(f"{path} row {n}: {col} must be {want}") from None
                yield Record(row, f"{path} row {n}")
        except csv.Error as e:  # malformed quoting, a field over csv.field_size_limit(), ...
            raise DataError(f"{path} after line {reader.line_num}: not readable as CSV ({e}); "
                            "fix the file or convert it to .jsonl") from None


def _txt_paragraphs(lines: Iterable[str], path: Path, first: int = 1) -> Iterator[Record]:
    para: list[str] = []
    for n, line in enumerate(itertools.chain(lines, [""]), first):     # a blank line ends the last paragraph
        if line.strip():
            if not para:
                start = n
            para.append(line.rstrip("\n"))
        elif para:
            yield Record({"text": "\n".join(para)}, f"{path}:{start}")
            para = []


STREAMABLE = (".jsonl", ".txt", ".csv", "")


def is_stream(path: Path) -> bool:
    """A FIFO or pipe (`mkfifo`, `<(...)`): readable once, front to back."""
    try:
        return stat.S_ISFIFO(path.stat().st_mode)
    except OSError:
        return False


def _read_text(path: Path, parse: Callable[[Iterable[str], Path], Iterator[Record]] | None = None) -> Iterator[Record]:
    """A text file's lines through `parse` (JSON lines or paragraphs). Without one (a pipe without a suffix, read
    once, front to back) the first non-blank line decides: `{` → JSON lines, anything else → text paragraphs."""
    with path.open("r", encoding="utf-8") as f:
        lines: Iterable[str] = f
        if parse is None:
            head: list[str] = []
            for line in f:
                head.append(line)
                if line.strip():
                    break
            lines = itertools.chain(head, f)
            parse = _jsonl_lines if head and head[-1].lstrip().startswith("{") else _txt_paragraphs
        yield from parse(lines, path)


_READERS = {".jsonl": partial(_read_text, parse=_jsonl_lines), ".json": _read_json, ".parquet": _read_parquet,
            ".csv": _read_csv, ".txt": partial(_read_text, parse=_txt_paragraphs),
            "": _read_text}      # `_local_files` lets only a pipe through without a suffix


def _as_fields(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object with one of the columns {', '.join(COLUMNS)}, "
                        f"got {type(obj).__name__}")
    return obj


def _read_file(path: Path) -> Iterator[Record]:
    try:
        yield from _READERS[path.suffix.lower()](path)
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; convert it or pass a .parquet file") from None
    except PermissionError:
        raise DataError(f"{path}: permission denied; make the file readable") from None


def _local_files(path: Path) -> list[Path]:
    if is_stream(path):
        if path.suffix.lower() not in STREAMABLE:
            raise DataError(f"DATA {path} is a pipe, and '{path.suffix}' needs a seekable file; stream JSON lines, "
                            "CSV or text, or write the data to a file first")
        return [path]
    if path.is_file():
        if path.suffix.lower() not in SUFFIXES:
            raise DataError(f"DATA {path}: unsupported file type '{path.suffix}'; use one of {', '.join(SUFFIXES)}")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES)
    if not files:
        raise DataError(f"DATA folder {path} holds no {'/'.join(SUFFIXES)} files")
    return files


def _read_hub(spec: str) -> Iterator[Record]:
    """`name[:config][:split]` through `datasets` streaming (no full download)."""
    from datasets import load_dataset

    name, config, split = (spec.split(":") + [None, None])[:3]
    try:
        ds = load_dataset(name, config or None, split=split or "train", streaming=True)
    except Exception as e:
        raise DataError(f"DATA '{spec}' is neither a local path nor a loadable dataset id "
                        f"({type(e).__name__}: {first_line(e)})") from None
    for n, obj in enumerate(ds):
        yield Record(dict(obj), f"{spec}[{n}]")


def check_source(source: str | Path) -> None:
    """Fail fast (before a model is loaded) on a local DATA path that is missing or holds no usable files."""
    path = expand_user(source, "DATA")
    if path.exists():
        _local_files(path)
    elif path.suffix.lower() in SUFFIXES or str(source).startswith((".", "/", "~")):
        raise DataError(f"DATA {source} not found; give an existing file/folder or a dataset id name[:config][:split]")


def read_records(source: str | Path) -> Iterator[Record]:
    """All records of a source, in file order."""
    check_source(source)
    path = expand_user(source, "DATA")
    if path.exists():
        for f in _local_files(path):
            yield from _read_file(f)
    else:
        yield from _read_hub(str(source))


def shuffled(items: Iterable[Record], seed: int, buffer: int = SHUFFLE_BUFFER) -> Iterator[Record]:
    """Deterministic bounded-memory shuffle: a reservoir of `buffer` items drawn with a seeded RNG."""
    rng = random.Random(seed)
    pool: list[Record] = []
    for item in items:
        pool.append(item)
        if len(pool) >= buffer:
            i = rng.randrange(len(pool))
            pool[i], pool[-1] = pool[-1], pool[i]
            yield pool.pop()
    rng.shuffle(pool)
    yield from pool


# ---------------------------------------------------------------- tokenization

def _detect_column(rec: Record) -> str:
    for c in COLUMNS:
        if rec.fields.get(c) is not None:  # columnar readers (json array, parquet, hub) fill absent keys with None
            return c
    if nulls := [c for c in COLUMNS if c in rec.fields]:
        raise DataError(f"{rec.origin}: '{nulls[0]}' is null; give a value or remove the record")
    raise DataError(f"{rec.origin}: no usable column; found {sorted(map(str, rec.fields))[:8]}, "
                    f"need one of {', '.join(COLUMNS)}")


def _to_ids(rec: Record, column: str, tokenizer: Any, max_len: int | None) -> list[int]:
    if rec.fields.get(column) is None:
        if column in rec.fields and not any(rec.fields.get(c) is not None for c in COLUMNS):
            raise DataError(f"{rec.origin}: '{column}' is null; give a value or remove the record")
        raise DataError(f"{rec.origin}: missing column '{column}' (the first record used '{column}'); "
                        "all records of a DATA source must share one format")
    value = rec.fields[column]
    if column == "input_ids":
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise DataError(f"{rec.origin}: input_ids must be a list of integers")
        return list(value)[:max_len or None]
    if column == "messages":  # the record's own shape first: its errors do not depend on the model
        try:
            value = chat.normalize(value)
        except chat.ChatError as e:
            raise DataError(f"{rec.origin}: {e}") from None
    elif not isinstance(value, str):
        raise DataError(f"{rec.origin}: text must be a string, got {type(value).__name__}")
    _check_unicode(value, rec.origin)
    if tokenizer is None:
        raise DataError(f"{rec.origin}: the model has no tokenizer, so '{column}' data cannot be used; "
                        "give pre-tokenized data with an input_ids column")
    if column == "messages":
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"{rec.origin}: the tokenizer has no chat template to render 'messages'; "
                            "use a 'text' column or a tokenizer with a chat_template")
        try:
            text = tokenizer.apply_chat_template(value, tokenize=False)
        except Exception as e:  # templates raise their own errors (roles out of order, missing fields)
            raise DataError(f"{rec.origin}: the model's chat template refused this conversation "
                            f"({type(e).__name__}: {first_line(e)})") from None
        special = False  # the template already carries BOS and turn markers
    else:
        text, special = value, True
    enc = tokenizer(text, add_special_tokens=special, truncation=max_len is not None, max_length=max_len)
    return list(enc["input_ids"])


def _lone_surrogate(value: Any) -> tuple[int, str] | None:
    """(position, character) of the first lone surrogate in a string, or in the strings of a chat's messages."""
    if isinstance(value, str):
        return next(((i, c) for i, c in enumerate(value) if "\ud800" <= c <= "\udfff"), None)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return next((hit for v in items if (hit := _lone_surrogate(v)) is not None), None)


def _check_unicode(value: Any, origin: str) -> None:
    """Text holding a lone surrogate (JSON allows `\\ud800`; it is no character) is refused, not replaced: a
    replaced character would calibrate on text the user never wrote, and the tokenizer cannot encode it."""
    hit = _lone_surrogate(value)
    if hit is not None:
        raise DataError(f"{origin}: the text holds a lone surrogate (U+{ord(hit[1]):04X}, character {hit[0]}), "
                        "which is not Unicode text; fix the source's encoding or remove the record")


def samples(source: str | Path, tokenizer: Any, *, seq_len: int, max_samples: int, min_tokens: int,
            pack: bool, seed: int, vocab_size: int | None, report: DataReport) -> Iterator[list[int]]:
    """At most `max_samples` token sequences of at most `seq_len` ids (counts into `report`): one per record,
    truncated, those under `min_tokens` skipped; or, `pack`ed, the records concatenated and cut into full
    `seq_len` chunks, a final tail kept when it has at least `min_tokens` ids."""
    buffer: list[int] = []
    for rec in shuffled(read_records(source), seed):
        if report.used >= max_samples:
            return
        if report.column is None:
            report.column = _detect_column(rec)
        ids = _to_ids(rec, report.column, tokenizer, None if pack else seq_len)
        if vocab_size is not None and ids and (min(ids) < 0 or max(ids) >= vocab_size):
            raise DataError(f"{rec.origin}: token id out of range [0, {vocab_size}); was the data tokenized for "
                            "another model?")
        if not pack:
            if len(ids) < min_tokens:
                report.skipped_short += 1
                continue
            report.add(ids)
            yield ids
            continue
        buffer.extend(ids)
        while len(buffer) >= seq_len and report.used < max_samples:
            chunk, buffer = buffer[:seq_len], buffer[seq_len:]
            report.add(chunk)
            yield chunk
    if pack and report.used < max_samples and len(buffer) >= min_tokens:
        report.add(buffer)
        yield buffer
    if report.used == 0:
        why = (f"{report.skipped_short} sample(s) were shorter than min_tokens={min_tokens}"
               if report.skipped_short else "the source holds no records")
        raise DataError(f"DATA {source}: no usable calibration samples ({why}); "
                        "give longer samples or lower min_tokens")
