"""Run options checked before anything expensive happens: one line naming the option and the fix.

Why a module of its own: a bad `--device` or batch budget used to surface minutes later, after the model had
loaded (or as a torch traceback). Recipe fields are validated by `recipe`; these are the options that are not
part of a recipe (where the model runs, how batches are cut, evaluation settings). The CLI calls them before
it builds or loads any model, and the library entry points (`pipeline.calibrate`, `evaluation.run.run_eval`) call
them again as their first step, so library users get the same errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from calib.errors import KvcalibError
from calib.safety import readers
from calib.safety.files import expand_user
from calib.safety.readers import raising


class OptionError(KvcalibError, ValueError):
    """An option's value cannot work; the message names the option and what to give instead."""


def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two inputs are one file: the same file system object (device and inode: one path resolved
    through links, or two hard links), or, when either does not exist (a dataset id), the same text."""
    try:
        pa, pb = expand_user(a), expand_user(b)
        sa, sb = os.stat(pa), os.stat(pb)
    except (OSError, ValueError):
        return str(a) == str(b)
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


# Upper bounds: far beyond any real run, and low enough that arithmetic on them (seconds = 60 x minutes, a
# deadline, a pool in bytes) stays finite and fits an integer. A value past one is a typo or a hostile input.
MAX_MINUTES = 60 * 24 * 366          # a year
MAX_SECONDS = 60 * MAX_MINUTES
MAX_TOKENS = 1 << 24                 # a context length (as routes.yaml's buckets)
MAX_COUNT = 1 << 31                  # samples, prompts, batch sizes
MAX_GIB = 1 << 20                    # a KV pool


def whole(option: str, value: Any, minimum: int = 1, maximum: int | None = None) -> None:
    """`value` (None: not given) must be an int >= minimum (and <= maximum when one is given)."""
    with raising(OptionError):
        readers.whole(value, option, minimum, maximum, null=True)


def number(option: str, value: Any, minimum: float = 0.0, maximum: float | None = None, *,
           above: bool = False) -> None:
    """`value` (None: not given) must be a finite number >= minimum (> minimum with `above`; <= maximum when one is
    given). inf and NaN never pass: a deadline of inf never fires, and 60 x 1e308 is inf."""
    with raising(OptionError):
        readers.number(value, option, minimum, maximum, above=above, null=True)


def budget(value: Any, option: str = "--budget-minutes") -> None:
    """A time budget in minutes (None: none): positive, finite, at most a year."""
    number(option, value, 0, MAX_MINUTES, above=True)


def device(value: str | None, option: str = "--device") -> None:
    """A device torch can run the model on here. Checked without allocating anything on it."""
    if value is None:
        return
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise OptionError(f"{option} {value!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"{option} {value}: torch sees no CUDA GPU on this machine (torch {torch.__version__}); "
                              "use --device cpu, or install a CUDA build of torch")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise OptionError(f"{option} {value}: this machine has {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise OptionError(f"{option} {value}: MPS is not available on this machine; use --device cpu")
    elif dev.type != "cpu":
        raise OptionError(f"{option} {value}: kvcalib runs models on cpu, cuda or mps, not {dev.type}")


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")   # accelerate's; else one device


def placement(device_map: str | None = None, max_memory: dict[str, str] | None = None) -> None:
    """`--device-map` is one of accelerate's strategies or a device that exists here (`cuda:0` on a machine
    without a GPU fails now, not inside the model load); `--max-memory` names only devices that exist."""
    if device_map is not None and device_map not in DEVICE_MAP_STRATEGIES:
        device(device_map, "--device-map")
    for key in max_memory or {}:
        name = str(key).strip()
        if name not in ("cpu", "disk"):
            device(f"cuda:{name}" if name.isdigit() else name, "--max-memory")


def calibrate(*, device_name: str | None = None, max_batch_tokens: int | None = None, seq_len: int | None = None,
              checkpoint_every: int | None = None, device_map: str | None = None,
              max_memory: dict[str, str] | None = None) -> None:
    """The calibration run's own options (the recipe checks its fields itself)."""
    device(device_name)
    placement(device_map, max_memory)
    whole("--max-batch-tokens", max_batch_tokens)
    if max_batch_tokens is not None and seq_len is not None and max_batch_tokens < seq_len:
        raise OptionError(f"--max-batch-tokens {max_batch_tokens} is below --seq-len {seq_len}: a full-length "
                          f"sequence would not fit in a batch; give at least {seq_len}")
    whole("--checkpoint-every", checkpoint_every)


def evaluation(cfg: Any) -> None:
    """Every numeric option of `kvcalib eval` (an `evaluation.config.EvalConfig`), and of the commands that run one
    (plan per route, validate, tune's held-out scoring): finite and within range, before any model loads."""
    device(cfg.device)
    placement(getattr(cfg, "device_map", None), getattr(cfg, "max_memory", None))
    for option, value, minimum in (("--samples", cfg.samples, 1), ("--batch-size", cfg.batch_size, 1),
                                   ("--min-tokens", cfg.min_tokens, 1), ("--passkey-trials", cfg.passkey_trials, 0),
                                   ("--failures", cfg.failures, 0), ("--passkey-drop", cfg.thresholds.passkey_drop, 0),
                                   ("--max-skip", cfg.thresholds.max_skip, 0)):
        whole(option, value, minimum, MAX_COUNT)
    if cfg.engine is not None:       # the engine's settings: a NaN deadline would never fire
        number("--engine-timeout", cfg.engine.timeout, 1, MAX_SECONDS)
        whole("--engine-top-k", cfg.engine.top_k, 1, MAX_COUNT)
        whole("--engine-kv-gib", cfg.engine.kv_gib, 1, MAX_GIB)
    number("--max-kl", cfg.thresholds.max_kl)
    number("--max-ppl-increase", cfg.thresholds.max_ppl_increase)
    number("--dominance", cfg.thresholds.dominance, 1)      # below the median layer's error nothing dominates
    if not cfg.buckets:
        raise OptionError("--buckets: give at least one context length, e.g. 512,2048")
    for b in cfg.buckets:
        whole("--buckets", b, 2, MAX_TOKENS)
    if cfg.min_tokens > max(cfg.buckets):
        raise OptionError(f"--min-tokens {cfg.min_tokens} exceeds the largest bucket ({max(cfg.buckets)} tokens): "
                          "every sample would be skipped; lower --min-tokens or add a larger bucket")
    budget(getattr(cfg, "budget_minutes", None))
    up_to = getattr(cfg, "emulate_up_to", None)
    whole("--emulate-up-to", up_to, 2, MAX_TOKENS)
    if up_to is not None and up_to < min(cfg.buckets):
        raise OptionError(f"--emulate-up-to {up_to} is below every bucket ({', '.join(map(str, sorted(cfg.buckets)))}):"
                          f" nothing would be emulated; give at least {min(cfg.buckets)}, or leave it out")
