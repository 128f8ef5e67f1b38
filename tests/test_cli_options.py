"""The shared option set (calib/cli_options.py): no option two commands share may differ in type, default or help;
the options that had drifted exist everywhere a model loads; defaults come from the config dataclasses; the
engines' names (--kv-cache-dtype, vLLM's fp8) and the deprecated aliases; --emulate's default follows the GPU."""

from __future__ import annotations

import json
from collections import defaultdict

import click
import pytest
from click.testing import CliRunner

from calib import cli_options as opts
from calib.cli import main

FAMILY = ("calibrate", "eval", "validate", "tune", "plan")


def options_of(command: click.Command) -> dict[str, click.Option]:
    """A command's visible options by their first name (the drift test's view)."""
    return {p.opts[0]: p for p in command.params if isinstance(p, click.Option) and not p.hidden}


def _shared() -> dict[str, dict[str, click.Option]]:
    by_name: dict[str, dict[str, click.Option]] = defaultdict(dict)
    for cmd in FAMILY:
        for name, p in options_of(main.commands[cmd]).items():
            by_name[name][cmd] = p
    return {n: c for n, c in by_name.items() if len(c) > 1}


def _info(p: click.Option) -> dict:
    d = p.to_info_dict()
    d.pop("name")          # the Python parameter name is the command's business; what the user types is not
    return d


def test_an_option_two_commands_share_is_one_option():
    shared = _shared()
    assert len(shared) >= 30, sorted(shared)
    for name, per_cmd in shared.items():
        first, *rest = per_cmd.items()
        for cmd, p in rest:
            assert _info(p) == _info(first[1]), f"{name}: {cmd} differs from {first[0]}"


def test_a_shared_option_takes_its_default_from_the_config(monkeypatch):
    """None (or a flag's off): the command passes on only what was given and the dataclass default applies."""
    from calib.load.spec import LoadSpec

    # the load options (calib/load/options.py) show LoadSpec's values: LoadSpec imports nothing heavy
    load = {"--output-tokens": LoadSpec.output_tokens, "--max-concurrency": LoadSpec.max_concurrency,
            "--requests-per-level": LoadSpec.requests_per_level, "--slo-ttft-ms": LoadSpec.slo_ttft_ms,
            "--slo-tpot-ms": LoadSpec.slo_tpot_ms, "--speed-noise": LoadSpec.noise}
    monkeypatch.delenv("KVCALIB_VLLM_VENV", raising=False)
    for name, per_cmd in _shared().items():
        cmd, p = next(iter(per_cmd.items()))
        if name == "--progress":           # no config holds it: stderr lines are the command line's own
            continue
        # under main's context, as a run has it: a context without it would leave the command's help option
        # cached without main's `-h` for every later test
        parent = main.make_context("kvcalib", [cmd], resilient_parsing=True)
        parsed = main.commands[cmd].make_context(cmd, [], parent=parent, resilient_parsing=True).params
        assert parsed[p.name] == load[name] if name in load else parsed[p.name] in (None, False, ()), name


@pytest.mark.parametrize("option, commands", [
    ("--trust-remote-code", FAMILY), ("--engine-timeout", ("eval", "validate", "tune", "plan")),
    ("--batch-size", FAMILY), ("--engine-version", FAMILY), ("--device-map", FAMILY), ("--max-memory", FAMILY),
    ("--offload-folder", FAMILY), ("--kv-cache-dtype", ("calibrate", "eval")), ("--stats-out", ("calibrate",)),
])
def test_options_that_had_drifted_are_on_every_command_that_needs_them(option, commands):
    have = [c for c in FAMILY if option in options_of(main.commands[c])]
    assert have == list(commands)


def test_help_names_the_defaults_the_run_uses():
    from calib.evaluation import significance
    from calib.evaluation.config import EvalConfig
    from calib.tune.search import TuneConfig

    assert EvalConfig.passkey_trials == significance.DEFAULT_TRIALS == 16    # one default, config and CLI
    out = " ".join(CliRunner().invoke(main, ["eval", "--help"]).output.split())
    assert f"Default: {EvalConfig.passkey_trials} (enough to detect a 10-point drop)" in out
    assert "eval and validate 64" in out and "eval and validate 512,2048,8192" in out and "tune 512,2048" in out
    assert (TuneConfig.eval_samples, TuneConfig.buckets) == (32, (512, 2048))
    for cmd in (*FAMILY, "export"):
        r = CliRunner().invoke(main, [cmd, "--help"])
        assert r.exit_code == 0 and "{" not in r.output, r.output


def test_kv_cache_dtype_takes_vllms_names_and_the_old_name_says_it_is_deprecated(tiny_llama_dir, token_data, tmp_path):
    base = ["calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data), "--samples", "4",
            "--seq-len", "16", "--device", "cpu", "--target", ""]
    r = CliRunner().invoke(main, [*base, "--kv-cache-dtype", "fp8", "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "a" / "kvcalib.json").read_text())["recipe"]["dtype"] == "fp8_e4m3"
    assert "deprecated" not in r.output
    r = CliRunner().invoke(main, [*base, "--dtype", "int8", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "b" / "kvcalib.json").read_text())["recipe"]["dtype"] == "int8"
    assert [ln for ln in r.output.splitlines() if "deprecated" in ln] == [
        "warning: --dtype is deprecated; use --kv-cache-dtype (same values)"]
    r = CliRunner().invoke(main, [*base, "--dtype", "int8", "--kv-cache-dtype", "fp8", "--out", str(tmp_path / "c")])
    assert r.exit_code == 2 and "--dtype and --kv-cache-dtype both given" in r.output
    r = CliRunner().invoke(main, [*base, "--kv-cache-dtype", "fp8_e5m2", "--out", str(tmp_path / "d")])
    assert r.exit_code == 2 and "'fp8_e5m2': choose one of fp8, fp8_e4m3, int8" in r.output
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_stats_out_is_a_file_everywhere_and_tunes_folder_is_stats_dir(tmp_path):
    assert isinstance(options_of(main.commands["calibrate"])["--stats-out"].type, click.Path)
    assert options_of(main.commands["calibrate"])["--stats-out"].type.dir_okay is False
    assert "--stats-out" not in options_of(main.commands["tune"])          # hidden: the deprecated alias
    r = CliRunner().invoke(main, ["tune", "--model", str(tmp_path / "m"), "--stats", "x.safetensors",
                                  "--stats-out", str(tmp_path / "s")])
    assert r.exit_code == 1, r.output
    assert r.output.splitlines() == ["warning: --stats-out is deprecated; use --stats-dir (same values)",
                                     "Error: --stats-dir with --stats: the statistics already exist; drop --stats-dir"]


@pytest.mark.parametrize("capability, expected", [((9, 0), "vllm-fa3"), ((8, 0), "vllm-cpu"), (None, "vllm-cpu")])
def test_emulate_defaults_to_fa3_on_a_hopper_gpu(monkeypatch, capability, expected):
    import torch

    from calib.evaluation import emulate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert emulate.for_this_machine() == expected


def test_placement_options_are_checked_before_any_model_loads(tmp_path):
    r = CliRunner().invoke(main, ["eval", "--max-memory", "0=1GiB", "--out", str(tmp_path / "e")])
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == \
        "Error: --max-memory and --offload-folder need --device-map (e.g. --device-map auto)"
    r = CliRunner().invoke(main, ["tune", "--device-map", "auto", "--max-memory", "0", "--out", str(tmp_path / "t")])
    assert r.exit_code == 1 and "--max-memory '0': use device=size pairs" in r.output
    assert not (tmp_path / "e").exists() and not (tmp_path / "t").exists()
