"""calib.data.sources: every source format, tokenization paths, determinism, bounded shuffle, packing and errors.

References are independent of the code under test: the texts/ids we wrote ourselves, a tiny tokenizer we
build here and call a second time, and a sha256 computed from the ids with `struct`.
"""

from __future__ import annotations

import hashlib
import re
import struct
from pathlib import Path

import pytest

from calib.data import sources as D
from helpers import read_samples, write_csv, write_json, write_jsonl, write_parquet

# 30 texts with the awkward bits every format must survive: commas, quotes, non-ASCII, inner newlines.
TEXTS = [
    f"sample {i}: the cat, said \"hi\" to café {i * 7}" + (f"\nsecond line of {i}" if i % 3 == 0 else "")
    + ("\n    indented line" if i % 5 == 0 else "")
    for i in range(30)
]


# ---------------------------------------------------------------- writers (one per local format)

def write_txt(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n\n".join(r["text"] for r in rows) + "\n", encoding="utf-8")
    return path


WRITERS = {".jsonl": write_jsonl, ".json": write_json, ".parquet": write_parquet, ".csv": write_csv, ".txt": write_txt}


def text_rows(texts: list[str]) -> list[dict]:
    return [{"text": t} for t in texts]


def data_error(source, tokenizer=None, **kw) -> str:
    with pytest.raises(D.DataError) as ei:
        read_samples(source, tokenizer, **kw)
    msg = str(ei.value)
    assert "\n" not in msg, f"DataError should be one line: {msg!r}"
    return msg


def sha256_of(seqs: list[list[int]]) -> str:
    h = hashlib.sha256()
    for s in seqs:
        h.update(struct.pack("<I", len(s)) + struct.pack(f"<{len(s)}i", *s))
    return h.hexdigest()


def id_rows(lengths: list[int], start: int = 10) -> list[dict]:
    """Records of pre-tokenized ids; every id in the whole set is unique, so any id locates its record."""
    rows, nxt = [], start
    for n in lengths:
        rows.append({"input_ids": list(range(nxt, nxt + n))})
        nxt += n
    return rows


# ---------------------------------------------------------------- a tiny real tokenizer

def word_ids(tok, text: str) -> list[int]:
    """Our own tokenization reference for the word-level tokenizer: one id per whitespace word."""
    return tok.convert_tokens_to_ids(text.split())


# ---------------------------------------------------------------- formats

@pytest.mark.parametrize("suffix", sorted(WRITERS))
def test_every_local_format_yields_the_same_records(tmp_path, suffix):
    path = WRITERS[suffix](tmp_path / f"data{suffix}", text_rows(TEXTS))
    got = [r.fields["text"] for r in D.read_records(path)]
    assert got == TEXTS


def test_folder_is_read_recursively_in_sorted_name_order(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "2_nested").mkdir(parents=True)
    # written in reverse so creation/directory order cannot pass for name order
    write_txt(folder / "4_tail.txt", text_rows(TEXTS[24:]))
    write_jsonl(folder / "3_last.jsonl", text_rows(TEXTS[16:24]))
    write_parquet(folder / "2_nested" / "inner.parquet", text_rows(TEXTS[8:16]))
    write_csv(folder / "1_first.csv", text_rows(TEXTS[:8]))
    (folder / "0_notes.md").write_text("# not data\n", encoding="utf-8")
    got = [r.fields["text"] for r in D.read_records(folder)]
    assert got == TEXTS
    origins = [r.origin for r in D.read_records(folder)]
    assert "1_first.csv" in origins[0] and "inner.parquet" in origins[8] and "4_tail.txt" in origins[-1]


def test_txt_paragraph_origins_name_the_first_line(tmp_path):
    path = write_txt(tmp_path / "p.txt", text_rows(["one\ntwo", "three", "four\nfive\nsix", "seven"]))
    # lines: 1 one, 2 two, 3 -, 4 three, 5 -, 6 four, 7 five, 8 six, 9 -, 10 seven
    assert [r.origin for r in D.read_records(path)] == [f"{path}:{n}" for n in (1, 4, 6, 10)]


# ---------------------------------------------------------------- input_ids

@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_input_ids_used_as_given_and_truncated_without_tokenizer(tmp_path, suffix):
    rows = id_rows([3, 7, 12, 5, 9])
    path = WRITERS[suffix](tmp_path / f"ids{suffix}", rows)
    seqs, report = read_samples(path, None, seq_len=8)
    expected = [r["input_ids"][:8] for r in rows]  # no BOS prepended, cut at seq_len
    assert sorted(seqs) == sorted(expected)
    assert report.column == "input_ids"
    assert report.tokens == 3 + 7 + 8 + 5 + 8


def test_input_ids_out_of_vocab_names_the_record(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 50, 5]},
                                               {"input_ids": [6, 7]}])
    msg = data_error(path, vocab_size=50)
    assert f"{path}:2" in msg and "out of range" in msg and "50" in msg
    # one more id in the vocabulary and the same data is accepted, unchanged
    seqs, _ = read_samples(path, vocab_size=51)
    assert sorted(seqs) == [[1, 2, 3], [4, 50, 5], [6, 7]]


