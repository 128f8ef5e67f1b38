"""Options for the engine tests, which run inside the separate vLLM venv (see `make engine-test`)."""

from pathlib import Path

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--ckpt",
        action="store",
        default=None,
        help="directory of a checkpoint exported with target 'vllm'; the engine tests skip without it",
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
