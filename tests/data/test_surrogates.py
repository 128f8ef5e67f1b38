"""Text holding a lone surrogate (JSON's `\\ud800`, no Unicode character) is refused with one line naming the file and
line, never replaced and never a tokenizer traceback (calib/data/sources.py): calibrating on replaced characters would
use text the user never wrote."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from calib.data import sources as D
from helpers import read_samples

SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


def _error(path, tok) -> str:
    with pytest.raises(D.DataError) as e:
        read_samples(path, tok, seq_len=64)
    assert "\n" not in str(e.value)
    return str(e.value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before=TEXT, bad=SURROGATE, after=TEXT, line=st.integers(1, 4), chat=st.booleans())
def test_a_lone_surrogate_anywhere_is_one_error_naming_file_line_and_code_point(tmp_path_factory, tok, before, bad,
                                                                                 after, line, chat):
    path = tmp_path_factory.mktemp("sur") / "d.jsonl"
    text = before + bad + after
    good = {"messages": [{"role": "user", "content": "the cat sat"}]} if chat else {"text": "the cat sat on the mat"}
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}]} if chat \
        else {"text": text}
    lines = [json.dumps(good)] * (line - 1) + [json.dumps(record)]      # json.dumps writes "\udXXX" escapes
    path.write_text("\n".join(lines) + "\n")
    msg = _error(path, tok)
    assert msg.startswith(f"{path}:{line}: the text holds a lone surrogate (U+{ord(bad):04X}"), msg


@settings(max_examples=60, deadline=None)
@given(value=st.recursive(TEXT | st.integers() | st.none(),
                          lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=8))
def test_text_without_surrogates_passes_the_check(value):
    D._check_unicode(value, "x")


def test_a_pair_of_surrogates_in_json_is_one_character_and_fine(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "the cat \\ud83d\\ude00 sat"}\n')          # a proper pair: U+1F600
    seqs, _ = read_samples(path, tok, seq_len=64)
    assert len(seqs) == 1
