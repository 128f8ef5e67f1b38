"""One base for every error kvcalib raises on purpose, the helper that cuts a message to one line, and the exit
codes the command line ends with.

Why a module of its own: each stage has its own error class (RecipeError, DataError, ModelError, ...) so a
caller can tell them apart, and each keeps the builtin base it always had (ValueError, RuntimeError) so
existing `except` clauses still hold. The command line catches `KvcalibError` once (calib/cli.py) and prints
the message as one line; a new error class deriving from it needs no list kept anywhere else. Imports nothing.

Exit codes, so a pipeline can gate on a command without reading its output:

- 0 (`OK`): the command did its work and, for the commands that decide (eval, validate, tune, plan), the decision
  is to ship the FP8 (or other quantized) KV cache: go;
- 1 (`ERROR`): a kvcalib error (bad input, a model or file it refuses, an engine that fails), one line `Error: ...`;
- 2 (`USAGE`): a usage error Click reports (an unknown option, a value of the wrong type);
- 3 (`NO_GO`): the decision is to keep the model's own KV dtype (BF16), or nothing could be recommended: no-go;
- 130 (`INTERRUPTED`): Ctrl-C (128 + SIGINT); SIGTERM / SIGHUP end with 128 + their number, as shells report.
"""

OK, ERROR, USAGE, NO_GO, INTERRUPTED = 0, 1, 2, 3, 130


class KvcalibError(Exception):
    """An error kvcalib raises on purpose: its message is one line naming the input and what to do."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (empty messages give the exception's type name)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__
