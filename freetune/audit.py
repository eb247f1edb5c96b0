"""Data audit: find the rows that would quietly ruin a fine-tune, show them, and clean them before training.

Why this exists: a public SVG data set had 84 of 4,750 completions equal to a pipeline's error string, "No
valid response from model."; an adapter trained on it answered that string to every prompt. The audit looks
for that and for the other defects that cost a training run:

  blocking (the recipe stops until they are cleaned or knowingly accepted)
    empty                 empty or whitespace-only completions
    repeated              a short completion repeated verbatim across >= `repeat_share_block` of the rows (or,
                          among fewer than 5 distinct answers, one answer given to half the rows or more)
    check:<name>          rows failing a recipe's validity check (SVG parses, the action is valid JSON, ...)
    no_trainable_tokens   rows whose completion is entirely cut off by `max_length` (TRL drops them silently)
    duplicate             exact copies of an earlier row
    conflict              a prompt seen earlier with a different answer
    overlap               training rows whose prompt is also in the evaluation set
  warning (shown, never dropped by default)
    repeated_other        answers repeated by many rows that look legitimate (as long as typical answers, or rare)
    short                 completions under `min_completion_chars` that are not part of a blocking repeat
    truncated             rows longer than `max_length` (the end of their answer and its EOS are cut)
    eos_not_in_labels     the stop token is not among the tokens trained on: the model may never learn to stop
    pad_is_eos            the pad token is the EOS token: collators that mask pad ids also mask EOS

Exact duplicates are blocking although one copy is harmless: dropping the later copies loses no information,
each copy doubles that row's weight, and when the data is later split into train and eval, copies land on both
sides and inflate the eval score. Cleaning them costs nothing, so the default is to clean.

Duplicates and conflicts are looked for among rows that pass the row checks (not empty, not junk, not failing
a check), so the first *valid* answer to a prompt is the one kept.

Token counts follow TRL's SFTTrainer on the same rows: conversational rows are rendered with the tokenizer's chat
template (the prompt with the generation prompt, and the full conversation), tokenised, and the completion
starts where the two agree; plain `prompt`/`completion` strings are tokenised as text with EOS appended, as TRL
does (no chat template); `messages` rows with assistant-only loss use TRL's assistant mask (its training chat
template's {% generation %} spans). Truncation keeps the start (`truncation_mode="keep_start"`). So audit the
data in the form the trainer gets it: after freetune.data.as_chat when the recipe trains on chats.

Speed: tokenising is most of the work (100,000 SVG rows are ~40M tokens). Qwen's and Llama 3's tokenizers are
byte-level BPE with a regex pre-split, which tiktoken runs 4-5x faster than the tokenizer's own backend, so the
audit builds a tiktoken twin of the tokenizer and uses it once it has produced exactly the tokenizer's ids on
the first rows and a probe string; any other tokenizer (or no tiktoken installed) goes through the tokenizer in
batches. Duplicates and repeats are found with dictionaries keyed by the texts, in one pass.

Usage:
    report = audit(dataset, tokenizer=tokenizer, max_length=1024, checks=freetune.tasks.svg.AUDIT_CHECKS)
    report.display()                        # a table in a notebook, text elsewhere
    cleaned, summary = clean(dataset, report)
    enforce(audit(cleaned, ...), accept_problems=False)
    # or all of it in one line:
    dataset, report, summary = audit_and_clean(dataset, auto_clean=True, accept_problems=False, ...)

Command line:
    python -m freetune.audit DATASET [--json] [--columns JSON] [--split train] [--model DIR_OR_ID]
                                     [--max-length N] [--checks svg|home_assistant] [--eval DATASET]
                                     [--eval-split test] [--strict]
"""

from __future__ import annotations

import html
import json
import math
import os
import statistics
import time
import unicodedata
import weakref
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import compress
from typing import Callable

from freetune.data import completion_text, prompt_messages, prompt_text
from freetune.errors import FreetuneError

# The recipe parameters the messages name, so a user knows exactly what to change.
ACCEPT_PARAMETER = "accept_data_problems"
CLEAN_PARAMETER = "auto_clean"

WHY_REPEATS_DOMINATE = (
    "Training loss is measured on the answers only, so every row pulls the model towards its own answer. A short "
    "answer repeated word for word, say 84 rows of the 6-token \"No valid response from model.\", is cheap to "
    "memorise: its loss drops to near zero within a few steps and every one of those rows pushes the same way, "
    "while thousands of long, varied answers stay hard and pull in different directions. The model learns that "
    "this short answer is always a likely reply, whatever the prompt, so 1.8% of the rows can decide what it "
    "says to every prompt. Removing such rows costs almost nothing; training on them can cost the whole run."
)

BLOCKING, WARNING = "blocking", "warning"
# A repeated answer counts as junk when it is shorter than this share of the median distinct answer: an error
# string among SVG files is (29 vs ~250 characters), the same Home Assistant action asked in other words is not.
SHORT_REPEAT_RATIO = 0.5
# With fewer distinct answers than this there is no typical length to compare with (a data set whose every answer is
# one stub has a single distinct answer, its own yardstick): an answer given verbatim to at least DOMINANT_SHARE of
# the rows is then junk whatever its length. Class labels look the same; the message says how to keep them.
MIN_DISTINCT_FOR_MEDIAN = 5
DOMINANT_SHARE = 0.5
TOP_EXAMPLES = 5          # repeats, conflicts and check reasons listed in a finding's details
EXAMPLE_CHARS = 120       # examples are cut to this length in reports
TOKENIZE_BATCH = 2048     # rows per tokeniser call: big enough for the Rust side's threads, small for memory

Check = Callable[[dict], "str | None"]


