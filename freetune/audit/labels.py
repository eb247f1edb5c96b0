"""Label sets: a data set whose answers come from a closed set (sentiment positive/negative, yes/no, topic labels,
a rating, the same Home Assistant action asked in other words) repeats each answer on purpose. Such a set is told
apart from a stub by coverage: its repeated answers, each given to at least `repeat_min_rows` rows, cover most of
the rows; a stub is one answer repeated among answers that are otherwise varied.

A label set trains by default. The audit says what it took for the classes and how they balance, and warns only
where a user should look: a class too rare to learn, one class so dominant that always answering it scores
well, and answers outside the classes (a typo of a label, or junk)."""

from __future__ import annotations

from freetune.audit.findings import WARNING, Finding, _cut, _n

LABEL_COVERAGE = 0.8      # share of answered rows whose answer is one of the repeated answers
MINORITY_SHARE = 0.03     # a class under this share (and under a quarter of an even share) is too rare to learn
DOMINANT_CLASS = 0.9      # one class over this share: a model answering it always is right this often
OFF_LABEL_SHARE = 0.05   # answers outside the classes are named when they are this rare (a slip among labels)
SHOWN_CLASSES = 6


def label_classes(groups: dict[str, list[int]], answered: int, min_rows: int) -> dict[str, list[int]] | None:
    """{answer: rows} of the classes when the answers form a label set, else None."""
    classes = {text: rows for text, rows in groups.items() if len(rows) >= min_rows}
    covered = sum(len(rows) for rows in classes.values())
    if len(classes) < 2 or covered < LABEL_COVERAGE * answered:
        return None
    return dict(sorted(classes.items(), key=lambda item: (-len(item[1]), item[0])))


def balance_line(classes: dict[str, list[int]], answered: int) -> str:
    """"label set: 2 classes, 'positive' 52% (206), 'negative' 48% (194)": what the audit took the answers for."""
    shown = [f"{_cut(text, 30)!r} {100 * len(rows) / answered:.0f}% ({len(rows):,})"
             for text, rows in list(classes.items())[:SHOWN_CLASSES]]
    more = len(classes) - SHOWN_CLASSES
    covered = 100 * sum(map(len, classes.values())) / answered
    return (f"Label set: {len(classes)} classes cover {covered:.0f}% of the answers, kept as classes (not junk "
            f"repeats): " + ", ".join(shown) + (f", {more} more" if more > 0 else ""))


def balance_findings(classes: dict[str, list[int]], groups: dict[str, list[int]], answered: int,
                     completions: list[str]) -> list[Finding]:
    """groups: {answer: rows} without the rows other findings already explain (a refusal, an error string)."""
    findings = []
    even = 1 / len(classes)
    rare = {t: r for t, r in classes.items() if len(r) < min(MINORITY_SHARE, even / 4) * answered}
    top_text, top_rows = next(iter(classes.items()))
    if rare:
        rows = sorted(i for r in rare.values() for i in r)
        names = ", ".join(f"{_cut(t, 30)!r} {100 * len(r) / answered:.1f}%" for t, r in list(rare.items())[:5])
        findings.append(Finding(
            "rare_class", "class_balance", WARNING, "rare class",
            f"{len(rare)} {'class' if len(rare) == 1 else 'classes'} with few rows ({names}): too few to learn, or "
            f"junk that repeats. Check them; add rows of that class, or drop them.", rows, len(rows),
            {"classes": {t: len(r) for t, r in rare.items()}}))
    if len(top_rows) > DOMINANT_CLASS * answered:
        findings.append(Finding(
            "dominant_class", "class_balance", WARNING, "one class dominates",
            f"{_cut(top_text, 30)!r} is the answer of {100 * len(top_rows) / answered:.0f}% of the rows: a model "
            f"that always answers it is right that often, so training loss and eval scores can look good while it "
            f"learns nothing. Balance the classes if you can.", [], len(top_rows)))
    outside = sorted(i for t, r in groups.items() if t not in classes for i in r)
    if outside and len(outside) <= OFF_LABEL_SHARE * answered:
        examples = [_cut(completions[i], 60) for i in outside[:3]]
        findings.append(Finding(
            "off_label", "off_label", WARNING, "answer outside the classes",
            f"{_n(len(outside), 'row')} answering outside the {len(classes)} classes, e.g. {examples[0]!r}: a "
            f"misspelt label, or junk. Kept; check them.", outside, len(outside), {"examples": examples}))
    return findings
