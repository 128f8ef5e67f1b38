"""The engine arms of an evaluation: which arms an engine can serve, one runner call per engine start, and
their numbers.

Why: the emulation is only useful where it has been shown to match the engine (docs/design.md §6), so
`kvcalib eval --engine vllm` runs every arm the engine can serve on exactly the evaluation's token ids:
the reference (model-dtype KV), FP8 with the default scale, each checkpoint's scales, and the skip trials
(served with the engine's skip flag). Arms that differ only in their KV scales share one engine start
(calib/engine/serve.py): the runner sets each one's scales in place and reads them back; an arm whose
scales did not take is "not run" and says which layer holds what. An arm the engine cannot serve — INT8
KV in vLLM, what-ifs from a statistics file that no checkpoint holds, an FP8 cache the machine refuses —
gets an entry that says "not run" and why; nothing is ever filled in from the emulation.

The engine returns raw numbers, typed once (calib.engine.metrics.EngineNumbers): log-probabilities become KL and
perplexity here, against the engine's own reference run; passkey answers stay generated ids, which the evaluation
scores as it scores its own (calib.evaluation.passkey.score_engine).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from calib.engine import driver, metrics, protocol, serve
from calib.engine.metrics import EngineNumbers
from calib.progress import SILENT, Progress
from calib.recipe import support

# What an arm's serve command is made of (its runner spec's fields), kept on its engine entry for `kvcalib validate`.
SERVE_KEYS = ("model", "kv_cache_dtype", "skip_layers", "attention_backend", "cuda_attention_backend")


def lacks(dtype: Any) -> str | None:
    """Why vLLM cannot serve a `dtype` cache (the support matrix's one line; for a calibrated format also who
    serves its scales); None: it can."""
    line = support.lacks_format("vllm", dtype.name)
    if line is None or dtype.dynamic:
        return line
    return f"{line} ({support.who_serves(dtype.name)})"


def format_arm(arm: Any, model: str, offered: Sequence[str] | None = None) -> dict[str, Any] | str:
    """The runner's arm spec for a whole-format arm (kind `format`: fp8_e5m2, the per-token-head caches), with the
    attention backend the format needs in vLLM (calib.recipe.dtypes `Served`), or why the engine cannot serve it.
    `offered`: the cache dtypes the engine's probe listed (None: not known)."""
    if (why := lacks(arm.dtype)) is not None:
        return why
    served = arm.dtype.served("vllm")
    name = served.names[0]
    if offered is not None and name not in offered:
        return f"this vLLM does not offer --kv-cache-dtype {name} (it offers: {', '.join(offered)})"
    backends = {"attention_backend": served.backend, "cuda_attention_backend": served.cuda_backend}
    return {"name": arm.name, "model": model, "kv_cache_dtype": name,
            "skip_layers": sorted(set(arm.skip) | set(arm.serve_skip)), "scales": None,
            **{key: backend for key, backend in backends.items() if backend}}


def request_arm(arm: Any, model: str, offered: Sequence[str] | None = None) -> dict[str, Any] | str:
    """The runner's arm spec for an evaluation arm, or why the engine cannot serve it."""
    if arm.dtype is None:
        return {"name": arm.name, "model": model, "kv_cache_dtype": "auto", "skip_layers": [], "scales": None}
    if arm.kind == "format":
        return format_arm(arm, model, offered)
    if (why := lacks(arm.dtype)) is not None:
        return why
    if arm.kind == "stats":
        return ("a what-if from a statistics file, not a checkpoint: export it (`kvcalib export --stats`) and pass "
                "it with --scales to measure it in the engine")
    if arm.kind == "checkpoint" and arm.name.endswith("@tensor"):
        head = support.outcome("vllm", support.Calibrated(arm.dtype.name, "head"))
        return (f"the engine serves the checkpoint `{arm.source}` itself: see that arm's engine numbers (per-head "
                f"scales: {'; '.join(head.lines())})")
    if arm.kind not in ("default", "checkpoint"):
        return f"arm kind {arm.kind!r} has no engine form"
    try:
        scales = serve.scales_of(arm)
    except (OSError, ValueError, KeyError) as e:
        return f"the checkpoint's scales cannot be read: {e}"
    return {"name": arm.name, "model": arm.source if arm.kind == "checkpoint" else model,
            "kv_cache_dtype": arm.dtype.engine, "skip_layers": served_skip(arm), "scales": scales}


def starts(arms: Sequence[Any], model: str) -> int:
    """Engine starts that `arms` take besides the reference's: one per serve configuration (calib/engine/serve.py)."""
    specs = [s for s in (request_arm(a, model) for a in arms) if not isinstance(s, str)]
    return len(serve.group(specs))


