"""Options for the engine tests, which run inside the separate vLLM venv (see `make engine-test`).

`--min-passed N`: the engine tests skip what a checkpoint or host cannot show, so a run where everything
skipped would look green. With `--ckpt`, a session in which fewer than N tests passed fails; `make
engine-test` sets N per checkpoint to what a host without an FP8 cache still checks.
"""

from pathlib import Path

import pytest

# Checkpoint features whose tests skip when the checkpoint lacks them; `--require` makes that a failure.
FEATURES = ("per-head", "q-scale", "skip-layers", "fp8-kv")
CACHE_DTYPES = ("fp8", "bfloat16", "fp8-or-bfloat16")


def pytest_addoption(parser):
    _add_eval_options(parser)
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
    parser.addoption(
        "--kv-cache-dtype",
        action="store",
        default="fp8-or-bfloat16",
        choices=CACHE_DTYPES,
        help="cache dtype the probe asks vLLM for; the default falls back to bfloat16 where vLLM refuses FP8",
    )
    parser.addoption(
        "--probe-max-tokens",
        action="store",
        type=int,
        default=16,
        help="greedy tokens the probe generates (at least 1: test_generates_tokens); 1 for FP8-weight checkpoints, "
             "whose GEMMs run through torch's slow CPU float8 matmul",
    )
    parser.addoption(
        "--min-passed",
        action="store",
        type=int,
        default=1,
        help="with --ckpt, fail the session when fewer tests than this passed (a run that only skips is red)",
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
def probe_max_tokens(request) -> int:
    return request.config.getoption("--probe-max-tokens")


@pytest.fixture(scope="session")
def cache_dtype(request) -> str:
    return request.config.getoption("--kv-cache-dtype")


_passed = []


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        _passed.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    want = config.getoption("--min-passed")
    if config.getoption("--ckpt") and exitstatus == 0 and len(_passed) < want:
        print(f"\n--min-passed {want}: only {len(_passed)} engine tests passed on {config.getoption('--ckpt')}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def required(request) -> set[str]:
    value = request.config.getoption("--require")
    features = {f.strip() for f in value.split(",") if f.strip()}
    unknown = sorted(features - set(FEATURES))
    if unknown:
        pytest.fail(f"--require {value}: unknown {unknown}; choose from {', '.join(FEATURES)}")
    return features


def _add_eval_options(parser):
    """Options of tests/engine/test_vllm_eval.py (`kvcalib eval --engine vllm` end to end)."""
    parser.addoption("--kvcalib", action="store", default=None,
                     help="kvcalib executable of the project's venv; the eval engine test skips without it")
    parser.addoption("--eval-model", action="store", default=None,
                     help="model directory to evaluate (default: kvcalib's embedded default model)")