@dataclass
class Finding:
    """One kind of problem: which rows have it, how bad it is, and a line saying what it means."""

    id: str                 # unique in a report: "empty", "check:svg_xml", ...
    kind: str               # "empty", "repeated", "check", ...: what `clean(drop=...)` names
    severity: str           # "blocking" or "warning"
    title: str              # a few words for the table
    message: str            # one line: what was found, and what it costs
    rows: list[int] = field(default_factory=list, repr=False)   # row indices clean() would drop for it
    count: int = 0          # rows affected (len(rows) for row findings; 0 for settings findings)
    details: dict = field(default_factory=dict, repr=False)

    def to_dict(self, total_rows: int) -> dict:
        return {"id": self.id, "kind": self.kind, "severity": self.severity, "title": self.title,
                "message": self.message, "count": self.count, "share": _share(self.count, total_rows),
                "rows": list(self.rows), "details": self.details}


def _n(count: int, noun: str) -> str:
    """"1 row", "2 rows", "4,750 rows"."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def _share(count: int, total: int) -> float:
    return round(count / total, 6) if total else 0.0


def _cut(text: str, limit: int = EXAMPLE_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(repr=False)  # the table, not thousands of row indices, when a notebook or a log prints it
class AuditReport:
    """What the audit found. `to_dict()` is stable: the same data and settings give byte-identical JSON."""

    rows: int
    shape: str
    settings: dict
    findings: list[Finding]
    completion_chars: dict
    tokens: dict | None
    counts: dict = field(default_factory=dict)    # rows per finding id: 0 = looked, found none; None = not measured
    timings: dict = field(default_factory=dict)   # seconds per phase; not part of to_dict (it varies)
    engine: str | None = None                     # what tokenised the rows (same ids either way; not in to_dict)

    @property
    def longest_row(self) -> int | None:
        """Tokens of the longest row (before any cleaning), None when no tokenizer counted them: what the memory
        plan is sized for (freetune.preflight.replan)."""
        return self.tokens["sequence_tokens"]["max"] if self.tokens else None

    @property
    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == BLOCKING]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == WARNING]

    def finding(self, finding_id: str) -> Finding | None:
        return next((f for f in self.findings if f.id == finding_id), None)

    def flagged_rows(self) -> dict[str, list[int]]:
        """Row indices per finding id (only findings that name rows)."""
        return {f.id: list(f.rows) for f in self.findings if f.rows}

    def to_dict(self) -> dict:
        return {
            "rows": self.rows,
            "shape": self.shape,
            "settings": self.settings,
            "counts": self.counts,
            "blocking": [f.id for f in self.blocking],
            "findings": [f.to_dict(self.rows) for f in self.findings],
            "completion_chars": self.completion_chars,
            "tokens": self.tokens,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def _lines(self, dropping: bool = False) -> tuple[str, list[tuple[str, str, str, str, str]], list[str]]:
        header = f"Data audit: {self.rows:,} rows ({self.shape})"
        table = [(_status(f, dropping), f.title, f"{f.count:,}" if f.rows or f.count else "-",
                  f"{100 * f.count / self.rows:.2f}%" if (f.rows or f.count) and self.rows else "",
                  f.message) for f in self.findings]
        notes = []
        c = self.completion_chars
        if c:
            notes.append(f"Completion length (characters): min {c['min']:,} / median {c['median']:,} / "
                         f"max {c['max']:,}")
        t = self.tokens
        if t is None:
            notes.append("Token lengths: not measured (pass a tokenizer to count tokens, truncation and EOS).")
        else:
            s, tr = t["sequence_tokens"], t["trainable_tokens"]
            notes.append(f"Tokens per row: min {s['min']:,} / median {s['median']:,} / p95 {s['p95']:,} / "
                         f"max {s['max']:,}")
            if t["max_length"] is not None:
                notes.append(f"Rows longer than max_length={t['max_length']:,}: {t['truncated_rows']:,} "
                             f"({100 * t['truncated_share']:.2f}%)")
            notes.append(f"Trainable (completion) tokens per row: min {tr['min']:,} / median {tr['median']:,} / "
                         f"max {tr['max']:,}; rows with none: {t['no_trainable_rows']:,}")
            eos = t["eos_token"]
            notes.append(f"EOS {eos!r} inside the trained tokens: {t['eos_in_labels_rows']:,} of {self.rows:,} "
                         f"rows; labels end like {t['labels_end_example']!r}")
            notes.append(f"pad == EOS: {'yes' if t['pad_is_eos'] else 'no'} (pad {t['pad_token']!r})")
        dropped = {i for f in self.blocking for i in f.rows} if dropping else set()
        if not self.findings:
            notes.insert(0, "No problems found.")
        elif dropped:
            notes.insert(0, f"The {_n(len(dropped), 'row')} marked dropped are removed before training "
                            f"({CLEAN_PARAMETER}=True); the rows left are audited again.")
        elif not self.blocking:
            notes.insert(0, "No blocking problems.")
        return header, table, notes

    def table(self, dropping: bool = False) -> str:
        """A short human-readable table: one line per finding, then the length and token figures.

        dropping: the rows of the blocking findings are about to be dropped (auto-clean): they show as dropped."""
        header, table, notes = self._lines(dropping)
        out = [header]
        if table:
            heads = ("status", "finding", "rows", "share", "what it means")
            widths = [max(len(heads[i]), *(len(r[i]) for r in table)) for i in range(4)]
            out.append("  ".join(h.ljust(w) for h, w in zip(heads, widths + [0])).rstrip())
            for r in table:
                out.append("  ".join(v.ljust(w) if i != 2 else v.rjust(w)
                                     for i, (v, w) in enumerate(zip(r, widths + [0]))).rstrip())
        out.extend(notes)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.table()

    __repr__ = __str__

    def _repr_html_(self, dropping: bool = False) -> str:
        header, table, notes = self._lines(dropping)
        cells = "".join(
            f"<tr><td style='color:{STATUS_COLOURS[status]};font-weight:bold'>{status.lower()}</td>"
            f"<td>{html.escape(title)}</td><td style='text-align:right'>{rows}</td>"
            f"<td style='text-align:right'>{share}</td><td style='text-align:left'>{html.escape(msg)}</td></tr>"
            for status, title, rows, share, msg in table)
        body = (f"<table><thead><tr><th>status</th><th>finding</th><th>rows</th><th>share</th>"
                f"<th style='text-align:left'>what it means</th></tr></thead><tbody>{cells}</tbody></table>"
                if table else "")
        items = "".join(f"<li>{html.escape(n)}</li>" for n in notes)
        return f"<div><b>{html.escape(header)}</b>{body}<ul>{items}</ul></div>"

    def display(self, dropping: bool = False) -> None:
        """Show the report as a table: rich in a notebook, plain text in a terminal or a torchrun log."""
        _show(_AuditView(self, dropping))


# Red stops the run; rows about to be dropped are not a problem left to the user.
STATUS_COLOURS = {"BLOCKING": "#b71c1c", "WARNING": "#8d6e00", "DROPPED": "#546e7a"}


def _status(finding: Finding, dropping: bool) -> str:
    return "DROPPED" if dropping and finding.severity == BLOCKING and finding.rows else finding.severity.upper()


@dataclass
class _AuditView:
    """The report as shown while auto-clean is about to drop its blocking rows."""

    report: AuditReport
    dropping: bool

    def _repr_html_(self) -> str:
        return self.report._repr_html_(self.dropping)

    def __str__(self) -> str:
        return self.report.table(self.dropping)


def _show(obj) -> None:
    try:
        from IPython import get_ipython
        from IPython.display import display

        if get_ipython() is not None and hasattr(obj, "_repr_html_"):
            display(obj)
            return
    except ImportError:
        pass
    print(obj)


# --- reading rows -------------------------------------------------------------------------------------------


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


# --- row-level findings -------------------------------------------------------------------------------------


def _empty_finding(completions: list[str]) -> Finding | None:
    rows = [i for i, c in enumerate(completions) if not c.strip()]
    if not rows:
        return None
    return Finding("empty", "empty", BLOCKING, "empty completion",
                   f"{_n(len(rows), 'row')} with an empty or whitespace-only completion: they teach the model to "
                   f"answer nothing.", rows, len(rows))


def _repeat_findings(completions: list[str], requests: Callable[[int], str], *, repeat_min_rows: int,
                     repeat_share_block: float) -> list[Finding]:
    total = len(completions)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(completions):
        text = c.strip()
        if text:
            groups[text].append(i)
    # The typical answer length over *distinct* answers: junk repeated over most rows still counts once, so it
    # cannot become the yardstick it is measured against.
    median_chars = statistics.median(len(text) for text in groups) if groups else 0
    repeated = [(text, rows) for text, rows in groups.items() if len(rows) >= repeat_min_rows]
    if not repeated:
        return []
    repeated.sort(key=lambda item: (-len(item[1]), item[0]))

    few_distinct = len(groups) < MIN_DISTINCT_FOR_MEDIAN

    def is_junk(text: str, rows: list[int]) -> bool:
        share = len(rows) / total
        return share >= repeat_share_block and (len(text) < SHORT_REPEAT_RATIO * median_chars
                                                or few_distinct and share >= DOMINANT_SHARE)

    def describe(text: str, rows: list[int]) -> dict:
        return {"completion": _cut(text), "rows": len(rows), "share": _share(len(rows), total),
                "chars": len(text), "example_prompts": [_cut(requests(i), 100) for i in rows[:3]]}

    findings = []
    junk = [(t, r) for t, r in repeated if is_junk(t, r)]
    other = [(t, r) for t, r in repeated if not is_junk(t, r)]
    if junk:
        rows = sorted(i for _, r in junk for i in r)
        top_text, top_rows = junk[0]
        findings.append(Finding(
            "repeated", "repeated", BLOCKING, "repeated short completion",
            f"{_n(len(junk), 'short completion')} repeated verbatim over {_n(len(rows), 'row')}, e.g. "
            f"{_cut(top_text, 60)!r} x{len(top_rows):,}: cheap to memorise, they can become the answer to "
            f"every prompt.{_few_answers_note(len(groups)) if few_distinct else ''}", rows, len(rows),
            {"completions": len(junk), "top": [describe(t, r) for t, r in junk[:TOP_EXAMPLES]]}))
    if other:
        rows = sorted(i for _, r in other for i in r)
        top_text, top_rows = other[0]
        findings.append(Finding(
            "repeated_other", "repeated", WARNING, "repeated completion",
            f"{_n(len(other), 'completion')} each in {repeat_min_rows}+ rows ({_n(len(rows), 'row')}), e.g. "
            f"{_cut(top_text, 60)!r} x{len(top_rows):,}; as long as typical answers or rare, so kept. Check "
            f"they are real answers.", rows, len(rows),
            {"completions": len(other), "top": [describe(t, r) for t, r in other[:TOP_EXAMPLES]]}))
    return findings


def _few_answers_note(distinct: int) -> str:
    if distinct == 1:
        return " Every row has this one answer: there is nothing else to learn. Check the data set and its `columns`."
    return (f" The data set has only {distinct} distinct answers; if they are class labels, set "
            f"`{CLEAN_PARAMETER}=False` and `{ACCEPT_PARAMETER}=True` to train on them.")


def _short_finding(completions: list[str], min_chars: int, excluded: set[int]) -> Finding | None:
    rows = [i for i, c in enumerate(completions) if 0 < len(c.strip()) < min_chars and i not in excluded]
    if not rows:
        return None
    return Finding("short", "short", WARNING, "very short completion",
                   f"{_n(len(rows), 'completion')} under {min_chars} characters, e.g. "
                   f"{_cut(completions[rows[0]].strip(), 40)!r}. Fine for labels; suspicious for long answers.",
                   rows, len(rows))


def _check_findings(rows: list[dict], checks: dict[str, Check]) -> list[Finding]:
    findings = []
    for name in sorted(checks):
        check = checks[name]
        failed, reasons = [], Counter()
        for i, row in enumerate(rows):
            try:
                reason = check(row)
            except Exception as exc:  # a row that breaks a check is as unusable as one that fails it
                reason = f"the check raised {type(exc).__name__}: {exc}"
            if reason is not None:
                failed.append(i)
                reasons[_cut(str(reason), 100)] += 1
        if failed:
            top_reason, _ = reasons.most_common(1)[0]
            findings.append(Finding(
                f"check:{name}", "check", BLOCKING, f"fails check {name!r}",
                f"{_n(len(failed), 'row')} failing the recipe's {name!r} check, e.g. {top_reason}", failed,
                len(failed),
                {"check": name, "reasons": [{"reason": r, "rows": n}
                                            for r, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
                                            [:TOP_EXAMPLES]]}))
    return findings


def _duplicate_findings(prompts: list[str], completions: list[str], excluded: set[int],
                        requests: Callable[[int], str]) -> list[Finding]:
    first_row: dict[str, int] = {}
    answers: dict[str, set[str]] = defaultdict(set)
    seen_pairs: set[tuple[str, str]] = set()
    duplicates, conflicts = [], []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        if i in excluded:
            continue
        key, answer = _prompt_key(prompt), completion.strip()
        if (key, answer) in seen_pairs:
            duplicates.append(i)
            continue
        seen_pairs.add((key, answer))
        answers[key].add(answer)
        if key in first_row:
            conflicts.append(i)
        else:
            first_row[key] = i
    findings = []
    if duplicates:
        findings.append(Finding(
            "duplicate", "duplicate", BLOCKING, "exact duplicate row",
            f"{_n(len(duplicates), 'row')} repeating an earlier row's prompt and answer: each copy doubles that "
            f"row's weight, and copies split across train/eval inflate the eval score. Dropping them loses nothing.",
            duplicates, len(duplicates)))
    if conflicts:
        conflicting = sorted((k for k, v in answers.items() if len(v) > 1), key=first_row.__getitem__)
        findings.append(Finding(
            "conflict", "conflict", BLOCKING, "prompt with conflicting answers",
            f"{_n(len(conflicting), 'prompt')} with several different answers ({_n(len(conflicts), 'later row')}): "
            f"the model is taught both. Cleaning keeps the first answer; accept it knowingly if several answers "
            f"are valid for your task.", conflicts, len(conflicts),
            {"prompts": len(conflicting),
             "examples": [{"prompt": _cut(requests(first_row[k]), 100), "answers": _where_they_differ(answers[k])}
                          for k in conflicting[:TOP_EXAMPLES]]}))
    return findings


def _where_they_differ(answers: set[str], shown: int = 3) -> list[str]:
    """Up to `shown` answers, each cut to start just before the first character where they differ (long answers
    with a common start would otherwise all read the same)."""
    ordered = sorted(answers)[:shown]
    start = max(0, len(os.path.commonprefix(ordered)) - 20)
    return [("..." if start else "") + _cut(a[start:], 80) for a in ordered]


def _overlap_finding(prompts: list[str], eval_prompts: set[str], requests: Callable[[int], str]
                     ) -> Finding | None:
    rows = [i for i, p in enumerate(prompts) if _prompt_key(p) in eval_prompts]
    if not rows:
        return None
    return Finding("overlap", "overlap", BLOCKING, "prompt also in eval set",
                   f"{_n(len(rows), 'training row')} whose prompt is also in the evaluation set: the eval score "
                   f"would measure memory, not skill.", rows, len(rows),
                   {"example_prompts": [_cut(requests(i), 100) for i in rows[:3]]})


# --- tokens -------------------------------------------------------------------------------------------------


def _load_tokenizer(tokenizer):
    if not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(tokenizer)
    except Exception as exc:
        raise FreetuneError(f"Could not load a tokenizer from {tokenizer!r}: {type(exc).__name__}: "
                            f"{str(exc)[:200]}. Give a model folder or hub id (`model`), or no tokenizer to skip "
                            f"the token checks.") from exc


def _conversations(rows: list[dict], shape: str) -> tuple[list[list[dict]], list[list[dict]]]:
    """(prompt turns, full conversation) per row, as TRL hands them to the chat template."""
    prompts, fulls = [], []
    for row in rows:
        if shape == "messages":
            turns = [m for m in row["messages"] if isinstance(m, dict)]
            last = max((i for i, m in enumerate(turns) if m.get("role") == "assistant"), default=len(turns))
            prompts.append(turns[:last])
            fulls.append(turns)
        else:  # prompt/completion as message lists
            completion = row["completion"] or []
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            prompts.append(list(row["prompt"] or []))
            fulls.append(list(row["prompt"] or []) + list(completion))
    return prompts, fulls


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise FreetuneError("This data set is conversational but the tokenizer has no chat template, so TRL could "
                            "not render it. Use an instruct model's tokenizer, or set tokenizer.chat_template.")


def _training_template(tokenizer) -> str | None:
    """The template TRL trains with under assistant_only_loss (one with {% generation %} markers); None when TRL
    is not installed (the audit then counts the last assistant turn)."""
    try:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers
    except ImportError:
        return None
    if has_generation_markers(tokenizer.chat_template):
        return tokenizer.chat_template
    try:
        return get_training_chat_template(tokenizer) or tokenizer.chat_template
    except ValueError as exc:
        raise FreetuneError(
            f"Training on assistant turns only needs a chat template that marks them ({{% generation %}}), and TRL "
            f"cannot patch this tokenizer's template ({exc}). Set `assistant_only=False` to train on every token, "
            f"or give the tokenizer a template with generation markers.") from exc


# A string that exercises what tokenisers disagree on: digits, accents, non-Latin scripts, runs of spaces and
# newlines, and special tokens inside text.
_PROBE = ("Héllo wörld  12345 ÅÅ ﬁ Ω≈ç √ 你好，世界 こんにちは 🙂🙂 \n\n\t  x  <|im_end|>\n<|im_start|>a"
          "'s 'LL won't   \r\n end")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as, mapped back to it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _split_pattern(pre_tokenizer: dict | None) -> str | None:
    """The regex a byte-level pre-tokeniser splits text with, or None for any other pre-tokeniser."""
    if pre_tokenizer is None:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        return _GPT2_PATTERN if pre_tokenizer.get("use_regex") and not pre_tokenizer.get("add_prefix_space") else None
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers", [])
    if (len(steps) == 2 and steps[0].get("type") == "Split" and "Regex" in steps[0].get("pattern", {})
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex")
            and not steps[1].get("add_prefix_space")):
        return steps[0]["pattern"]["Regex"]
    return None


def tiktoken_twin(tokenizer):
    """(a tiktoken Encoding with this tokenizer's vocabulary and split rules, why) or (None, why not).

    Qwen's and Llama 3's tokenizers are byte-level BPE with a regex pre-split, which tiktoken runs 4-5x faster
    than transformers' tokenizer (its regex engine is the difference). The audit uses the twin only after it
    produced exactly the tokenizer's ids on the audited rows themselves (see _Encoder).
    """
    try:
        import tiktoken
        from tokenizers import models, normalizers
    except ImportError:
        return None, "tiktoken is not installed"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast tokenizer"
    model = backend.model
    if not isinstance(model, models.BPE) or model.dropout or model.byte_fallback or model.continuing_subword_prefix \
            or model.end_of_word_suffix:
        return None, f"its model is not a plain byte-level BPE ({type(model).__name__})"
    normalizer = backend.normalizer
    if normalizer is not None and not isinstance(normalizer, normalizers.NFC):
        return None, f"its normaliser ({type(normalizer).__name__}) has no tiktoken equivalent"
    pre_tokenizer = backend.pre_tokenizer
    pattern = _split_pattern(json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else None)
    if pattern is None:
        return None, "its pre-tokeniser is not a regex split with byte-level encoding"
    added = tokenizer.added_tokens_decoder
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None, "some added tokens strip surrounding spaces, which tiktoken does not do"
    alphabet = _byte_level_alphabet()
    try:
        ranks = {bytes(alphabet[ch] for ch in token): rank
                 for token, rank in backend.get_vocab(with_added_tokens=False).items()}
        twin = tiktoken.Encoding("freetune-audit", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={t.content: i for i, t in added.items()})
    except (KeyError, ValueError) as exc:  # a token outside the byte alphabet; a regex tiktoken cannot compile
        return None, f"tiktoken cannot mirror it ({type(exc).__name__}: {str(exc)[:80]})"
    return twin, "tiktoken twin of the tokenizer"


_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cached_twin(tokenizer):
    # Building the twin reads the whole vocabulary (a second or two): once per tokenizer, and again only when
    # tokens were added (audit_and_clean audits twice; a notebook may re-run the cell).
    try:
        size, twin, why = _TWINS[tokenizer]
        if size == len(tokenizer):
            return twin, why
    except (KeyError, TypeError):
        pass
    twin, why = tiktoken_twin(tokenizer)
    try:
        _TWINS[tokenizer] = (len(tokenizer), twin, why)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return twin, why


class _Encoder:
    """Batch tokenisation with the tokenizer's fast backend, or with its tiktoken twin once the twin has given
    exactly the tokenizer's ids on a sample of the audited texts plus a probe string (checked per call shape)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.twin, self.looked = None, False   # the twin is built on first use: some paths never need it
        self.engine = "the tokenizer"
        self.verified: set[bool] = set()
        self.prefix: dict[bool, list[int]] = {}

    def _with_tokenizer(self, texts: list[str], special: bool) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=special, truncation=False, padding=False,
                              return_attention_mask=False)["input_ids"]

    def _with_twin(self, texts: list[str], special: bool) -> list[list[int]]:
        # What the tokenizer's post-processor adds to plain text (a BOS for Llama), checked like the rest.
        if special not in self.prefix:
            self.prefix[special] = self._with_tokenizer([""], special)[0]
        prefix = self.prefix[special]
        if self.tokenizer.backend_tokenizer.normalizer is not None:  # NFC: tiktoken_twin accepts no other
            texts = [unicodedata.normalize("NFC", t) for t in texts]
        # One slice per core rather than tiktoken's encode_batch, which pays a thread-pool future per text.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(cores, max(1, len(texts) // 256))
        size = -(-len(texts) // workers)
        slices = [texts[i:i + size] for i in range(0, len(texts), size)]
        encode = self.twin.encode

        def run(part: list[str]) -> list[list[int]]:
            if prefix:
                return [prefix + encode(t, allowed_special="all") for t in part]
            return [encode(t, allowed_special="all") for t in part]

        if len(slices) == 1:
            return run(slices[0])
        with ThreadPoolExecutor(len(slices)) as pool:  # tiktoken releases the GIL while it encodes
            return [ids for part in pool.map(run, slices) for ids in part]

    def __call__(self, texts: list[str], special: bool) -> list[list[int]]:
        if not self.looked:
            self.looked = True
            self.twin, why = _cached_twin(self.tokenizer)
            if self.twin is None:
                self.engine = f"the tokenizer (no tiktoken twin: {why})"
        if self.twin is not None and special not in self.verified:
            sample = texts[:64] + [_PROBE]
            if self._with_twin(sample, special) == self._with_tokenizer(sample, special):
                self.verified.add(special)
                self.engine = "tiktoken twin of the tokenizer (matched it on the first rows)"
            else:
                self.twin, self.engine = None, "the tokenizer (its tiktoken twin differed on the first rows)"
        return self._with_twin(texts, special) if self.twin is not None else self._with_tokenizer(texts, special)


def _completion_starts(encode: _Encoder, prompts: list[str], fulls: list[str], special: bool):
    """(input ids, where the completion starts) per row: where the tokenised prompt and prompt + completion stop
    agreeing, as TRL computes it (a token merging across the boundary belongs to the completion)."""
    full_ids = encode(fulls, special)
    prompt_ids = encode(prompts, special)
    return full_ids, [_common_prefix(p, f) for p, f in zip(prompt_ids, full_ids)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _tokenised(tokenizer, rows: list[dict], shape: str, assistant_only: bool):
    """(batches, loss_on, encoder): batches yield (input ids, trained) per row, built the way TRL's SFTTrainer
    builds them, where `trained` is the index the completion starts at or a 0/1 loss mask. loss_on says what
    the loss is on: "completion", "assistant turns" or "all tokens"."""
    encode = _Encoder(tokenizer)
    if shape == "prompt_completion":
        # Plain strings are not chats to TRL: it tokenises prompt and prompt + completion + EOS as text.
        eos = tokenizer.eos_token or ""

        def plain_batches():
            for start in range(0, len(rows), TOKENIZE_BATCH):
                chunk = rows[start:start + TOKENIZE_BATCH]
                prompts = [row["prompt"] or "" for row in chunk]
                fulls = [p + (c if c.endswith(eos) else c + eos)
                         for p, c in zip(prompts, (row["completion"] or "" for row in chunk))]
                yield _completion_starts(encode, prompts, fulls, True)

        return plain_batches(), "completion", encode
    _require_template(tokenizer)
    template = _training_template(tokenizer) if shape == "messages" and assistant_only else None
    loss_on = ("all tokens" if shape == "messages" and not assistant_only
               else "assistant turns" if template is not None else "completion")

    def chat_batches():
        for start in range(0, len(rows), TOKENIZE_BATCH):
            prompt_turns, full_turns = _conversations(rows[start:start + TOKENIZE_BATCH], shape)
            if loss_on == "assistant turns":
                # transformers maps the template's {% generation %} spans to tokens, exactly as TRL asks it to.
                out = tokenizer.apply_chat_template(full_turns, chat_template=template, tokenize=True,
                                                    return_dict=True, return_assistant_tokens_mask=True)
                yield out["input_ids"], out["assistant_masks"]
                continue
            # Whole lists per call: transformers renders each conversation in one loop.
            fulls = tokenizer.apply_chat_template(full_turns, tokenize=False)
            if loss_on == "all tokens":
                ids = encode(fulls, False)
                yield ids, [0] * len(ids)
            else:
                prompts = tokenizer.apply_chat_template(prompt_turns, tokenize=False, add_generation_prompt=True)
                yield _completion_starts(encode, prompts, fulls, False)

    return chat_batches(), loss_on, encode


def _nearest_rank(sorted_values: list[int], q: float) -> int:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]


def _token_findings(tokenizer, rows: list[dict], shape: str, max_length: int | None, assistant_only: bool
                    ) -> tuple[list[Finding], dict, str]:
    eos_id = tokenizer.eos_token_id
    lengths, trainable, has_eos = [], [], []
    tail = None  # the last trained tokens of the first untruncated row: shows what the labels end with
    batches, loss_on, encoder = _tokenised(tokenizer, rows, shape, assistant_only)
    for ids_batch, trained_batch in batches:
        for ids, trained_spec in zip(ids_batch, trained_batch):
            end = len(ids) if max_length is None else min(len(ids), max_length)
            trained = (ids[trained_spec:end] if isinstance(trained_spec, int)
                       else list(compress(ids[:end], trained_spec[:end])))
            lengths.append(len(ids))
            trainable.append(len(trained))
            has_eos.append(eos_id is not None and eos_id in trained)
            if tail is None and trained and end == len(ids):
                tail = trained[-3:]
    n = len(rows)
    truncated = [i for i, length in enumerate(lengths) if max_length is not None and length > max_length]
    none = [i for i, t in enumerate(trainable) if t == 0]
    truncated_set = set(truncated)
    no_eos = [i for i, ok in enumerate(has_eos) if not ok and i not in truncated_set]
    pad_id = tokenizer.pad_token_id
    pad_is_eos = pad_id is None or pad_id == eos_id
    labels_end = tokenizer.decode(tail) if tail else ""
    ordered, trained_sorted = sorted(lengths), sorted(trainable)
    stats = {
        "loss_on": loss_on,
        "max_length": max_length,
        "sequence_tokens": {"min": ordered[0], "median": _nearest_rank(ordered, 0.5),
                            "p95": _nearest_rank(ordered, 0.95), "max": ordered[-1], "total": sum(ordered)},
        "trainable_tokens": {"min": trained_sorted[0], "median": _nearest_rank(trained_sorted, 0.5),
                             "max": trained_sorted[-1], "total": sum(trained_sorted)},
        "truncated_rows": len(truncated) if max_length is not None else None,
        "truncated_share": _share(len(truncated), n) if max_length is not None else None,
        "no_trainable_rows": len(none),
        "eos_token": tokenizer.eos_token,
        "eos_in_labels_rows": sum(has_eos),
        "pad_token": tokenizer.pad_token,
        "pad_is_eos": pad_is_eos,
        "labels_end_example": labels_end,
    }
    findings = []
    if none:
        findings.append(Finding(
            "no_trainable_tokens", "no_trainable_tokens", BLOCKING, "no trainable tokens",
            f"{_n(len(none), 'row')} with no answer tokens left after truncation to max_length={max_length}: TRL "
            f"drops them silently. Raise `max_length` or shorten their prompts.", none, len(none)))
    if truncated:
        lost_eos = sum(1 for i in truncated if not has_eos[i])
        findings.append(Finding(
            "truncated", "truncated", WARNING, "longer than max_length",
            f"{_n(len(truncated), 'row')} longer than max_length={max_length} (longest {ordered[-1]:,} tokens): "
            f"their answers are cut, {lost_eos:,} lose the EOS. Raise `max_length` if memory allows.",
            truncated, len(truncated), {"lost_eos": lost_eos}))
    if no_eos:
        findings.append(Finding(
            "eos_not_in_labels", "eos_not_in_labels", WARNING, "EOS not trained on",
            f"EOS {tokenizer.eos_token!r} is not among the trained tokens of {_n(len(no_eos), 'untruncated row')} "
            f"(the labels end like {labels_end!r}): the model may never learn to stop. Use a chat template that "
            f"closes the answer with EOS, or set the tokenizer's eos_token to the turn's end token.",
            no_eos, len(no_eos)))
    if pad_is_eos:
        findings.append(Finding(
            "pad_is_eos", "pad_is_eos", WARNING, "pad token is EOS",
            f"The pad token is {'unset (TRL pads with EOS)' if pad_id is None else 'the EOS token'}: collators "
            f"that mask pad ids (transformers' DataCollatorForLanguageModeling) also mask every EOS, and the model "
            f"never learns to stop. TRL's collator masks by position, so it is safe there; set a distinct pad "
            f"token to be safe everywhere.", [], 0))
    return findings, stats, encoder.engine


# --- the audit ----------------------------------------------------------------------------------------------


def audit(dataset, *, tokenizer=None, max_length: int | None = None, checks: dict[str, Check] | None = None,
          eval_dataset=None, min_completion_chars: int = 8, repeat_min_rows: int = 3,
          repeat_share_block: float = 0.005, assistant_only: bool = True) -> AuditReport:
    """Audit a normalised data set (see freetune.data.normalize); returns an AuditReport.

    tokenizer: a tokenizer, or a model folder / hub id to load one from; None skips the token checks.
    max_length: the training max_length; rows longer are reported as truncated.
    checks: {name: check(row) -> None if fine, else a short reason}, e.g. freetune.tasks.svg.AUDIT_CHECKS.
    eval_dataset: the evaluation split (normalised); training rows whose prompt is in it are flagged.
    min_completion_chars: completions shorter than this (and non-empty) are reported as very short.
    repeat_min_rows: a completion in at least this many rows counts as repeated.
    repeat_share_block: a repeated short completion covering at least this share of rows is blocking.
    assistant_only: for `messages` rows, whether training puts the loss on assistant turns only (TRL's
        assistant_only_loss, counted with TRL's own assistant mask) or on every token. Pass what training uses.
    """
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(phase: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[phase] = now - clock
        clock = now

    shape = _shape(dataset)
    if len(dataset) == 0:
        raise FreetuneError("The data set has no rows to audit. Check the `dataset` parameter and its split.")
    rows = dataset.to_list()
    completions = [_safe_completion(r) for r in rows]
    prompts = [_safe_prompt(r) for r in rows]
    total = len(rows)
    lap("read rows")

    lengths = sorted(len(c.strip()) for c in completions if c.strip())
    def requests(i: int) -> str:
        return _request(rows[i])

    findings: list[Finding] = []
    empty = _empty_finding(completions)
    repeats = _repeat_findings(completions, requests, repeat_min_rows=repeat_min_rows,
                               repeat_share_block=repeat_share_block)
    junk = next((f for f in repeats if f.id == "repeated"), None)
    short = _short_finding(completions, min_completion_chars, set(junk.rows) if junk else set())
    findings += [f for f in (empty, *repeats, short) if f is not None]
    lap("text checks")

    findings += _check_findings(rows, dict(checks or {}))
    lap("recipe checks")

    token_stats, engine = None, None
    if tokenizer is not None:
        tokenizer = _load_tokenizer(tokenizer)
        token_findings, token_stats, engine = _token_findings(tokenizer, rows, shape, max_length, assistant_only)
        findings += token_findings
    lap("tokens")

    invalid = {i for f in findings if f.severity == BLOCKING for i in f.rows}
    findings += _duplicate_findings(prompts, completions, invalid, requests)
    eval_rows = None
    if eval_dataset is not None:
        eval_rows = len(eval_dataset)
        _shape(eval_dataset)
        eval_prompts = {_prompt_key(_safe_prompt(r)) for r in eval_dataset.to_list()}
        overlap = _overlap_finding(prompts, eval_prompts, requests)
        if overlap is not None:
            findings.append(overlap)
    lap("duplicates")

    # Blocking first, then the biggest: the table reads in order of what to look at.
    findings.sort(key=lambda f: (f.severity != BLOCKING, -f.count, f.id))
    settings = {
        "max_length": max_length,
        "min_completion_chars": min_completion_chars,
        "repeat_min_rows": repeat_min_rows,
        "repeat_share_block": repeat_share_block,
        "assistant_only": assistant_only,
        "checks": sorted(checks or {}),
        "eval_rows": eval_rows,
        # Class and special tokens, not name_or_path: a folder path would differ between machines.
        "tokenizer": None if tokenizer is None else {
            "class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token},
    }
    completion_chars = ({"min": lengths[0], "median": _nearest_rank(lengths, 0.5), "max": lengths[-1]}
                        if lengths else {"min": 0, "median": 0, "max": 0})
    timings["total"] = sum(timings.values())
    found = {f.id: f.count for f in findings}
    measured = {"empty": True, "repeated": True, "repeated_other": True, "short": True, "duplicate": True,
                "conflict": True, "overlap": eval_dataset is not None,
                "no_trainable_tokens": tokenizer is not None, "eos_not_in_labels": tokenizer is not None,
                "truncated": tokenizer is not None and max_length is not None,
                **{f"check:{name}": True for name in checks or {}}}
    counts = {key: found.get(key, 0) if ok else None for key, ok in measured.items()}
    return AuditReport(total, shape, settings, findings, completion_chars, token_stats, counts, timings, engine)


# --- cleaning and the policy --------------------------------------------------------------------------------


@dataclass(repr=False)
class CleanSummary:
    """Rows before and after cleaning, and for every finding how many of its rows were there before and after."""

    rows_before: int
    rows_after: int
    reasons: list[dict]     # {"id", "title", "severity", "dropped": bool, "before", "after"}

    def to_dict(self) -> dict:
        return {"rows_before": self.rows_before, "rows_after": self.rows_after, "reasons": self.reasons}

    def __str__(self) -> str:
        dropped = self.rows_before - self.rows_after
        lines = [f"Cleaned: {self.rows_before:,} -> {self.rows_after:,} rows ({dropped:,} dropped; a row with "
                 f"several problems counts under each)"]
        width = max((len(r["title"]) for r in self.reasons), default=0)
        for r in self.reasons:
            action = "dropped" if r["dropped"] else f"kept ({r['severity']})"
            lines.append(f"  {r['title']:<{width}}  {r['before']:>8,} -> {r['after']:>8,}  {action}")
        return "\n".join(lines)

    __repr__ = __str__

    def display(self) -> None:
        print(self)


def clean(dataset, report: AuditReport, drop: tuple[str, ...] | None = None):
    """Drop the rows the report flags; returns (cleaned data set, CleanSummary).

    drop: None drops the rows of every blocking finding. A tuple names finding kinds or ids to drop regardless
    of severity, e.g. ("empty", "repeated", "check") or ("check:svg_xml", "short").
    """
    if len(dataset) != report.rows:
        raise FreetuneError(f"The report describes {report.rows:,} rows but the data set has {len(dataset):,}: "
                            f"clean the data set that was audited.")

    def selected(f: Finding) -> bool:
        return f.severity == BLOCKING if drop is None else (f.kind in drop or f.id in drop)

    remove = {i for f in report.findings if selected(f) for i in f.rows}
    keep = [i for i in range(len(dataset)) if i not in remove]
    cleaned = dataset.select(keep) if remove else dataset
    reasons = [{"id": f.id, "title": f.title, "severity": f.severity, "dropped": selected(f),
                "before": f.count, "after": sum(1 for i in f.rows if i not in remove)}
               for f in report.findings if f.rows]
    return cleaned, CleanSummary(len(dataset), len(keep), reasons)


def _problem_lines(findings: list[Finding], total: int) -> str:
    return "\n".join(f"  - {f.title}: {_n(f.count, 'row')} ({100 * f.count / max(total, 1):.2f}%). {f.message}"
                     for f in findings)


def enforce(report: AuditReport, accept_problems: bool) -> None:
    """Stop (FreetuneError) while blocking problems remain, unless the user accepted them; then warn."""
    if not report.blocking:
        return
    problems = _problem_lines(report.blocking, report.rows)
    if not accept_problems:
        raise FreetuneError(
            f"The training data still has {len(report.blocking)} blocking problem(s):\n{problems}\n"
            f"Fix the data set, let the recipe drop these rows (`{CLEAN_PARAMETER}=True`), or set "
            f"`{ACCEPT_PARAMETER}=True` in the parameters cell to train on them knowingly.")
    print(f"WARNING: training on data with {len(report.blocking)} blocking problem(s), because "
          f"{ACCEPT_PARAMETER}=True:\n{problems}")


def audit_and_clean(dataset, *, auto_clean: bool, accept_problems: bool, **audit_kwargs):
    """The recipe's data audit cell in one call: audit, show, clean (if auto_clean), re-audit, enforce.

    Returns (data set to train on, its AuditReport, CleanSummary or None when nothing was cleaned).
    """
    report = audit(dataset, **audit_kwargs)
    report.display(dropping=auto_clean)
    if report.finding("repeated") is not None:
        print("\nWhy repeated short answers matter: " + WHY_REPEATS_DOMINATE)
    summary = None
    if auto_clean and report.blocking:
        dataset, summary = clean(dataset, report)
        print()
        summary.display()
        if len(dataset) == 0:
            raise FreetuneError(f"Every one of the {report.rows:,} rows has a blocking problem (see the table "
                                f"above), so nothing is left to train on. Check the data set and its `columns`.")
        report = audit(dataset, **audit_kwargs)
        if report.blocking:
            print()
            report.display()
    enforce(report, accept_problems)
    return dataset, report, summary


# --- command line -------------------------------------------------------------------------------------------


def resolve_checks(name: str) -> dict[str, Check]:
    """A task's AUDIT_CHECKS by task name ("svg", "home_assistant"), imported only when asked for."""
    import importlib

    module_name = f"freetune.tasks.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, "freetune.tasks"):
            raise
        raise FreetuneError(f"No checks named {name!r}: freetune has no module {module_name}. Use --checks svg or "
                            f"--checks home_assistant, or leave --checks out.") from exc
    checks = getattr(module, "AUDIT_CHECKS", None)
    if not isinstance(checks, dict):
        raise FreetuneError(f"{module_name} defines no AUDIT_CHECKS dict, so there is nothing to check. Leave "
                            f"--checks out, or add AUDIT_CHECKS to that module.")
    return checks


def main(argv: list[str] | None = None) -> int:
    import argparse
    import contextlib
    import sys

    from freetune.data import load_rows, normalize

    parser = argparse.ArgumentParser(prog="python -m freetune.audit",
                                     description="Audit a training data set before fine-tuning on it.")
    parser.add_argument("dataset", help="a .jsonl/.json/.csv/.parquet file, a saved data set folder, or a hub id")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--columns", help='column mapping as JSON, e.g. \'{"prompt": "instruction", '
                                          '"completion": "output"}\'')
    parser.add_argument("--split", default="train")
    parser.add_argument("--eval", dest="eval_dataset", help="an evaluation data set to check for overlap")
    parser.add_argument("--eval-split", default="test", help="its split, for a hub id (default: test)")
    parser.add_argument("--model", help="model folder or hub id whose tokenizer counts tokens")
    parser.add_argument("--max-length", type=int, help="the training max_length (needs --model)")
    parser.add_argument("--checks", help="task checks to run: svg or home_assistant")
    parser.add_argument("--strict", action="store_true", help="exit with status 2 when blocking problems remain")
    args = parser.parse_args(argv)
    if args.max_length is not None and not args.model:
        parser.error("--max-length needs --model (the tokenizer that counts the tokens)")
    try:
        columns = json.loads(args.columns) if args.columns else None
        if columns is not None and not isinstance(columns, dict):
            raise FreetuneError("--columns must be a JSON object, e.g. '{\"completion\": \"output\"}'.")
        with contextlib.redirect_stdout(sys.stderr):  # the progress lines; stdout holds the report alone
            dataset = normalize(load_rows(args.dataset, split=args.split), columns=columns)
            eval_dataset = (normalize(load_rows(args.eval_dataset, split=args.eval_split), columns=columns)
                            if args.eval_dataset else None)
            report = audit(dataset, tokenizer=args.model, max_length=args.max_length,
                           checks=resolve_checks(args.checks) if args.checks else None, eval_dataset=eval_dataset)
    except json.JSONDecodeError as exc:
        print(f"error: --columns is not valid JSON ({exc}).", file=sys.stderr)
        return 1
    except FreetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.table())
    return 2 if args.strict and report.blocking else 0


if __name__ == "__main__":
    raise SystemExit(main())
