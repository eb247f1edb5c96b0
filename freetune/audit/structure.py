"""Rows the trainer cannot read: a conversation without an assistant turn, a turn whose role no chat template
knows ("bot", "human"), message content that is a number or null. TRL would fail on them after the model loaded,
with a chat template's TypeError that names no row; the audit names the row and the field instead, and cleaning
drops them (in the held-out rows too, since the whole data set is audited before it is split)."""

from __future__ import annotations

from freetune.audit.findings import ACCEPT_PARAMETER, BLOCKING, CLEAN_PARAMETER, Finding, _cut, _n

ROLES = {"system", "user", "assistant", "tool", "developer"}


def _turn_problem(turns, field: str) -> str | None:
    if not isinstance(turns, list):
        return f"{field} is {type(turns).__name__}, not a list of turns"
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"{field}[{k}] is {type(turn).__name__}, not a {{'role', 'content'}} turn"
        if turn.get("role") not in ROLES:
            return f"{field}[{k}].role is {turn.get('role')!r}, not one of {sorted(ROLES)}"
        content = turn.get("content")
        if not isinstance(content, str):
            return f"{field}[{k}].content is {_what(content)}, not text"
    return None


def _what(value) -> str:
    return "null" if value is None else f"{type(value).__name__} {_cut(repr(value), 30)}"


def row_problem(row: dict, shape: str) -> str | None:
    """What makes a normalised row unreadable for the trainer, naming the field; None when it is readable."""
    if shape == "messages":
        turns = row.get("messages")
        problem = _turn_problem(turns, "messages")
        if problem is None and not any(t["role"] == "assistant" for t in turns):
            return f"no assistant turn (roles: {', '.join(t['role'] for t in turns) or 'none'})"
        return problem
    if shape == "prompt_completion":
        for field in ("prompt", "completion"):
            value = row.get(field)
            if value is not None and not isinstance(value, str):  # null completions are reported as empty
                return f"{field} is {_what(value)}, not text"
        return None
    problem = _turn_problem(row.get("prompt") or [], "prompt")
    completion = row.get("completion")
    if problem is None and completion is not None and not isinstance(completion, str):
        problem = _turn_problem(completion, "completion")
    return problem


def malformed_finding(rows: list[dict], shape: str, source: str | None) -> Finding | None:
    problems = {i: p for i, row in enumerate(rows) if (p := row_problem(row, shape)) is not None}
    if not problems:
        return None
    where = source or "the data set"
    first = next(iter(problems))
    examples = [f"row {i}: {p}" for i, p in list(problems.items())[:5]]
    return Finding("malformed", "malformed", BLOCKING, "row the trainer cannot read",
                   f"{_n(len(problems), 'row')} of {where} the chat template cannot render, e.g. row {first} "
                   f"(counting from 0): {problems[first]}. Fix them in the file, or let `{CLEAN_PARAMETER}=True` drop "
                   f"them (with `{ACCEPT_PARAMETER}=True` they are dropped all the same: no trainer can read them).",
                   sorted(problems), len(problems), {"examples": examples})


def stand_in(row: dict, shape: str) -> dict:
    """A readable row of the same shape, tokenised in place of a malformed one (its findings are the malformed
    finding's, not the token rules')."""
    if shape == "messages":
        return {"messages": [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]}
    if shape == "prompt_completion":
        return {"prompt": "", "completion": ""}
    return {"prompt": [{"role": "user", "content": ""}], "completion": [{"role": "assistant", "content": ""}]}
