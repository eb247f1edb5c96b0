"""Task-specific checks, one module per recipe task: `freetune.tasks.svg`, `freetune.tasks.home_assistant`.

Each task module offers the same three things, so the audit and the sanity check treat them alike:
- `AUDIT_CHECKS`: {name: check(row) -> None when the training row is fine, else a short reason};
- `metrics(output, row)`: {name: bool | number} for one generated output, judged against its row's context;
- `summarise(list of metrics dicts)`: {name: rate or mean} over many outputs.
"""

from __future__ import annotations

import importlib
from types import ModuleType

TASK_NAMES = ("svg", "home_assistant")


def load_task(task: str | ModuleType | None) -> ModuleType | None:
    """The task module for a name ("svg", "home_assistant"); a module passes through; None means no task."""
    from freetune.errors import FreetuneError

    if task is None or isinstance(task, ModuleType):
        return task
    if task not in TASK_NAMES:
        raise FreetuneError(f"Unknown task {task!r}: freetune has task metrics for {', '.join(TASK_NAMES)}. "
                            f"Set `task` to one of them, or to None to skip task metrics.")
    return importlib.import_module(f"freetune.tasks.{task}")


def summarise_metrics(results: list[dict]) -> dict[str, float]:
    """Booleans become the share of outputs where they hold; numbers become their mean per output."""
    if not results:
        return {"outputs": 0}
    summary: dict[str, float] = {"outputs": len(results)}
    for name in results[0]:
        values = [float(r[name]) for r in results]
        summary[name] = sum(values) / len(values)
    return summary


def __getattr__(name: str):
    # `freetune.tasks.svg.AUDIT_CHECKS` in a recipe works after a plain `import freetune`.
    if name in TASK_NAMES:
        return importlib.import_module(f"freetune.tasks.{name}")
    raise AttributeError(f"module 'freetune.tasks' has no attribute {name!r}")
