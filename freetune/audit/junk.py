"""Junk that real public data sets carry, found by what it says rather than by how often it repeats: refusals and
AI boilerplate distilled from a chat model, API and pipeline error strings, answers cut off at a token limit, the
prompt copied back as the answer, and answers in another language than the rest.

Each rule is judged against the other rows: a refusal among helpful answers is junk, a data set of refusals is a
safety set; an answer that stops mid-sentence is junk where the other answers end their sentences. A kind that
covers more than JUDGEMENT_SHARE of the rows is probably what the data is meant to be, so it is a warning (shown,
kept) rather than a blocking finding (dropped by auto_clean).
"""

from __future__ import annotations

import re
from collections import Counter

from freetune.audit.findings import ACCEPT_PARAMETER, BLOCKING, CLEAN_PARAMETER, WARNING, Finding, _cut, _n

# Above this share of the rows a kind of "junk" is more likely the data's purpose (a safety set teaching refusals,
# an extraction set answering "N/A"): warn instead of dropping.
JUDGEMENT_SHARE = 0.10
HEAD_CHARS = 300          # refusals and error strings say so at the start; long answers are read no further

REFUSAL = re.compile(
    r"^\W*(?:i(?:'|’)?m (?:really |very )?sorry|i am (?:really |very )?sorry|sorry|i apologi[sz]e|unfortunately)"
    r"[^\n]{0,80}?\b(?:can(?:'|’)?t|cannot|can not|unable|not able|won(?:'|’)t|not (?:allowed|permitted))\b"
    r"|^\W*i (?:can(?:'|’)?t|cannot|won(?:'|’)t|am unable to|(?:'|’)?m unable to|am not able to|must decline)\b"
    r"|\bas an ai\b|\bas a (?:large )?language model\b|\bi(?:'|’)?m (?:just )?an ai\b"
    r"|\bi am (?:just )?an ai\b|\bi do not have (?:personal )?(?:opinions|feelings|access to real-time)",
    re.IGNORECASE)

# The error strings of APIs and pipelines, one pattern per kind: a row matching one is an error, not an answer.
ERROR_KINDS = {
    "HTTP status": re.compile(
        r"^\W*(?:http(?:error)?\W*(?:\d(?:\.\d)?\W*)?)?(?:error\W*)?[45]\d\d\b\W*(?:[a-z]+\W*){0,3}"
        r"(?:too many requests|internal server error|bad gateway|service unavailable|gateway time-?out|not found"
        r"|forbidden|unauthori[sz]ed|bad request|client error|server error|overloaded)", re.IGNORECASE),
    "error prefix": re.compile(r"^\W*(?:\[\s*(?:error|fatal)\s*\]|(?:error|fatal error|failed)\s*[:!]"
                               r"|(?:http\W*)?(?:error|status)\W*[45]\d\d\W*$)", re.IGNORECASE),
    "exception": re.compile(r"^\W*(?:Traceback \(most recent call last\)|(?:[a-z_]\w*\.)*(?:[A-Z]\w*)?(?:Error"
                            r"|Exception|Timeout|Interrupt)\b\s*(?::|$))"),
    "JSON error object": re.compile(r"^\s*\{\s*\"(?:error|errors|detail|error_message)\"\s*:", re.IGNORECASE),
    "pipeline message": re.compile(
        r"^\W*(?:request timed out|rate limit(?:ed| exceeded| reached)|the server had an error|internal server error"
        r"|service unavailable|connection (?:error|reset|refused|aborted)|timed out|context_length_exceeded"
        r"|no (?:valid )?response|empty response|<!doctype html|<html)", re.IGNORECASE),
}
ANY_ERROR = re.compile("|".join(f"(?{'i' if p.flags & re.IGNORECASE else ''}:{p.pattern})"
                                for p in ERROR_KINDS.values()))
# Whole answers that are a missing value written out: a stringified None, a JSON null, a spreadsheet's N/A.
PLACEHOLDERS = {"null", "none", "nil", "n/a", "n.a.", "na", "undefined", "nan", "{}", "[]", '""', "''", "<unk>",
                "error", "-", "--", "?"}

CLEAN_ENDING = set(".!?。！？…)]}>\"'”’`*;:|")
CUT_MIN_WORDS = 4         # an answer of fewer words is a label or a value: it has no sentence to stop in
ENDING_NORM = 0.90        # mid-sentence endings count only where at least this share of prose answers end cleanly
BALANCE_NORM = 0.90       # unbalanced brackets count only where at least this share of answers balance
MIN_JUDGED = 20           # fewer comparable rows than this: no norm to judge against
PAIRS = (("(", ")"), ("[", "]"), ("{", "}"))
STRUCTURE_ENDINGS = set(";>}]`")


def _severity(count: int, total: int) -> str:
    return BLOCKING if count <= JUDGEMENT_SHARE * total else WARNING


def _keep_note(severity: str) -> str:
    if severity == BLOCKING:
        return f" Dropped with `{CLEAN_PARAMETER}=True`; if they are real answers, set `{ACCEPT_PARAMETER}=True`."
    return " So many that they may be what the data is meant to teach: kept. Look at the examples."


def _finding(fid: str, title: str, what: str, rows: list[int], completions: list[str], total: int,
             severity: str | None = None, details: dict | None = None) -> Finding:
    severity = severity or _severity(len(rows), total)
    examples = [_cut(completions[i], 80) for i in rows[:3]]
    return Finding(fid, fid, severity, title,
                   f"{_n(len(rows), 'row')} {what}, e.g. {examples[0]!r}.{_keep_note(severity)}", rows, len(rows),
                   {"examples": examples, **(details or {})})


