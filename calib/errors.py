"""Tiny text helpers for one-line error messages."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (empty messages give the exception's type name)."""
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__
