"""Chat records as users actually have them, turned into what a chat template expects: string contents.

Why: exported chat logs are not the tidy `[{role, content: str}]` the templates were written for: OpenAI-style
`content` is a list of parts (text, images), tool-only assistant turns have `content: null`, columnar formats
fill absent fields with null, some exports hold empty conversations. A template that meets a list prints its
Python repr into the calibration text, and the scales are computed on that. Here every message becomes a string
(its text parts joined with newlines, media parts dropped when text is present) or one line naming it.
"""

from __future__ import annotations

from typing import Any

from calib.errors import KvcalibError

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
NON_TEXT_PARTS = frozenset({"image_url", "image", "input_image", "input_audio", "audio", "video", "video_url",
                            "file", "input_file"})


class ChatError(KvcalibError, ValueError):
    """A conversation cannot be rendered as text; the message names the message (and part) and the fix."""


def normalize(messages: Any) -> list[dict[str, Any]]:
    """Messages with string contents (copies; the record is not modified)."""
    if not isinstance(messages, list):
        raise ChatError(f"messages must be a list of {{role, content}} objects, got {type(messages).__name__}")
    if not messages:
        raise ChatError("empty conversation (messages is []); remove the record")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"message {i}"
    if not isinstance(m, dict):
        raise ChatError(f"{where} is a {type(m).__name__}, not a {{role, content}} object")
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ChatError(f"{where} has no role (give role: user, assistant, system or tool)")
    where = f"{where} ({role})" if role.isprintable() else f"{where} ({role!r})"   # errors stay one line
    out = {k: v for k, v in m.items() if v is not None}   # columnar readers add absent keys as null
    content = m.get("content")
    if content is None:
        if m.get("tool_calls"):
            return out  # an assistant turn that only calls tools: the template renders the calls
        raise ChatError(f"{where} has no content; give it text or remove the message")
    if isinstance(content, str):
        return out
    if isinstance(content, list):
        out["content"] = _join_parts(content, where)
        return out
    raise ChatError(f"{where} content is a {type(content).__name__}; give a string or a list of "
                    "{type: text, text: ...} parts")


def _join_parts(parts: list[Any], where: str) -> str:
    texts: list[str] = []
    skipped: list[str] = []
    for j, part in enumerate(parts):
        here = f"{where} part {j}"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ChatError(f"{here} is a {type(part).__name__}; parts are objects like {{type: text, text: ...}}")
        kind = part.get("type", "text" if "text" in part else None)
        if kind in TEXT_PARTS:
            text = part.get(TEXT_PARTS[kind])
            if not isinstance(text, str):
                got = "null" if text is None else f"a {type(text).__name__}"
                raise ChatError(f"{here} ({kind}) has {got} {TEXT_PARTS[kind]}; give a string or drop the part")
            texts.append(text)
        elif kind in NON_TEXT_PARTS:
            skipped.append(kind)
        else:
            raise ChatError(f"{here} has type {kind!r}, which is neither text nor a known media part "
                            f"({', '.join(sorted(NON_TEXT_PARTS))})")
    if not texts:
        what = f"only {', '.join(sorted(set(skipped)))} parts" if skipped else "an empty content list"
        raise ChatError(f"{where} has {what} and no text; kvcalib calibrates on text: drop the message or add text")
    return "\n".join(texts)