# Words every refusal pattern needs: a substring test on them skips the regex for almost every row.
REFUSAL_WORDS = ("sorry", "apolog", "unfortunately", "i can", "i won", "unable", "decline", "an ai", "language model",
                 "i do not have")


def is_refusal(text: str) -> bool:
    head = text[:HEAD_CHARS].lower()
    return any(map(head.__contains__, REFUSAL_WORDS)) and REFUSAL.search(head) is not None


def refusal_finding(completions: list[str]) -> Finding | None:
    rows = [i for i, c in enumerate(completions) if c and is_refusal(c)]
    if not rows:
        return None
    return _finding("refusal", "refusal or AI boilerplate",
                    "refusing or speaking as an AI (distilled from a chat model): the model learns to refuse",
                    rows, completions, len(completions))


def error_kind(text: str) -> str | None:
    """Which kind of API/pipeline error string the answer is, or None."""
    head = text.strip()[:HEAD_CHARS]
    if head.lower() in PLACEHOLDERS:
        return "placeholder"
    if ANY_ERROR.match(head) is None:  # every kind is anchored at the start: one match instead of one per kind
        return None
    return next(kind for kind, pattern in ERROR_KINDS.items() if pattern.match(head))


def error_kinds(completions: list[str]) -> dict[int, str]:
    return {i: k for i, c in enumerate(completions) if c and (k := error_kind(c)) is not None}


def error_finding(completions: list[str], kinds: dict[int, str], excluded: set[int] = frozenset()
                  ) -> Finding | None:
    """kinds: error_kinds(completions). excluded: rows another finding already names for the same reason (a
    repeated stub such as "No valid response from model." keeps its own finding)."""
    kinds = {i: k for i, k in kinds.items() if i not in excluded}
    if not kinds:
        return None
    by_kind = Counter(kinds.values())
    return _finding("error_string", "API or pipeline error string",
                    f"whose answer is an error message or a missing value "
                    f"({', '.join(f'{k} {n}' for k, n in by_kind.most_common())})",
                    sorted(kinds), completions, len(completions), details={"kinds": dict(by_kind)})


def opens_unclosed(text: str) -> bool:
    """More brackets, code fences or XML/HTML tags opened than closed: what cutting an answer short leaves."""
    if any(text.count(a) > text.count(b) for a, b in PAIRS) or text.count("```") % 2:
        return True
    if _TAG.search(text):
        opened = text.count("<") - 2 * text.count("</") - text.count("<?") - text.count("<!") - text.count("/>")
        return opened > 0
    return False


_TAG = re.compile(r"<[A-Za-z]")
_BRACKET = re.compile(r"[(\[{]|```|<[A-Za-z]")


def endings(completions: list[str]) -> dict[int, tuple[str, bool | None]]:
    """{turn: (its last character, or None under CUT_MIN_WORDS words; whether it leaves brackets/tags open, or None
    when it has none)} per answer: what cut_off_finding judges, worked out once per audit."""
    out = {}
    for i, c in enumerate(completions):
        if c:
            out[i] = (c[-1] if c.count(" ") + 1 >= CUT_MIN_WORDS else None,
                      opens_unclosed(c) if _BRACKET.search(c) else None)
    return out


def cut_off_finding(completions: list[str], ends: dict[int, tuple[str, bool | None]],
                    excluded: set[int] = frozenset()) -> Finding | None:
    """Answers that stop mid-sentence where prose answers end their sentences, or leave brackets/tags open where
    answers balance them. ends: endings(completions). excluded: rows other rules already name (an error string
    among SQL answers does not end with a semicolon either); they neither set the norm nor are judged by it."""
    answers = [i for i in ends if i not in excluded]
    prose = [i for i in answers if ends[i][0] is not None]
    last = Counter(ends[i][0] for i in prose)
    mid = [i for i in prose if ends[i][0] not in CLEAN_ENDING]
    cut = set(mid) if len(prose) >= MIN_JUDGED and len(mid) <= (1 - ENDING_NORM) * len(prose) else set()
    # Structured answers (SQL, fenced code, SVG, JSON) end with one closing character; one that does not was cut.
    top, n = last.most_common(1)[0] if last else ("", 0)
    if top in STRUCTURE_ENDINGS and len(prose) >= MIN_JUDGED and n >= BALANCE_NORM * len(prose):
        cut.update(i for i in prose if ends[i][0] != top)
    bracketed = [i for i in answers if ends[i][1] is not None]
    open_rows = [i for i in bracketed if ends[i][1]]
    if len(bracketed) >= MIN_JUDGED and len(open_rows) <= (1 - BALANCE_NORM) * len(bracketed):
        cut.update(open_rows)
    if not cut:
        return None
    return _finding("cut_off", "answer cut off",
                    "stopping mid-sentence or with brackets/tags left open, where the other answers end cleanly "
                    "(generation stopped at a token limit): the model learns to stop mid-thought",
                    sorted(cut), completions, len(completions))


def _key(text: str) -> str:
    return " ".join(text.split()).lower()


def echo_finding(completions: list[str], requests: list[str]) -> Finding | None:
    """The prompt copied back as the answer (whole, or with a few characters added)."""
    rows = []
    for i, (c, r) in enumerate(zip(completions, requests)):
        if not c or len(r) < 12 or len(c) > 2 * len(r) + 20:  # far longer than the prompt: not a copy of it
            continue
        answer, asked = _key(c), _key(r)
        if answer == asked or (answer.startswith(asked) and len(answer) <= 1.1 * len(asked) + 10):
            rows.append(i)
    if not rows:
        return None
    return _finding("echo", "prompt echoed as answer", "whose answer repeats the prompt: nothing is learnt but copying",
                    rows, completions, len(completions))
