"""The rules on the rows' text: empty, repeated and very short answers, the recipe's validity checks, exact
duplicates, prompts with conflicting answers, and prompts that are also in the evaluation set. Each rule returns
its Findings (None or [] when it found nothing)."""

from __future__ import annotations

import os
import statistics
from collections import Counter, defaultdict
from typing import Callable

from freetune.audit.findings import BLOCKING, TOP_EXAMPLES, WARNING, Check, Finding, _cut, _n, _share
from freetune.audit.rows import _prompt_key


WHY_REPEATS_DOMINATE = (
    "Training loss is measured on the answers only, so every row pulls the model towards its own answer. A short "
    "answer repeated word for word, say 84 rows of the 6-token \"No valid response from model.\", is cheap to "
    "memorise: its loss drops to near zero within a few steps and every one of those rows pushes the same way, "
    "while thousands of long, varied answers stay hard and pull in different directions. The model learns that "
    "this short answer is always a likely reply, whatever the prompt, so 1.8% of the rows can decide what it "
    "says to every prompt. Removing such rows costs almost nothing; training on them can cost the whole run."
)

# A repeated answer counts as junk when it is shorter than this share of the median distinct answer: an error
# string among SVG files is (29 vs ~250 characters), the same Home Assistant action asked in other words is not.
SHORT_REPEAT_RATIO = 0.5
# With fewer distinct answers than this there is no typical length to compare with (a data set whose every answer is
# one stub has a single distinct answer, its own yardstick): an answer given verbatim to at least DOMINANT_SHARE of
# the rows is then junk whatever its length. Class labels look the same; the message says how to keep them.
MIN_DISTINCT_FOR_MEDIAN = 5
DOMINANT_SHARE = 0.5
# Outside label sets, a repeated answer as long as the others is named only when it takes this share of the rows.
REPEAT_WARN_SHARE = 0.02
# Short answers are named only while they are the exception: above this share of the answers they are the norm.
SHORT_NORM_SHARE = 0.2


def _empty_finding(completions: list[str]) -> Finding | None:
    rows = [i for i, c in enumerate(completions) if not c.strip()]
    if not rows:
        return None
    return Finding("empty", "empty", BLOCKING, "empty completion",
                   f"{_n(len(rows), 'row')} with an empty or whitespace-only completion: they teach the model to "
                   f"answer nothing.", rows, len(rows))


def _answer_groups(completions: list[str]) -> dict[str, list[int]]:
    """{stripped answer: its rows} over the non-empty answers."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, c in enumerate(completions):
        text = c.strip()
        if text:
            groups[text].append(i)
    return groups


def _repeat_findings(completions: list[str], requests: Callable[[int], str], *, repeat_min_rows: int,
                     repeat_share_block: float, groups: dict[str, list[int]] | None = None,
                     label_set: bool = False, yardstick: dict[str, list[int]] | None = None) -> list[Finding]:
    """The junk repeat (a short answer standing out against varied or longer ones) and, outside label sets,
    legitimate-looking answers repeated by a notable share of the rows. A label set's classes are neither: they
    are reported by freetune.audit.labels. yardstick: the answers to measure typical length on (default: all);
    the audit leaves out those other rules name, so the length a stub is judged by does not move once they are
    cleaned."""
    if label_set:
        return []
    total = len(completions)
    groups = _answer_groups(completions) if groups is None else groups
    # The typical answer length over *distinct* answers: junk repeated over most rows still counts once, so it
    # cannot become the yardstick it is measured against.
    yardstick = groups if not yardstick else yardstick
    median_chars = statistics.median(len(text) for text in yardstick) if yardstick else 0
    repeated = [(text, rows) for text, rows in groups.items() if len(rows) >= repeat_min_rows]
    if not repeated:
        return []
    repeated.sort(key=lambda item: (-len(item[1]), item[0]))

    few_distinct = len(groups) < MIN_DISTINCT_FOR_MEDIAN

    def is_junk(text: str, rows: list[int]) -> bool:
        share = len(rows) / total
        return share >= repeat_share_block and (len(text) < SHORT_REPEAT_RATIO * median_chars
                                                or few_distinct and share >= DOMINANT_SHARE)

    def summary(group: list[tuple[str, list[int]]]) -> tuple[list[int], str, dict]:
        """(rows, the example a message names, details) of a group of repeated answers, most repeated first."""
        rows = sorted(i for _, r in group for i in r)
        top_text, top_rows = group[0]
        top = [{"completion": _cut(text), "rows": len(r), "share": _share(len(r), total), "chars": len(text),
                "example_prompts": [_cut(requests(i), 100) for i in r[:3]]} for text, r in group[:TOP_EXAMPLES]]
        return rows, f"{_cut(top_text, 60)!r} x{len(top_rows):,}", {"completions": len(group), "top": top}

    findings = []
    junk = [(t, r) for t, r in repeated if is_junk(t, r)]
    # A legitimate-looking repeat is worth a look only when one answer takes a notable share of the rows; numbers
    # or actions that recur a few times each are what such data looks like.
    other = [(t, r) for t, r in repeated if not is_junk(t, r)
             and (len(r) >= REPEAT_WARN_SHARE * total or len(t) < SHORT_REPEAT_RATIO * median_chars)]
    if junk:
        rows, example, details = summary(junk)
        findings.append(Finding(
            "repeated", "repeated", BLOCKING, "repeated short completion",
            f"{_n(len(junk), 'short completion')} repeated verbatim over {_n(len(rows), 'row')}, e.g. {example}: "
            f"cheap to memorise, they can become the answer to every prompt."
            f"{_few_answers_note(len(groups)) if few_distinct else ''}", rows, len(rows), details))
    if other:
        rows, example, details = summary(other)
        findings.append(Finding(
            "repeated_other", "repeated", WARNING, "repeated completion",
            f"{_n(len(other), 'completion')} each in {repeat_min_rows}+ rows ({_n(len(rows), 'row')}), "
            f"e.g. {example}; as long as typical answers or rare, so kept. Check they are real answers.",
            rows, len(rows), details))
    return findings


def _few_answers_note(distinct: int) -> str:
    if distinct == 1:
        return " Every row has this one answer: there is nothing else to learn. Check the data set and its `columns`."
    return (f" The data set has only {distinct} distinct answers and this one covers most rows: check the data set "
            f"and its `columns`.")


def _short_finding(completions: list[str], min_chars: int, excluded: set[int]) -> Finding | None:
    """Very short answers among longer ones; where short answers are the norm (numbers, labels) they are the data."""
    answered = sum(1 for c in completions if c.strip())
    rows = [i for i, c in enumerate(completions) if 0 < len(c.strip()) < min_chars and i not in excluded]
    if not rows or len(rows) > SHORT_NORM_SHARE * answered:
        return None
    return Finding("short", "short", WARNING, "very short completion",
                   f"{_n(len(rows), 'completion')} under {min_chars} characters, e.g. "
                   f"{_cut(completions[rows[0]].strip(), 40)!r}, where most answers are longer.",
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
