"""Reading normalised rows: the data's shape, each row's prompt and completion as text (a malformed row reads as
empty, never as an exception), and the words a reader recognises a row by."""

from __future__ import annotations

from freetune.data import completion_text, prompt_messages, prompt_text
from freetune.errors import FreetuneError


def _shape(dataset) -> str:
    names = set(dataset.column_names)
    if "messages" in names:
        return "messages"
    if {"prompt", "completion"} <= names:
        first = dataset[0]["prompt"] if len(dataset) else ""
        return "prompt_completion_chat" if isinstance(first, list) else "prompt_completion"
    raise FreetuneError(
        f"The audit reads normalised data (a `messages` column, or `prompt` + `completion`); this data set has "
        f"{sorted(names)}. Run freetune.data.normalize(dataset, columns=...) first.")


def _safe_completion(row: dict) -> str:
    try:
        return completion_text(row) or ""
    except (TypeError, KeyError, AttributeError):  # a null completion or a malformed turn: nothing to learn
        return ""


def _safe_prompt(row: dict) -> str:
    try:
        return prompt_text(row) or ""
    except (ValueError, TypeError, KeyError, AttributeError):  # e.g. a conversation without an assistant turn
        turns = row.get("messages") or []
        return "\n".join(str(m.get("content", "")) for m in turns if isinstance(m, dict))


def _request(row: dict) -> str:
    """What a reader recognises a row by: the last turn before the answer (not a long shared system prompt)."""
    try:
        turns = prompt_messages(row)
        return str(turns[-1]["content"]) if turns else ""
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return _safe_prompt(row)


def _prompt_key(text: str) -> str:
    # Whitespace-insensitive, so a prompt copied with an extra space or newline still counts as the same prompt.
    return " ".join(text.split())
