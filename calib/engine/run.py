"""The engine arms of an evaluation: which arms an engine can serve, one runner call each, and their numbers.

Why: the emulation is only useful where it has been shown to match the engine (docs/design.md §6), so
`kvcalib eval --engine vllm` runs every arm the engine can serve on exactly the evaluation's token ids:
the reference (model-dtype KV), FP8 with the default scale, each checkpoint's scales, and the skip trials
(served with the engine's skip flag). An arm the engine cannot serve — INT8 KV in vLLM, what-ifs from a
statistics file that no checkpoint holds, an FP8 cache the machine refuses — gets an entry that says
"not run" and why; nothing is ever filled in from the emulation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from calib.engine import driver, metrics, protocol, support
from calib.evaluation import passkey
from calib.progress import SILENT, Progress

KV_DTYPES = {"fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}      # kvcalib dtype -> vLLM --kv-cache-dtype
# The attention backend vLLM needs for a per-token-head cache: only its Triton backend implements them
# (vllm/v1/attention/backends/triton_attn.py `TritonAttentionBackend.supported_kv_cache_dtypes`; the support
# matrix, calib.engine.support, cites it).
DYNAMIC_BACKEND = "TRITON_ATTN"
INT8_SERVED_BY = ("vLLM has no INT8 KV cache (the support matrix, calib.engine.support: "
                  + support.who_serves("int8") + ")")


def format_arm(arm: Any, model: str, offered: Sequence[str] | None = None) -> dict[str, Any] | str:
    """The runner's arm spec for a whole-format arm (kind `format`: fp8_e5m2, the per-token-head caches), or why
    the engine cannot serve it. `offered`: the cache dtypes the engine's probe listed (None: not known)."""
    name = arm.dtype.engine
    if name is None:
        return f"vLLM has no {arm.dtype.name} KV cache"
    if offered is not None and name not in offered:
        return f"this vLLM does not offer --kv-cache-dtype {name} (it offers: {', '.join(offered)})"
    spec = {"name": arm.name, "model": model, "kv_cache_dtype": name,
            "skip_layers": sorted(set(arm.skip) | set(arm.serve_skip))}
    if arm.dtype.dynamic:
        spec["attention_backend"] = DYNAMIC_BACKEND
    return spec


def request_arm(arm: Any, model: str, offered: Sequence[str] | None = None) -> dict[str, Any] | str:
    """The runner's arm spec for an evaluation arm, or why the engine cannot serve it."""
    if arm.dtype is None:
        return {"name": arm.name, "model": model, "kv_cache_dtype": "auto", "skip_layers": []}
    if arm.kind == "format":
        return format_arm(arm, model, offered)
    if arm.dtype.name not in KV_DTYPES:
        return INT8_SERVED_BY
    if arm.kind == "stats":
        return ("a what-if from a statistics file, not a checkpoint: export it (`kvcalib export --stats`) and pass "
                "it with --scales to measure it in the engine")
    if arm.kind == "checkpoint" and arm.name.endswith("@tensor"):
        head = support.outcome("vllm", support.Calibrated(arm.dtype.name, "head"))
        return (f"the engine serves the checkpoint `{arm.source}` itself: see that arm's engine numbers (per-head "
                f"scales: {'; '.join(head.lines())})")
    if arm.kind not in ("default", "checkpoint"):
        return f"arm kind {arm.kind!r} has no engine form"
    return {"name": arm.name, "model": arm.source if arm.kind == "checkpoint" else model,
            "kv_cache_dtype": KV_DTYPES[arm.dtype.name], "skip_layers": sorted(set(arm.skip) | set(arm.serve_skip))}


