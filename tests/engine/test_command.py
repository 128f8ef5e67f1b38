"""One serve-command builder (calib.engine.command): calibrate, eval's verdict, plan and tune print the same flags
for the same checkpoint, and no engine is ever given another engine's flag."""

from __future__ import annotations

import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from calib.ckpt.kvinfo import read_kv_info
from calib.cli import main
from calib.engine import command
from calib.evaluation.verdict import how_to_serve
from calib.recipe import support
from calib.routes import plan, spec
from calib.tune import output
from helpers import arm_metrics


def _tail(text: str, path: str) -> str:
    """The flags after `path` in a serve line (or in eval's advice, which prints the flags alone)."""
    return text.split(path, 1)[1].strip() if path in text else text


def test_calibrate_eval_plan_and_tune_agree_for_one_checkpoint(tiny_llama_dir, token_data, tmp_path):
    """A checkpoint that keeps layer 1 in the model dtype: every command serves it with that layer skipped (plan
    used to drop the flag, so vLLM quantized the layer at scale 1.0)."""
    ck = tmp_path / "ck"
    r = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_llama_dir), "--data", str(token_data), "--out",
                                  str(ck), "--seq-len", "32", "--samples", "4", "--device", "cpu", "--skip-layers", "1"])
    assert r.exit_code == 0, r.output
    printed = next(ln.strip() for ln in r.output.splitlines() if ln.strip().startswith("vllm serve"))
    skipped = tuple((read_kv_info(ck).provenance or {}).get("skipped_layers") or ())
    assert skipped == (1,)
    arm = arm_metrics(source=str(ck), serve_skip=skipped)
    advice = how_to_serve(arm.info).split("`")[-2]           # serve `CK` (vLLM: `FLAGS`)
    route = spec.Route("chat", Path("d.jsonl"), (64,), spec.Bar())
    result = SimpleNamespace(verdict=SimpleNamespace(action="ship", within_threshold=("cal",)), arms={"cal": arm})
    planned = plan.decide(route, str(tiny_llama_dir), result)
    tuned = output.serve_command("vllm", ck, list(skipped))
    want = "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1"
    assert printed == tuned == command.line("vllm", str(ck), "fp8_e4m3", skipped) == f"vllm serve {ck} {want}"
    assert advice == want
    assert planned.serve == f"vllm serve {ck} --max-model-len 64 {want}"
    assert planned.serve_argv == shlex.split(planned.serve)


@pytest.mark.parametrize("target", ["sglang", "trtllm"])
def test_other_targets_never_get_vllms_flag(target):
    info = arm_metrics(source="/ck").info
    text = how_to_serve(info, target)
    assert "--kv-cache-dtype fp8`" not in text and "--kv-cache-dtype fp8 " not in text
    assert support.ENGINES[target].title in text
    if target == "sglang":
        assert "`--kv-cache-dtype fp8_e4m3`" in text
    int8 = how_to_serve(arm_metrics(dtype="int8", source="/ck").info, target)
    assert "--kv-cache-dtype" not in int8


def test_an_engine_without_the_flag_is_an_error_not_another_engines_flag():
    with pytest.raises(support.SupportError, match="vLLM has no --kv-cache-dtype for int8"):
        command.flags("vllm", "int8")
    with pytest.raises(support.SupportError, match="SGLang cannot keep layers \\[1\\] in the model dtype"):
        command.flags("sglang", "fp8_e4m3", [1])
    assert command.argv("trtllm", "/c", "int8", (), 4096) == ["trtllm-serve", "/c", "--max_seq_len", "4096"]
    assert command.flags("vllm", "fp8_per_token_head", ["sliding_window", 3]) == [
        "--kv-cache-dtype", "fp8_per_token_head", "--kv-cache-dtype-skip-layers", "3", "sliding_window",
        "--attention-backend", "TRITON_ATTN"]
    assert command.line("vllm", "/my model") == "vllm serve '/my model'"


def test_the_engine_arm_and_the_plan_read_vllms_names_from_the_registry():
    """An INT8 arm is "not run" with the support matrix's one line (vLLM has no static INT8 cache) and who serves INT8
    instead; plan's Decision holds vLLM's --kv-cache-dtype value and turns it back into kvcalib's format by the
    registry (fp8 -> fp8_e4m3, auto: the model's dtype, no flag)."""
    from calib.engine import run
    from calib.recipe import dtypes

    why = run.request_arm(SimpleNamespace(dtype=dtypes.INT8, kind="checkpoint", name="ck", source="/ck"), "m")
    assert why.startswith("vLLM has no static INT8 KV cache (not a --kv-cache-dtype choice")
    assert "run at scale 1.0 by TensorRT-LLM 1.4" in why and "TensorRT-LLM +pr18953" in why
    assert run.lacks(dtypes.FP8_E4M3) is None and run.lacks(dtypes.FP8_E5M2) is None

    def argv(kv: str) -> list[str]:
        return plan.Decision("r", plan.FP8, "a", "/ck", kv, (2,), 4096, None, "").serve_argv

    assert argv("fp8") == ["vllm", "serve", "/ck", "--max-model-len", "4096", "--kv-cache-dtype", "fp8",
                           "--kv-cache-dtype-skip-layers", "2"]
    assert argv("fp8_e5m2")[5:7] == ["--kv-cache-dtype", "fp8_e5m2"]
    assert "--kv-cache-dtype" not in argv("auto")
