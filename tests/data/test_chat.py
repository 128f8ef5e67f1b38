"""calib.data.chat and chat/stream data in calib.data.sources: content parts, nulls, empty conversations, FIFOs.

References: a conversation written with string contents (what the parts must become) rendered through the
same template, and the same data read from a regular file (what a FIFO must yield).
"""

from __future__ import annotations

import copy
import gzip
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calib.data import chat
from calib.data import sources as D
from helpers import read_samples, write_jsonl, write_parquet

USER_PARTS = [{"type": "text", "text": "the cat"}, {"type": "image_url", "image_url": {"url": "data:x"}},
              {"type": "text", "text": "sat on the mat"}]


def error(messages) -> str:
    with pytest.raises(chat.ChatError) as ei:
        chat.normalize(messages)
    assert "\n" not in str(ei.value)
    return str(ei.value)


# ---------------------------------------------------------------- normalize

def test_parts_are_joined_with_newlines_and_media_dropped():
    got = chat.normalize([{"role": "user", "content": USER_PARTS},
                          {"role": "assistant", "content": [{"type": "output_text", "text": "a dog"}, "ran"]}])
    assert got == [{"role": "user", "content": "the cat\nsat on the mat"}, {"role": "assistant", "content": "a dog\nran"}]


def test_tool_call_turns_keep_their_calls_and_null_fields_are_dropped():
    calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    got = chat.normalize([{"role": "assistant", "content": None, "tool_calls": calls, "name": None}])
    assert got == [{"role": "assistant", "tool_calls": calls}]


@pytest.mark.parametrize("messages, words", [
    ([], "empty conversation"),
    ({"role": "user"}, "must be a list"),
    (["hi"], "message 0 is a str"),
    ([{"content": "x"}], "message 0 has no role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "message 1 (assistant) has no content"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "message 0 (user) part 0 (text) has null text"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "has a int text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only image_url parts and no text"),
    ([{"role": "user", "content": []}], "an empty content list"),
    ([{"role": "user", "content": [{"type": "hologram"}]}], "type 'hologram'"),
    ([{"role": "user", "content": {"text": "x"}}], "content is a dict"),
])
def test_bad_conversations_name_the_message(messages, words):
    assert words in error(messages)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "image_url",
                                                              "tool_calls", "refusal"]), inner, max_size=4),
                           max_leaves=15)
part = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio"]), "text": st.none()}),
    st.text(max_size=8))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": st.text(max_size=8) | st.lists(part, max_size=4)})


def _expected(content) -> str | None:
    """The text a content must become, computed here without calib.data.chat (None: it must be refused)."""
    if isinstance(content, str):
        return content
    texts = [p if isinstance(p, str) else p["text"] for p in content if isinstance(p, str) or p["type"] == "text"]
    return "\n".join(texts) if texts else None


@settings(max_examples=300, deadline=None)
@given(st.lists(message, min_size=1, max_size=4))
def test_well_formed_conversations_become_their_text(messages):
    before = copy.deepcopy(messages)
    want = [_expected(m["content"]) for m in messages]
    if None in want:
        assert "no text" in error(messages)
    else:
        assert [m["content"] for m in chat.normalize(messages)] == want
    assert messages == before   # the record is not modified


@settings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_is_strings_or_one_line_error(value):
    try:
        got = chat.normalize(value)
    except chat.ChatError as e:
        assert "\n" not in str(e)
        return
    for m in got:
        assert isinstance(m["role"], str) and (isinstance(m.get("content"), str) or m.get("tool_calls"))


# ---------------------------------------------------------------- through calib.data.sources and a template

def _same_as_strings(tmp_path, tok, rows, write=write_jsonl, suffix=".jsonl"):  # noqa: F811
    plain = [{"messages": [{"role": m["role"], "content": _expected(m["content"])} for m in r["messages"]]}
             for r in rows]
    got, _ = read_samples(write(tmp_path / f"parts{suffix}", rows), tok)
    want, _ = read_samples(write_jsonl(tmp_path / "plain.jsonl", plain), tok)
    assert got == want and all(len(s) > 3 for s in got)
    return got


def test_openai_parts_render_like_string_contents(tmp_path, tok):  # noqa: F811
    rows = [{"messages": [{"role": "user", "content": USER_PARTS}, {"role": "assistant", "content": "a dog ran"}]}]
    seqs = _same_as_strings(tmp_path, tok, rows)
    assert tok.unk_token_id not in seqs[0]   # no "[{'type': ..." repr reached the tokenizer


def test_parquet_parts_with_null_fields_render_like_string_contents(tmp_path, tok):  # noqa: F811
    # arrow unifies the part structs: the image part gets text=None and the text parts image_url=None
    rows = [{"messages": [{"role": "user", "content": USER_PARTS}]},
            {"messages": [{"role": "user", "content": "the dog"}, {"role": "assistant", "content": [
                {"type": "text", "text": "a cat"}]}]}]
    rows[1]["messages"][0]["content"] = [{"type": "text", "text": "the dog"}]
    _same_as_strings(tmp_path, tok, rows, write_parquet, ".parquet")


