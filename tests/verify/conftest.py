"""Fixtures the verify tests share."""

import pytest


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama saved as a source checkpoint, once per module."""
    from tiny import tiny_causal_lm
    path = tmp_path_factory.mktemp("src") / "tiny-llama"
    tiny_causal_lm("llama").save_pretrained(path)
    return path
