"""The time plan of one evaluation: a short probe, minutes per phase, and what `--budget-minutes` drops.

Why: at 32K-128K an evaluation runs for hours when nothing bounds it, and nothing said so before it began (issue 30:
after 17 minutes no engine arm had started). A probe times one forward of the reference and of one emulated arm on one
sample of the smallest bucket; each phase is then extrapolated per sample length with the attention's quadratic term
(work per sample L * (2 * parameters + attention * L), the model's own FLOP count, so a probe at 512 tokens says what
32K costs). The engine is not started for a probe (a start costs a minute): its start and scoring rate are stated
defaults, printed as such. Arms that differ only in their KV scales share one engine start (calib/engine/serve.py), so
starts are counted per serve configuration: the reference's, one per group of arms, one per skip trial.

A budget drops optional parts in a fixed order, each fully before the next, until the plan fits: passkey depths (5 -> 3
-> 1), skip trials, emulated long buckets (longest first; with an engine they are still measured there), then the
engine's passkey prompts (the retrieval confirmation). What it dropped is printed and recorded; a plan that still does
not fit runs its minimum and says so.

The engine's figures were measured on one H200 with GPU vLLM 0.24 (FlashAttention-3, enforce_eager; bench/RESULTS.md,
"long context"): a start (runner process, LLM(), the answer read back) 24-27 s once the machine has run vLLM, the first
one on a fresh machine about 40 s more; prompt-logprob scoring of held-out samples is bound by per-token overhead on a
small model (12-19K tokens/s on a 135M model at 2K-8K) and by compute on a large one (about 1.5x kvcalib's own bf16
reference pass: an 8B shape scored 32K + 128K tokens in 18-20 s, the reference pass took 13.5 s); passkey prompts,
submitted together and generating 8 tokens without log-probs, ran at 90-150K tokens/s there. On a small model a decode
step costs its launches, not its FLOPs (decoded one at a time, a prompt of 2K-8K took ~0.33 s for the reference and ~0.6
s for an emulated arm on the H200, over a third of an 8-arm evaluation at 8K), so the emulated passkey phase decodes a
bucket's prompts in batches of the run's batch size and the probe times a step (`run.decode_step`), charged once per
batch. CPU figures: vLLM's CPU build on a 2-core machine (a start ~20 s, ~1.5K tokens/s with top-20 prompt log-probs on
the default model), rougher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from calib.progress import duration

MAX_NEW_TOKENS = 8                             # calib.evaluation.passkey.MAX_NEW_TOKENS (no torch import here)
DEPTH_STEPS = ((0.0, 0.25, 0.5, 0.75, 1.0), (0.0, 0.5, 1.0), (0.5,))
SKIP_PHASE = "skip trials"                     # the phase that runs only when the numbers call for it
SHORT_WINDOW = 8192                            # with an engine, buckets above this are measured there only
# Stated, not probed (a start costs too much to probe): measured figures, see the module docstring.
ENGINE_START_S = {"cuda": 26.0, "cpu": 20.0}
ENGINE_FIRST_START_S = {"cuda": 40.0, "cpu": 0.0}     # added once: CUDA context, kernel caches, imports
ENGINE_TOKENS_PER_S = {"cuda": 12_000.0, "cpu": 1_500.0}           # held-out samples, top-20 prompt log-probs
ENGINE_PROMPT_TOKENS_PER_S = {"cuda": 100_000.0, "cpu": 1_500.0}   # passkey prompts, batched, no log-probs
# compute-bound scoring: x the reference pass on the same tokens (GPU); on a CPU vLLM's bf16 kernels outrun
# kvcalib's float32 reference pass, so the token rate alone is used there (0)
ENGINE_OVER_REFERENCE = {"cuda": 1.5, "cpu": 0.0}


@dataclass(frozen=True)
class Cost:
    """Work of one forward over a sample of L tokens: L * (linear + quadratic * L) (FLOP-proportional)."""
    linear: float               # ~2 x parameters
    quadratic: float            # causal attention: 2 x layers x heads x head_dim per token per earlier key
    head: float = 0.0           # the LM head's share of `linear` (2 x vocab x hidden): a measuring pass reads
                                # logits at every position, a passkey prefill at its last one only

    @staticmethod
    def of(config: Any, parameters: int) -> "Cost":
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = cfg.num_attention_heads
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        head = 2.0 * cfg.vocab_size * cfg.hidden_size if getattr(cfg, "vocab_size", None) else 0.0
        return Cost(2.0 * parameters, 2.0 * cfg.num_hidden_layers * heads * dim, min(head, 2.0 * parameters))

    def work(self, length: int) -> float:
        return length * (self.linear + self.quadratic * length)

    def prefill(self, length: int) -> float:
        """A generation's prefill: the forward without the LM head on all but the last position (on a 135M model
        with a 49K vocabulary the head is a fifth of the work, and the log-softmax / KL of a measuring pass more)."""
        return self.work(length) - max(0, length - 1) * self.head

    def decode(self, length: int, steps: int = MAX_NEW_TOKENS) -> float:
        """`steps` generated tokens after a prompt of `length` tokens (each reads every key)."""
        return steps * (self.linear + 2 * self.quadratic * length)

    def batch(self, lengths: Sequence[int], rate: float, step: float) -> float:
        """Seconds for passkey prompts decoded together (calib.evaluation.passkey.greedy_batch): their prefills
        (`prefill`) at `rate`, then MAX_NEW_TOKENS - 1 decode steps for the whole batch, each the measured latency
        `step` (a small model's step is launch-bound, not FLOP-bound) or the batch's work at `rate`, whichever is
        longer (a long prompt's step reads every key)."""
        prefill = sum(self.prefill(n) for n in lengths) * rate
        return prefill + (MAX_NEW_TOKENS - 1) * max(step, sum(self.decode(n, 1) for n in lengths) * rate)


@dataclass(frozen=True)
class Rates:
    """Seconds per unit of `Cost` work (reference, one emulated arm), and the engine's stated figures."""
    ref: float
    arm: float
    engine_start: float
    engine_tokens_per_s: float
    probed_at: int              # tokens of the probe sample
    engine_first_start: float = 0.0
    engine_over_reference: float = 1.5
    step_ref: float = 0.0       # seconds per greedy decode step of the reference at the probe's length
    step_arm: float = 0.0       # the same under one emulated arm (its hook quantises the cached K/V every step)
    engine_prompt_tokens_per_s: float = 0.0     # the engine's passkey prompts (0: engine_tokens_per_s)
    probed_batch: int = 1       # samples in the probe's batch


@dataclass(frozen=True)
class Parts:
    """What the run does: emulated buckets, passkey depths, skip trials, the engine's passkey prompts."""
    emulate_up_to: int | None = None        # None: every bucket
    depths: tuple[float, ...] = DEPTH_STEPS[0]
    skip_trials: int = 0
    engine_passkey: bool = True


@dataclass(frozen=True)
class Work:
    """The run's inputs, as lengths: held-out samples (length, bucket), passkey prompts (length, bucket,
    depth), arms besides the reference, whether an engine runs, its starts for those arms (None: one per arm);
    `passkey_batch`: emulated passkey prompts of one bucket decoded together."""
    samples: tuple[tuple[int, int], ...]
    prompts: tuple[tuple[int, int, float], ...]
    arms: int
    engine: bool
    engine_starts: int | None = None
    passkey_batch: int = 1

    @property
    def starts(self) -> int:
        """Engine starts of the reference and the arms (skip trials start their own)."""
        return 1 + (self.arms if self.engine_starts is None else self.engine_starts)


@dataclass(frozen=True)
class Plan:
    parts: Parts
    phases: tuple[tuple[str, float], ...]   # (phase, seconds)
    dropped: tuple[str, ...] = ()
    budget_s: float | None = None

    @property
    def total(self) -> float:
        """Every phase, each skip trial included (what a budget is held to)."""
        return sum(s for _, s in self.phases)

    def with_trials(self, trials: int) -> float:
        """The total when `trials` of the planned skip trials run: they are conditional (only when no arm passes
        and a few layers dominate the best one's error), so the plan states both ends and the run its own."""
        skip = sum(s for name, s in self.phases if name.startswith(SKIP_PHASE))
        return self.total - skip + (skip * trials / self.parts.skip_trials if skip else 0.0)

    def lines(self, rates: Rates, title: str = "eval plan") -> list[str]:
        batch = f" x {rates.probed_batch}" if rates.probed_batch > 1 else ""
        out = [f"{title} (probe: one forward at {rates.probed_at} tokens{batch}; engine "
               f"{rates.engine_start:.0f} s per start (+{rates.engine_first_start:.0f} s the first), scoring at "
               f"{rates.engine_tokens_per_s:,.0f} tok/s or {rates.engine_over_reference:g}x the reference pass, "
               "measured defaults):"]
        out += [f"  {name}: {duration(s)}" for name, s in self.phases if s > 0]
        total = f"  total: {duration(self.total)}"
        if self.with_trials(0) < self.total:
            total += (f" with every skip trial, {duration(self.with_trials(0))} without (they run only when no arm "
                      "passes and a few layers dominate the best one's error)")
        out.append(total + (f" (budget {duration(self.budget_s)})" if self.budget_s is not None else ""))
        if self.dropped:
            out.append("  dropped to fit the budget: " + "; ".join(self.dropped))
        if self.budget_s and self.total > self.budget_s:
            out.append("  the minimum plan still exceeds the budget: running it anyway")
        return out


def estimate(w: Work, parts: Parts, cost: Cost, rates: Rates) -> tuple[tuple[str, float], ...]:
    """Seconds per phase of `w` done as `parts` say."""
    emu = [(n, b) for n, b in w.samples if parts.emulate_up_to is None or b <= parts.emulate_up_to]
    pk = [(n, b) for n, b, d in w.prompts if d in parts.depths]
    pk_emu = [(n, b) for n, b in pk if parts.emulate_up_to is None or b <= parts.emulate_up_to]
    batches = prompt_batches(pk_emu, w.passkey_batch)
    pk_ref = sum(cost.batch(lengths, rates.ref, rates.step_ref) for lengths in batches)
    pk_arm = sum(cost.batch(lengths, rates.arm, rates.step_arm) for lengths in batches)
    metrics = measuring([n for n, _ in emu], w.arms, cost, rates)
    passkey = pk_ref + w.arms * pk_arm
    lengths = [n for n, _ in w.samples]
    pk_lengths = [n for n, _ in pk] if parts.engine_passkey else []
    engine_arm = rates.engine_start + scoring(lengths, pk_lengths, cost, rates) if w.engine else 0.0
    engine = engine_seconds(lengths, pk_lengths, w.arms, w.starts, cost, rates) if w.engine else 0.0
    # a trial re-runs the reference forward (its KL needs the logits), not the reference's passkey
    skips = parts.skip_trials * (measuring([n for n, _ in emu], 1, cost, rates) + pk_arm + engine_arm)
    return ((f"emulation: reference + {w.arms} arm(s) on {len(emu)} samples", metrics),
            (f"emulation passkey: {len(pk_emu)} prompts x {w.arms + 1}", passkey),
            (f"engine: {w.arms + 1} arms on {w.starts} start(s)" if w.engine else "engine", engine),
            (f"{SKIP_PHASE}: up to {parts.skip_trials}", skips))


def measuring(lengths: Sequence[int], arms: int, cost: Cost, rates: Rates) -> float:
    """Seconds of one measuring pass: the reference and `arms` emulated arms over samples of `lengths` tokens."""
    return sum(cost.work(n) for n in lengths) * (rates.ref + arms * rates.arm)


def scoring(lengths: Sequence[int], prompts: Sequence[int], cost: Cost, rates: Rates) -> float:
    """Seconds the engine scores one arm: held-out samples of `lengths` tokens and passkey prompts of `prompts`."""
    out = max(sum(lengths) / rates.engine_tokens_per_s,
              rates.engine_over_reference * sum(cost.work(n) for n in lengths) * rates.ref)
    pk_rate = rates.engine_prompt_tokens_per_s or rates.engine_tokens_per_s
    return out + max(sum(n + MAX_NEW_TOKENS for n in prompts) / pk_rate,
                     rates.engine_over_reference * sum(cost.work(n) + cost.decode(n) for n in prompts) * rates.ref)


def engine_seconds(lengths: Sequence[int], prompts: Sequence[int], arms: int, starts: int, cost: Cost,
                   rates: Rates) -> float:
    """Seconds of the engine phase: its first start, `starts` starts (the reference's included) and the
    reference and `arms` arms each scored."""
    return (rates.engine_first_start + starts * rates.engine_start
            + (arms + 1) * scoring(lengths, prompts, cost, rates))


def reduce(parts: Any, steps: Sequence[tuple[str, Any]], total: Any, budget_s: float) -> tuple[Any, list[str]]:
    """`parts` with `steps` (what it drops, a function of the parts) applied in order until `total(parts)` fits
    `budget_s`, and what was dropped, in words: eval's order (`fit`) and tune's (calib/tune/search.py) alike."""
    dropped: list[str] = []
    for what, change in steps:
        if total(parts) <= budget_s:
            break
        parts = change(parts)
        dropped.append(what)
    return parts, dropped


PASSKEY_BATCH_TOKENS = 32768   # a batch of passkey prompts holds at most this many tokens (one prompt at least)


def batch_indices(prompts: Sequence[tuple[int, int]], size: int) -> list[list[int]]:
    """How the emulated passkey phase batches (length, bucket) prompts (calib.evaluation.passkey.run): runs of
    consecutive prompts of one bucket, at most `size` prompts and PASSKEY_BATCH_TOKENS tokens each. Why the token
    cap: prompts of unequal length need a padding mask, which a [batch, 1, length, length] tensor costs; capped,
    it stays under 32K x 16K (512 MB of bools), and a prompt past 16K runs alone, unpadded, with no mask at all."""
    out: list[list[int]] = []
    tokens = 0
    for i, (n, b) in enumerate(prompts):
        if out and prompts[out[-1][0]][1] == b and len(out[-1]) < max(1, size) and tokens + n <= PASSKEY_BATCH_TOKENS:
            out[-1].append(i)
            tokens += n
        else:
            out.append([i])
            tokens = n
    return out


def prompt_batches(prompts: Sequence[tuple[int, int]], size: int) -> list[list[int]]:
    return [[prompts[i][0] for i in group] for group in batch_indices(prompts, size)]


def fit(w: Work, parts: Parts, cost: Cost, rates: Rates, budget_s: float | None) -> Plan:
    """The plan of `parts`, reduced in the module's order until it fits `budget_s` (None: as asked)."""
    if budget_s is None:
        return Plan(parts, estimate(w, parts, cost, rates), (), budget_s)
    buckets = sorted({b for _, b in w.samples} | {b for _, b, _ in w.prompts})
    steps, have = [], len(parts.depths)
    for depths in DEPTH_STEPS if w.prompts else ():
        if len(depths) < have:
            steps.append((f"passkey depths {have} -> {len(depths)}", {"depths": depths}))
            have = len(depths)
    if parts.skip_trials:
        steps.append((f"skip trials (up to {parts.skip_trials})", {"skip_trials": 0}))
    limit = parts.emulate_up_to
    for b in reversed(buckets[:-1]):
        if limit is None or b < limit:
            what = "measured in the engine only" if w.engine else "not measured"
            steps.append((f"emulated bucket {buckets[buckets.index(b) + 1]} ({what})", {"emulate_up_to": b}))
    if w.engine and parts.engine_passkey and w.prompts:
        steps.append(("the engine's passkey prompts", {"engine_passkey": False}))
    parts, dropped = reduce(parts, [(what, lambda p, c=change: replace(p, **c)) for what, change in steps],
                            lambda p: sum(s for _, s in estimate(w, p, cost, rates)), budget_s)
    return Plan(parts, estimate(w, parts, cost, rates), tuple(dropped), budget_s)


def default_rates(device_type: str, ref: float, arm: float, probed_at: int, step_ref: float = 0.0,
                  step_arm: float = 0.0) -> Rates:
    key = "cuda" if device_type == "cuda" else "cpu"
    return Rates(ref, arm, ENGINE_START_S[key], ENGINE_TOKENS_PER_S[key], probed_at, ENGINE_FIRST_START_S[key],
                 ENGINE_OVER_REFERENCE[key], step_ref, step_arm, ENGINE_PROMPT_TOKENS_PER_S[key])


def emulation_limit(requested: int | None, buckets: Sequence[int], engine: bool) -> int | None:
    """The largest bucket the emulation covers (None: all): `requested` (--emulate-up-to), else
    `SHORT_WINDOW` when an engine measures the long buckets, else all; never below the smallest bucket."""
    limit = requested if requested is not None else SHORT_WINDOW if engine else None
    return None if limit is None or limit >= max(buckets) else max([b for b in buckets if b <= limit] or [min(buckets)])
