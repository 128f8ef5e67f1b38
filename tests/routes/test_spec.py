"""routes.yaml (calib/routes/spec.py): a good file read into frozen dataclasses; every bad input one line naming
the file, the route and the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from calib.routes import spec

GOOD = """
routes:
  chat:
    data: chat.jsonl
    buckets: [2048, 512]
    bar: {max_kl: 0.02, max_ppl_increase: 0.015, min_passkey: 0.8}
  long-docs:
    data: docs
    buckets: [8192]
    samples: 8
    pack: true
"""


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "chat.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.jsonl").write_text('{"text": "a long document"}\n')
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    (tmp_path / "nothing").mkdir()
    return tmp_path


def _load(folder: Path, text: str) -> spec.Routes:
    path = folder / "routes.yaml"
    path.write_text(text)
    return spec.load(path)


def test_a_good_file(folder):
    r = _load(folder, GOOD)
    chat, docs = r.routes
    assert chat == spec.Route("chat", folder / "chat.jsonl", (512, 2048), spec.Bar(0.02, 0.015, 0.8), 64, False)
    assert docs == spec.Route("long-docs", folder / "docs", (8192,), spec.Bar(), 8, True)
    assert docs.bar == spec.Bar(max_kl=0.01, max_ppl_increase=0.01, min_passkey=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chat.samples = 3      # type: ignore[misc]
    assert chat.to_dict() == {"data": str(folder / "chat.jsonl"), "buckets": [512, 2048],
                              "bar": {"max_kl": 0.02, "max_ppl_increase": 0.015, "min_passkey": 0.8},
                              "samples": 64, "pack": False}


BAD = [
    ("routes: {}", "field 'routes' must map route names to their data, buckets and bar"),
    ("rutes:\n  chat: {data: chat.jsonl, buckets: [512]}", "unknown field 'rutes' (fields: routes)"),
    ("- chat", "must be a mapping of field: value, got list"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bukets: [1]}",
     "route 'chat': unknown field 'bukets' (fields: data, buckets, bar, samples, pack)"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bar: {max_k1: 0.1}}",
     "route 'chat' field 'bar': unknown field 'max_k1' (fields: max_kl, max_ppl_increase, min_passkey)"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: 512}",
     "route 'chat' field 'buckets' = 512: give a list of token lengths >= 2, e.g. [512, 2048]"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [1]}", "route 'chat' field 'buckets' = [1]: give a list"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [true]}", "route 'chat' field 'buckets' = [True]: give a list"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: []}", "route 'chat' field 'buckets' = []: give a list"),
    ("routes:\n  chat: {data: chat.jsonl}", "route 'chat': field 'buckets' is missing"),
    ("routes:\n  chat: {buckets: [512]}", "route 'chat': field 'data' is missing"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bar: {max_kl: -1}}",
     "route 'chat' field 'bar.max_kl' = -1: expected a finite number >= 0"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bar: {max_ppl_increase: .nan}}",
     "route 'chat' field 'bar.max_ppl_increase' = nan: expected a finite number >= 0"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bar: {min_passkey: 80}}",
     "route 'chat' field 'bar.min_passkey' = 80: expected a finite number in [0, 1]"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], bar: [1]}",
     "route 'chat' field 'bar' must be a mapping of field: value, got list"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], samples: 0}",
     "route 'chat' field 'samples' = 0: expected a whole number in [1, 1000000]"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512], pack: 'yes'}",
     "route 'chat' field 'pack' = 'yes': give true or false"),
    ("routes:\n  'a b': {data: chat.jsonl, buckets: [512]}", "route name 'a b': use letters, digits"),
    ("routes:\n  chat: {data: missing.jsonl, buckets: [512]}",
     "route 'chat' field 'data': {folder}/missing.jsonl not found; each route needs its own held-out data"),
    ("routes:\n  chat: {data: empty.jsonl, buckets: [512]}",
     "route 'chat' field 'data': {folder}/empty.jsonl is empty; give the route held-out records"),
    ("routes:\n  chat: {data: nothing, buckets: [512]}",
     "route 'chat' field 'data': {folder}/nothing is empty; give the route held-out records"),
    ("routes:\n  chat: {data: '', buckets: [512]}", "route 'chat' field 'data' = '': give the path"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512]}\n  chat: {data: chat.jsonl, buckets: [64]}", "duplicate"),
    ("routes:\n  chat: &a {data: chat.jsonl, buckets: [512]}\n  two: *a", "anchor"),
    # names the plan folder writes itself, and names one folder apart on a case-blind file system
    ("routes:\n  plan.json: {data: chat.jsonl, buckets: [512]}",
     ": route name 'plan.json' is the plan's own file plan.json; rename the route"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512]}\n  Plan.MD: {data: chat.jsonl, buckets: [512]}",
     ": route name 'Plan.MD' is the plan's own file plan.md"),
    ("routes:\n  chat: {data: chat.jsonl, buckets: [512]}\n  Chat: {data: chat.jsonl, buckets: [512]}",
     ": routes 'chat' and 'Chat' differ only in case"),
    # data paths: a user this machine does not know, a home it cannot find
    ("routes:\n  chat: {data: '~nosuchuser/chat.jsonl', buckets: [512]}",
     "route 'chat' field 'data': ~nosuchuser/chat.jsonl: no user 'nosuchuser' on this machine (~nosuchuser)"),
]


@pytest.mark.parametrize("text,message", BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_is_one_line_naming_the_route_and_field(folder, text, message):
    with pytest.raises(spec.RoutesError) as e:
        _load(folder, text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"routes file {folder / 'routes.yaml'}")
    assert message.format(folder=folder) in msg


def test_a_missing_routes_file(tmp_path):
    with pytest.raises(spec.RoutesError, match=r"routes file .*nope.yaml not found"):
        spec.load(tmp_path / "nope.yaml")


def test_route_data_emptiness_is_read_a_chunk_at_a_time(folder):
    """Whitespace past the first chunk, then a record: not empty. A file far larger than memory (sparse) is
    checked on its first bytes, never read whole."""
    (folder / "late.jsonl").write_text(" " * (1 << 17) + '{"text": "x"}\n')
    with open(folder / "huge.jsonl", "wb") as f:
        f.write(b'{"text": "x"}\n')
        f.truncate(1 << 40)       # a terabyte, sparse: reading it whole would take the machine down
    r = _load(folder, "routes:\n  a: {data: late.jsonl, buckets: [512]}\n  b: {data: huge.jsonl, buckets: [512]}\n")
    assert [x.data for x in r.routes] == [folder / "late.jsonl", folder / "huge.jsonl"]


def test_no_home_is_one_line(folder, monkeypatch):
    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr("pwd.getpwuid", lambda uid: (_ for _ in ()).throw(KeyError(uid)))
    with pytest.raises(spec.RoutesError, match="field 'data': ~/chat.jsonl: no home folder is known here"):
        _load(folder, "routes:\n  chat: {data: '~/chat.jsonl', buckets: [512]}\n")
