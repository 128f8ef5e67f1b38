"""Options for the engine tests, which run inside the separate vLLM venv (see `make engine-test`)."""

from pathlib import Path

import pytest

# Checkpoint features whose tests skip when the checkpoint lacks them; `--require` makes that a failure.
FEATURES = ("per-head", "q-scale", "skip-layers")


def pytest_addoption(parser):
    parser.addoption(
        "--ckpt",
        action="store",
        default=None,
        help="directory of a checkpoint exported with target 'vllm'; the engine tests skip without it",
    )
    parser.addoption(
        "--require",
        action="store",
        default="",
        help=f"comma list of {', '.join(FEATURES)}: the checkpoint must have them (their tests fail, not skip)",
    )


@pytest.fixture(scope="session")
def ckpt(request) -> Path:
    value = request.config.getoption("--ckpt")
    if not value:
        pytest.skip("engine tests need --ckpt <exported checkpoint dir>")
    path = Path(value).resolve()
    if not (path / "config.json").is_file():
        pytest.fail(f"--ckpt {value}: no config.json there, not a checkpoint directory")
    return path


@pytest.fixture(scope="session")
def required(request) -> set[str]:
    value = request.config.getoption("--require")
    features = {f.strip() for f in value.split(",") if f.strip()}
    unknown = sorted(features - set(FEATURES))
    if unknown:
        pytest.fail(f"--require {value}: unknown {unknown}; choose from {', '.join(FEATURES)}")
    return features
