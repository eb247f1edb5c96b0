"""The audit's report: AuditReport, whose JSON is stable, and its table as plain text (a terminal, a torchrun log)
or HTML (a notebook)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass, field

from freetune.audit.findings import BLOCKING, CLEAN_PARAMETER, WARNING, Finding, _n


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
    labels: dict | None = None                    # a label set's classes ({"line", "classes": {answer: rows}})
    row_tokens: object = field(default=None, compare=False)  # tokens.RowTokens: reused for a cleaned subset

    @property
    def longest_row(self) -> int | None:
        """Tokens of the longest row (before any cleaning), None when no tokenizer counted them: what the memory
        plan is sized for (freetune.plan.replan)."""
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
            "labels": self.labels["classes"] if self.labels else None,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def _lines(self, dropping: bool = False) -> tuple[str, list[tuple[str, str, str, str, str]], list[str]]:
        header = f"Data audit: {self.rows:,} rows ({self.shape})"
        table = [(_status(f, dropping), f.title, f"{f.count:,}" if f.rows or f.count else "-",
                  f"{100 * f.count / self.rows:.2f}%" if (f.rows or f.count) and self.rows else "",
                  f.message) for f in self.findings]
        notes = [self.labels["line"]] if self.labels else []
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
