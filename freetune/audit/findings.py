"""What the audit reports: a Finding (which rows, how bad, what it means), and the few words and figures every
rule writes its message with."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable


# The recipe parameters the messages name, so a user knows exactly what to change.
ACCEPT_PARAMETER = "accept_data_problems"
CLEAN_PARAMETER = "auto_clean"

BLOCKING, WARNING = "blocking", "warning"
TOP_EXAMPLES = 5          # repeats, conflicts and check reasons listed in a finding's details
EXAMPLE_CHARS = 120       # examples are cut to this length in reports

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


def _nearest_rank(sorted_values: list[int], q: float) -> int:
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]