def test_negative_input_id_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "neg.jsonl", [{"input_ids": [3, -1, 4]}])
    assert f"{path}:1" in data_error(path, vocab_size=100)


def test_input_ids_must_be_integers(tmp_path):
    path = write_jsonl(tmp_path / "f.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [1.5, 2]}])
    msg = data_error(path)
    assert f"{path}:2" in msg and "integers" in msg


# ---------------------------------------------------------------- text / messages with a tokenizer

def test_text_is_tokenized_with_bos_like_the_tokenizer(tmp_path, tok):
    texts = ["the cat sat on the mat", "hello world", "a dog ran far away from the cat"]
    path = write_jsonl(tmp_path / "t.jsonl", text_rows(texts))
    seqs, report = read_samples(path, tok, seq_len=64)
    expected = [tok(t)["input_ids"] for t in texts]
    assert sorted(seqs) == sorted(expected)
    # the tokenizer's own encoding is BOS + one id per word; check against that too
    assert sorted(seqs) == sorted([[tok.bos_token_id] + word_ids(tok, t) for t in texts])
    assert report.column == "text"


def test_text_is_truncated_to_seq_len(tmp_path, tok):
    text = "the cat sat on the mat"
    path = write_jsonl(tmp_path / "t.jsonl", text_rows([text]))
    seqs, _ = read_samples(path, tok, seq_len=4)
    assert seqs == [[tok.bos_token_id] + word_ids(tok, "the cat sat")]


def test_messages_are_rendered_with_the_chat_template(tmp_path, tok):
    chat = [{"role": "user", "content": "the cat sat"}, {"role": "assistant", "content": "a dog ran"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": chat}])
    seqs, report = read_samples(path, tok, seq_len=64)
    rendered = tok.apply_chat_template(chat, tokenize=False)
    assert rendered == "<s><|user|> the cat sat <|assistant|> a dog ran "
    assert seqs == [tok(rendered, add_special_tokens=False)["input_ids"]]
    # the template carries BOS itself: exactly one BOS, at the start
    assert seqs[0][0] == tok.bos_token_id and seqs[0].count(tok.bos_token_id) == 1
    assert seqs[0] == tok.convert_tokens_to_ids(["<s>", "<|user|>", "the", "cat", "sat", "<|assistant|>", "a",
                                                 "dog", "ran"])
    assert report.column == "messages"


def test_text_without_tokenizer_asks_for_input_ids(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", text_rows(TEXTS[:3]))
    msg = data_error(path, None)
    assert "tokenizer" in msg and "input_ids" in msg and str(path) in msg


# ---------------------------------------------------------------- determinism

def test_same_seed_same_samples_and_fingerprint(tmp_path):
    rows = id_rows([4 + i % 9 for i in range(200)])
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    a, ra = read_samples(path, seed=3, seq_len=16)
    b, rb = read_samples(path, seed=3, seq_len=16)
    c, rc = read_samples(path, seed=4, seq_len=16)
    assert a == b and ra.fingerprint == rb.fingerprint
    assert a != c and ra.fingerprint != rc.fingerprint
    assert sorted(a) == sorted(c) == sorted(r["input_ids"] for r in rows)
    # the fingerprint is sha256 over exactly the ids used, in order
    assert ra.fingerprint == sha256_of(a) and rc.fingerprint == sha256_of(c)


def test_fingerprint_changes_with_one_token(tmp_path):
    rows = id_rows([5] * 20)
    p1 = write_jsonl(tmp_path / "a.jsonl", rows)
    rows[7]["input_ids"][2] += 1000
    p2 = write_jsonl(tmp_path / "b.jsonl", rows)
    (a, ra), (b, rb) = read_samples(p1), read_samples(p2)
    assert ra.fingerprint != rb.fingerprint
    assert sum(x != y for s, t in zip(a, b) for x, y in zip(s, t)) == 1


def test_fingerprint_covers_only_used_samples(tmp_path):
    rows = id_rows([6, 2, 7, 1, 8])
    with_short = write_jsonl(tmp_path / "a.jsonl", rows)
    a, ra = read_samples(with_short, min_tokens=3)
    assert ra.skipped_short == 2
    assert ra.fingerprint == sha256_of(a)


def test_shuffled_is_a_permutation_with_bounded_lookahead():
    pulled = 0

    def source():
        nonlocal pulled
        for i in range(10_000):
            pulled += 1
            yield i

    buffer = 16
    out, worst = [], 0
    for k, item in enumerate(D.shuffled(source(), seed=1, buffer=buffer), 1):
        worst = max(worst, pulled - k)
        out.append(item)
    assert sorted(out) == list(range(10_000))
    assert out != list(range(10_000))
    assert worst <= buffer, f"held {worst} items for a buffer of {buffer}"
    assert out == list(D.shuffled(range(10_000), seed=1, buffer=buffer))
    assert out != list(D.shuffled(range(10_000), seed=2, buffer=buffer))


# ---------------------------------------------------------------- counts and limits

def test_short_samples_are_skipped_and_counted(tmp_path):
    lengths = list(range(1, 11))
    path = write_jsonl(tmp_path / "ids.jsonl", id_rows(lengths))
    seqs, report = read_samples(path, min_tokens=5, seq_len=8)
    assert sorted(map(len, seqs)) == [5, 6, 7, 8, 8, 8]
    assert report.skipped_short == 4
    assert report.used == 6 and report.tokens == 5 + 6 + 7 + 8 + 8 + 8


def test_max_samples_bounds_the_count(tmp_path):
    rows = id_rows([3 + i % 5 for i in range(30)])
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    seqs, report = read_samples(path, max_samples=7)
    assert len(seqs) == 7 and report.used == 7
    assert report.tokens == sum(map(len, seqs))
    all_ids = [r["input_ids"] for r in rows]
    assert all(s in all_ids for s in seqs)


def test_all_too_short_says_so(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", id_rows([1, 2, 3]))
    msg = data_error(path, min_tokens=4)
    assert "3 sample(s)" in msg and "min_tokens=4" in msg and str(path) in msg


def test_no_records_says_so(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n", encoding="utf-8")
    msg = data_error(path)
    assert "no records" in msg and str(path) in msg


# ---------------------------------------------------------------- packing

def split_into_records(stream: list[int], rows: list[dict]) -> list[int]:
    """Walk `stream` record by record (ids are unique, so each record's first id finds it).

    Returns the indices of records in the order they appear; the last one may be cut short. Fails if the
    stream is not a concatenation of whole, distinct records.
    """
    first = {r["input_ids"][0]: i for i, r in enumerate(rows)}
    order, pos = [], 0
    while pos < len(stream):
        i = first[stream[pos]]
        assert i not in order, "a record appears twice"
        ids = rows[i]["input_ids"]
        assert stream[pos:pos + len(ids)] == ids[:len(stream) - pos]
        order.append(i)
        pos += len(ids)
    return order


@pytest.mark.parametrize("lengths, tail", [([1, 5, 13, 2, 9, 4, 3], 5),   # 37 = 4*8 + 5: tail kept
                                           ([3, 11, 6, 2, 4], 2)])        # 26 = 3*8 + 2: tail dropped
def test_packing_cuts_the_concatenation_into_full_chunks(tmp_path, lengths, tail):
    rows = id_rows(lengths)
    path = write_jsonl(tmp_path / "ids.jsonl", rows)
    seqs, report = read_samples(path, pack=True, seq_len=8, min_tokens=3, seed=5)
    total = sum(lengths)
    full = total // 8
    assert [len(s) for s in seqs] == [8] * full + ([tail] if tail >= 3 else [])
    stream = [t for s in seqs for t in s]
    order = split_into_records(stream, rows)
    if tail >= 3:
        assert sorted(order) == list(range(len(rows)))  # every record used whole, once
    assert len(stream) == total - (tail if tail < 3 else 0)
    assert report.used == len(seqs) and report.tokens == len(stream) and report.skipped_short == 0
    # same order as the unpacked stream for the same seed
    unpacked, _ = read_samples(path, pack=False, seq_len=64, seed=5)
    assert stream == [t for s in unpacked for t in s][:len(stream)]


def test_packing_respects_max_samples(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", id_rows([7] * 10))
    seqs, report = read_samples(path, pack=True, seq_len=8, max_samples=2)
    assert [len(s) for s in seqs] == [8, 8] and report.used == 2 and report.tokens == 16


# ---------------------------------------------------------------- errors

def test_invalid_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', encoding="utf-8")
    msg = data_error(path)
    assert f"{path}:3" in msg and "JSON" in msg


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_record_missing_the_first_records_column(tmp_path, tok, suffix):
    rows = [{"text": "the cat sat"}, {"text": "hello world"}, {"input_ids": [1, 2, 3]}, {"text": "a dog"}]
    path = WRITERS[suffix](tmp_path / f"mixed{suffix}", rows)
    seen = set()
    for seed in range(6):  # the first record (in sample order) decides the column; both ways must fail
        msg = data_error(path, tok, seed=seed)
        m = re.search(r"(?::(\d+)|\[(\d+)\]): missing column '(\w+)'", msg)
        assert m and str(path) in msg, msg
        index = int(m.group(1)) - 1 if m.group(1) else int(m.group(2))
        column = m.group(3)
        assert column not in rows[index], f"{msg} names a record that has '{column}'"
        seen.add(column)
    assert seen == {"text", "input_ids"}


def test_missing_relative_path_is_not_treated_as_a_dataset_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = data_error("./missing.jsonl")
    assert "missing.jsonl" in msg and "not found" in msg


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "data.xml"
    path.write_text("<text>hi</text>", encoding="utf-8")
    msg = data_error(path)
    assert str(path) in msg and "'.xml'" in msg and ".jsonl" in msg


def test_empty_folder(tmp_path):
    folder = tmp_path / "nothing"
    folder.mkdir()
    (folder / "readme.md").write_text("no data here", encoding="utf-8")
    msg = data_error(folder)
    assert str(folder) in msg and "no" in msg


@pytest.mark.parametrize("suffix", [".jsonl", ".txt", ".csv"])
def test_non_utf8_file(tmp_path, suffix):
    path = tmp_path / f"latin1{suffix}"
    content = {".jsonl": '{"text": "caf\u00e9"}\n', ".txt": "caf\u00e9\n", ".csv": "text\ncaf\u00e9\n"}[suffix]
    path.write_bytes(content.encode("latin-1"))
    msg = data_error(path)
    assert str(path) in msg and "UTF-8" in msg


def test_csv_field_over_the_csv_module_limit_is_a_data_error(tmp_path):
    path = tmp_path / "huge.csv"
    path.write_text('text\n"' + "word " * 40_000 + '"\n', encoding="utf-8")
    msg = data_error(path)
    assert str(path) in msg and "CSV" in msg


def test_no_usable_column_lists_what_was_found(tmp_path):
    path = tmp_path / "ragged.csv"
    path.write_text("body\nfirst,extra\n", encoding="utf-8")
    msg = data_error(path)
    assert f"{path} row 1" in msg and "body" in msg and "text" in msg


# ---------------------------------------------------------------- report

def test_report_to_dict_matches_the_samples(tmp_path):
    lengths = [2, 9, 4, 12, 6, 1, 7]
    path = write_jsonl(tmp_path / "ids.jsonl", id_rows(lengths))
    seqs, report = read_samples(path, seq_len=10, min_tokens=3)
    d = report.to_dict()
    kept = [min(n, 10) for n in lengths if min(n, 10) >= 3]
    assert d == {"samples": len(kept), "tokens": sum(kept), "skipped_short": 2, "column": "input_ids",
                 "fingerprint": "sha256:" + sha256_of(seqs)}
    assert sum(map(len, seqs)) == sum(kept) == 36


def test_pack_hint_only_when_samples_are_short_and_packing_fills_one():
    from calib.data.sources import pack_hint
    line = pack_hint(16, 16 * 72, 1024, "--seq-len", 0.41)
    assert line == ("warning: samples average 72 tokens, 7% of --seq-len (1,024), 41% of the computed positions "
                    "padding: the records are short; --pack concatenates them into samples that fill it")
    assert pack_hint(16, 16 * 512, 1024, "--seq-len") is None          # half the length: not far shorter
    assert pack_hint(4, 4 * 100, 1024, "--seq-len") is None            # 400 tokens in all cannot fill one
    assert pack_hint(0, 0, 1024, "--seq-len") is None