def served_skip(arm: Any) -> list[int | str]:
    """The engine's skip list of an arm: the skipped layer indices, with a skipped layer kind by its name instead
    of its layers (vLLM's "sliding_window", which covers exactly the layers the arm skips); `support.skip_order`."""
    kind = getattr(arm, "skip_kind", None)
    return support.skip_order([*([kind] if kind else arm.skip), *arm.serve_skip])


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
    prompts: Sequence[Any] = ()                 # calib.evaluation.passkey.Prompt: ids
    passkey_tokens: int = 0                     # tokens generated per passkey prompt
    tokenizer: Any = None                       # its end-of-sequence id stops generation
    context: int | None = None                  # the model's max positions
    progress: Progress = SILENT
    reference: dict[str, Any] | None = field(default=None, init=False)
    reference_reason: str | None = field(default=None, init=False)
    starts: int = field(default=0, init=False)  # engine starts so far (one per serve configuration measured)

    def _request(self, arm_specs: Sequence[dict[str, Any]]) -> dict[str, Any]:
        cont = self.spec.continuation_tokens
        need = max([len(s.ids) + cont for s in self.samples] + [len(p.ids) + self.passkey_tokens for p in self.prompts])
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return {"protocol": protocol.PROTOCOL, "arms": list(arm_specs), "samples": [list(s.ids) for s in self.samples],
                "continuation_tokens": cont, "passkey": [list(p.ids) for p in self.prompts],
                "passkey_tokens": self.passkey_tokens, "stop_token_ids": [] if eos is None else [int(eos)],
                "top_k": self.spec.top_k, "kv_gib": self.spec.kv_gib,
                "max_model_len": min(need, self.context) if self.context else need, "dtype": self.model_dtype,
                "seed": 0, "chunk": self.spec.chunk}

    def _call(self, arm_specs: Sequence[dict[str, Any]], labels: Sequence[str]) -> list[dict[str, Any]]:
        """One engine start for `arm_specs` (one serve configuration): one response per arm, in order."""
        cont, n = self.spec.continuation_tokens, len(arm_specs)
        per_arm = sum(len(s.ids) + cont for s in self.samples) + sum(len(p.ids) + self.passkey_tokens
                                                                     for p in self.prompts)
        name = f"{self.spec.name} `{arm_specs[0]['name']}`" + (f" + {n - 1} arm(s) on one engine start" if n > 1 else "")
        with self.progress.stage(name, n * per_arm, samples=n * len(self.samples),
                                 prompts=n * len(self.prompts)) as stage:
            stage.labels = {"arm": labels[0]}
            done = [0]                       # tokens of the whole start reported so far

            def on_progress(p: dict[str, int]) -> None:
                j = min(p.get("arm", 0), n - 1)
                at = j * per_arm + p.get("tokens", 0)
                stage.advance(at - done[0], labels={"arm": labels[j]}, samples=j * len(self.samples) + p.get("samples", 0),
                              prompts=j * len(self.prompts) + p.get("passkey", 0))
                done[0] = at
            self.starts += 1
            resp = driver.run(self.spec, self._request(arm_specs), on_progress, self.version)["arms"]
            if failed := [(labels[j], r["reason"]) for j, r in enumerate(resp) if r["status"] != protocol.OK]:
                said = [f"not run: {why}" if n == 1 else f"{lab} not run: {why}" for lab, why in failed]
                stage.labels = {"arm": labels[-1], "status": "; ".join(said[:2])
                                + (f"; {len(said) - 2} more not run" if len(said) > 2 else "")}
            return resp

    def _entry(self, resp: dict[str, Any], arm_spec: dict[str, Any]) -> EngineNumbers:
        base = EngineNumbers(self.spec.name, resp.get("version") or self.version)
        if resp["status"] != protocol.OK:
            return replace(base, reason=resp["reason"])
        if bad := protocol.scales_mismatch(arm_spec.get("scales"), resp.get("scales")):
            return replace(base, reason=f"scales did not take ({bad})")
        if self.reference is None:
            raise RuntimeError("engine arms are measured after the reference")
        arm = None if resp is self.reference else resp
        try:
            nums = metrics.table(self.reference, arm, [s.ids for s in self.samples], self.buckets,
                                 [s.bucket for s in self.samples])
        except (ValueError, IndexError, KeyError) as e:
            return replace(base, reason=f"the engine's answer does not fit the request: {e}")
        return replace(base, status=protocol.OK, kv_cache_dtype=resp["kv_cache_dtype"], **nums,
                       kv_capacity_tokens=resp.get("kv_capacity_tokens"), kv_gib=resp["kv_gib"],
                       seconds=resp["seconds"], serve={k: arm_spec.get(k) for k in SERVE_KEYS},
                       kv_groups=resp.get("kv_groups") or None, passkey_ids=tuple(map(tuple, resp["passkey"])))

    def measure(self, reference: Any, arms: Sequence[Any]) -> dict[str, EngineNumbers]:
        """{arm name: engine entry} for the reference (on the first call) and every arm given: the reference
        on its own start first, then one start per serve configuration (`serve.group`)."""
        out: dict[str, EngineNumbers] = {}
        todo = ([] if self.reference is not None or self.reference_reason else [reference]) + list(arms)
        runnable: list[tuple[Any, dict[str, Any], str]] = []
        for j, arm in enumerate(todo):
            spec = request_arm(arm, self.model, driver.offered(self.spec))
            if isinstance(spec, str):
                out[arm.name] = EngineNumbers(self.spec.name, self.version, reason=spec)
            else:
                runnable.append((arm, spec, f"arm {j + 1}/{len(todo)}"))
        if runnable and runnable[0][0] is reference:
            arm, spec, label = runnable.pop(0)
            resp = self._call([spec], [label])[0]
            if resp["status"] == protocol.OK:
                self.reference = resp
            else:
                self.reference_reason = resp["reason"]
            out[arm.name] = self._entry(resp, spec)
        if self.reference is None:
            for arm, _, _ in runnable:
                out[arm.name] = EngineNumbers(self.spec.name, self.version,
                                              reason=f"the engine's {reference.name.upper()}-KV reference run did "
                                                     f"not run ({self.reference_reason})")
            return out
        for idx in serve.group([spec for _, spec, _ in runnable]):
            part = [runnable[i] for i in idx]
            answers = self._call([x[1] for x in part], [x[2] for x in part])
            for (arm, spec, _), resp in zip(part, answers):
                out[arm.name] = self._entry(resp, spec)
        return {a.name: out[a.name] for a in todo if a.name in out}