@pytest.mark.parametrize("line, words", [
    ({"messages": []}, "m.jsonl:2: empty conversation"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "m.jsonl:2: message 0 (user) part 0"),
    ({"messages": [{"role": "user"}]}, "m.jsonl:2: message 0 (user) has no content"),
    ({"text": None}, "m.jsonl:2: 'text' is null"),
])
def test_data_errors_name_file_and_line(tmp_path, tok, line, words):  # noqa: F811
    first = {"messages": [{"role": "user", "content": "the cat"}]} if "messages" in line else {"text": "the cat"}
    path = write_jsonl(tmp_path / "m.jsonl", [first, line])
    with pytest.raises(D.DataError) as ei:
        read_samples(path, tok, seed=0)
    assert words in str(ei.value)


def test_a_template_that_refuses_is_a_data_error(tmp_path, tok):  # noqa: F811
    strict = copy.copy(tok)
    strict.chat_template = "{% for m in messages %}{{ raise_exception('roles must alternate') }}{% endfor %}"
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "the cat"}]}])
    with pytest.raises(D.DataError, match=r"m.jsonl:1: the model's chat template refused this conversation"):
        read_samples(path, strict)


# ---------------------------------------------------------------- streams

def _feed(path: Path, payload: bytes) -> threading.Thread:
    def write():
        with open(path, "wb") as f:
            f.write(payload)
    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


ROWS = [{"input_ids": list(range(i, i + 20 + i))} for i in range(10)]


@pytest.mark.parametrize("name, payload", [
    ("fifo", "".join(json.dumps(r) + "\n" for r in ROWS)),
    ("fifo.jsonl", "\n" + "".join(json.dumps(r) + "\n" for r in ROWS)),
])
def test_fifo_streams_like_the_file(tmp_path, name, payload):
    regular = write_jsonl(tmp_path / "d.jsonl", ROWS)
    fifo = tmp_path / name
    os.mkfifo(fifo)
    writer = _feed(fifo, payload.encode())
    got, report = read_samples(fifo, seq_len=64)
    writer.join(5)
    want, want_report = read_samples(regular, seq_len=64)
    assert got == want and report.fingerprint == want_report.fingerprint


def test_fifo_of_text_paragraphs(tmp_path, tok):  # noqa: F811
    fifo = tmp_path / "p"
    os.mkfifo(fifo)
    writer = _feed(fifo, b"the cat sat\n\non the mat\n")
    got, _ = read_samples(fifo, tok, seed=0)
    writer.join(5)
    assert sorted(got) == sorted([[tok.bos_token_id, *tok.convert_tokens_to_ids(t.split())]
                                  for t in ("the cat sat", "on the mat")])


def test_fifo_needing_a_seekable_file_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "d.parquet"
    os.mkfifo(fifo)   # nobody writes: opening it would block forever
    with pytest.raises(D.DataError, match="is a pipe, and '.parquet' needs a seekable file"):
        D.check_source(fifo)


def test_process_substitution_of_a_gzip_file(tmp_path):
    gz = tmp_path / "d.jsonl.gz"
    gz.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode()))
    code = ("import sys; from calib.data import sources as D; r = D.DataReport(); "
            "s = list(D.samples(sys.argv[1], None, seq_len=64, max_samples=99, min_tokens=1, pack=False, seed=0, "
            "vocab_size=None, report=r)); print(r.used, r.fingerprint)")
    out = subprocess.run(["bash", "-c", f'"{sys.executable}" -c "{code}" <(gzip -dc "{gz}")'],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    _, want = read_samples(write_jsonl(tmp_path / "d.jsonl", ROWS), seq_len=64)
    assert out.stdout.split() == [str(len(ROWS)), want.fingerprint]


def test_calibrate_reads_a_fifo_once(tiny_llama_dir, tmp_path):
    """The whole command (checks before the model loads, then the run) opens DATA once: a second open of a
    FIFO would block or see no data."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from calib.cli import main

    payload = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
    outs = []
    for name, data in (("fifo", None), ("file", write_jsonl(tmp_path / "d.jsonl", ROWS))):
        if data is None:
            data = tmp_path / "data-pipe"
            os.mkfifo(data)
            writer = _feed(data, payload)
        out = tmp_path / f"out-{name}"
        r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_llama_dir), "--data", str(data), "--seq-len",
                                      "32", "--samples", "8", "--device", "cpu", "--out", str(out)])
        assert r.exit_code == 0, r.output
        outs.append(load_file(out / "kv_scales.safetensors"))
    writer.join(5)
    assert outs[0].keys() == outs[1].keys() and all((outs[0][k] == outs[1][k]).all() for k in outs[0])