@dataclass
class EngineRun:
    """One engine for one evaluation: the spec, the evaluation's token ids and the reference run, kept so
    that arms measured later (skip trials) compare against the same reference."""
    spec: driver.EngineSpec
    version: str
    model: str
    model_dtype: str
    samples: Sequence[Any]                      # calib.evaluation.samples.Sample: ids and bucket
    buckets: Sequence[int]
    prompts: Sequence[passkey.Prompt] = ()
    tokenizer: Any = None
    context: int | None = None                  # the model's max positions
    progress: Progress = SILENT
    reference: dict[str, Any] | None = field(default=None, init=False)
    reference_reason: str | None = field(default=None, init=False)

    def _request(self, arm_spec: dict[str, Any]) -> dict[str, Any]:
        cont = self.spec.continuation_tokens
        need = max([len(s.ids) + cont for s in self.samples] + [len(p.ids) + passkey.MAX_NEW_TOKENS for p in self.prompts])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return {"protocol": protocol.PROTOCOL, "arm": arm_spec, "samples": [list(s.ids) for s in self.samples],
                "continuation_tokens": cont, "passkey": [list(p.ids) for p in self.prompts],
                "passkey_tokens": passkey.MAX_NEW_TOKENS, "stop_token_ids": [] if eos is None else [int(eos)],
                "top_k": self.spec.top_k, "kv_gib": self.spec.kv_gib,
                "max_model_len": min(need, self.context) if self.context else need, "dtype": self.model_dtype,
                "seed": 0, "chunk": self.spec.chunk}

    def _call(self, arm_spec: dict[str, Any], label: str) -> dict[str, Any]:
        cont = self.spec.continuation_tokens
        total = sum(len(s.ids) + cont for s in self.samples) + sum(len(p.ids) + passkey.MAX_NEW_TOKENS
                                                                   for p in self.prompts)
        with self.progress.stage(f"{self.spec.name} `{arm_spec['name']}`", total, samples=len(self.samples),
                                 prompts=len(self.prompts)) as stage:
            stage.labels = {"arm": label}
            seen = [0]

            def on_progress(p: dict[str, int]) -> None:
                stage.advance(p.get("tokens", 0) - seen[0], samples=p.get("samples", 0), prompts=p.get("passkey", 0))
                seen[0] = p.get("tokens", 0)
            resp = driver.run(self.spec, self._request(arm_spec), on_progress, self.version)
            if resp["status"] != protocol.OK:
                stage.labels = {"arm": label, "status": f"not run: {resp['reason']}"}
            return resp

    def _entry(self, resp: dict[str, Any]) -> dict[str, Any]:
        base = {"engine": self.spec.name, "version": resp.get("version") or self.version}
        if resp["status"] != protocol.OK:
            return {**base, "status": protocol.NOT_RUN, "reason": resp["reason"]}
        if self.reference is None:
            raise RuntimeError("engine arms are measured after the reference")
        arm = None if resp is self.reference else resp
        try:
            nums = metrics.table(self.reference, arm, [s.ids for s in self.samples], self.buckets,
                                 [s.bucket for s in self.samples])
        except (ValueError, IndexError, KeyError) as e:
            return {**base, "status": protocol.NOT_RUN, "reason": f"the engine's answer does not fit the request: {e}"}
        cap = resp.get("kv_capacity_tokens")
        out = {**base, "status": protocol.OK, "kv_cache_dtype": resp["kv_cache_dtype"], **nums,
               "kv_capacity_tokens": cap, "kv_gib": resp["kv_gib"],
               "tokens_per_gib": cap / resp["kv_gib"] if cap and resp["kv_gib"] else None,
               "bytes_per_token": _bytes_per_token(cap, resp["kv_gib"]),
               "seconds": resp["seconds"]}
        if self.prompts and self.tokenizer is not None:
            out["passkey"] = passkey.summarize([
                passkey.score(p, self.tokenizer.decode(ids, skip_special_tokens=True))
                for p, ids in zip(self.prompts, resp["passkey"])])
        return out

    def measure(self, reference: Any, arms: Sequence[Any]) -> dict[str, dict[str, Any]]:
        """{arm name: engine entry} for the reference (on the first call) and every arm given."""
        out: dict[str, dict[str, Any]] = {}
        todo = ([] if self.reference is not None or self.reference_reason else [reference]) + list(arms)
        for j, arm in enumerate(todo):
            spec = request_arm(arm, self.model, driver.offered(self.spec))
            label = f"arm {j + 1}/{len(todo)}"
            if isinstance(spec, str):
                out[arm.name] = {"engine": self.spec.name, "version": self.version, "status": protocol.NOT_RUN,
                                 "reason": spec}
                continue
            if arm is not reference and self.reference is None:
                out[arm.name] = {"engine": self.spec.name, "version": self.version, "status": protocol.NOT_RUN,
                                 "reason": f"the engine's {reference.name.upper()}-KV reference run did not run "
                                           f"({self.reference_reason})"}
                continue
            resp = self._call(spec, label)
            if arm is reference:
                if resp["status"] == protocol.OK:
                    self.reference = resp
                else:
                    self.reference_reason = resp["reason"]
            out[arm.name] = self._entry(resp)
        return out


def _bytes_per_token(capacity: int | None, kv_gib: int) -> float | None:
    """The engine's measured cache bytes per token (all layers): its pool over the tokens it fits."""
    return kv_gib * 2 ** 30 / capacity if capacity and kv_gib else None
