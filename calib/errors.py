"""One base for every error kvcalib raises on purpose, and the helper that cuts a message to one line.

Why a module of its own: each stage has its own error class (RecipeError, DataError, ModelError, ...) so a
caller can tell them apart, and each keeps the builtin base it always had (ValueError, RuntimeError) so
existing `except` clauses still hold. The command line catches `KvcalibError` once and prints the message as
one line; a new error class deriving from it needs no list kept anywhere else. Imports nothing.
"""


class KvcalibError(Exception):
    """An error kvcalib raises on purpose: its message is one line naming the input and what to do."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (empty messages give the exception's type name)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__
