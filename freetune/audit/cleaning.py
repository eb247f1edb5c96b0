"""Cleaning and the policy: drop the flagged rows, stop while blocking problems remain unless the user accepted
them, and the recipe's audit cell (audit, show, clean, audit again, enforce) in one call."""

from __future__ import annotations

from dataclasses import dataclass

from freetune.audit.findings import ACCEPT_PARAMETER, BLOCKING, CLEAN_PARAMETER, Finding, _n
from freetune.audit.report import AuditReport
from freetune.audit.rules import WHY_REPEATS_DOMINATE
from freetune.audit.run import audit
from freetune.errors import FreetuneError


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

    remove = _removed(report, drop)
    keep = [i for i in range(len(dataset)) if i not in remove]
    cleaned = dataset.select(keep) if remove else dataset
    reasons = [{"id": f.id, "title": f.title, "severity": f.severity, "dropped": _selected(f, drop),
                "before": f.count, "after": sum(1 for i in f.rows if i not in remove)}
               for f in report.findings if f.rows]
    return cleaned, CleanSummary(len(dataset), len(keep), reasons)


def _selected(finding: Finding, drop: tuple[str, ...] | None) -> bool:
    return finding.severity == BLOCKING if drop is None else (finding.kind in drop or finding.id in drop)


def _removed(report: AuditReport, drop: tuple[str, ...] | None) -> set[int]:
    """The rows clean(dataset, report, drop) drops."""
    return {i for f in report.findings if _selected(f, drop) for i in f.rows}


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
                                f"above), so nothing is left to train on. {_what_to_change(report)}")
        report = audit(dataset, **audit_kwargs, row_tokens=_kept_counts(report))
        if report.blocking:
            print()
            report.display()
    elif accept_problems and report.finding("malformed") is not None:
        dataset, report, summary = _drop_unreadable(dataset, report, audit_kwargs)
    enforce(report, accept_problems)
    return dataset, report, summary


def _drop_unreadable(dataset, report: AuditReport, audit_kwargs: dict):
    """auto_clean=False with accept_problems=True keeps every row the user accepted, except those no trainer can
    read: kept, the first of them would stop training after the model loaded (TRL's chat template raises on it).
    Dropped, saying so and where to fix them; returns (data set, its report, CleanSummary)."""
    unreadable = report.finding("malformed")
    dataset, summary = clean(dataset, report, drop=("malformed",))
    print(f"\nDropped {_n(unreadable.count, 'row')} that no trainer can read, although {CLEAN_PARAMETER}=False: "
          f"kept, the first of them would stop training after the model loaded. The other accepted problems stay. "
          f"To train on these rows, fix them in the data set, e.g. {unreadable.details['examples'][0]}.")
    summary.display()
    if len(dataset) == 0:
        raise FreetuneError(f"None of the {report.rows:,} rows can be read by a trainer (see the table above), so "
                            f"nothing is left to train on. {_what_to_change(report)}")
    return dataset, audit(dataset, **audit_kwargs, row_tokens=_kept_counts(report, drop=("malformed",))), summary


def _kept_counts(report: AuditReport, drop: tuple[str, ...] | None = None):
    """The report's per-row token counts for the rows clean(dataset, report, drop) keeps: the audit of the cleaned
    rows does not tokenise them again (on 100,000 SVG rows, most of an audit's work)."""
    if report.row_tokens is None:
        return None
    removed = _removed(report, drop)
    return report.row_tokens.subset([i for i in range(report.rows) if i not in removed])


def _what_to_change(report) -> str:
    """The advice when cleaning left no row: where max_length cut off most answers, raise it (the one setting that
    drops good rows wholesale); otherwise the data or its column mapping is the place to look."""
    cut_off = report.finding("no_trainable_tokens")
    if cut_off is not None and 2 * len(cut_off.rows) > report.rows and report.tokens:
        shortest = report.tokens["sequence_tokens"]["min"]
        return (f"max_length = {report.settings['max_length']} cuts off the answers of {len(cut_off.rows):,} rows: "
                f"raise max_length (the shortest row has {shortest:,} tokens).")
    return "Check the data set and its `columns`."
