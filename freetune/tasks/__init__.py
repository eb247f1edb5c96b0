"""Task-specific checks, one module per recipe task: `freetune.tasks.svg`, `freetune.tasks.home_assistant`.

Each task module offers the same three things, so the audit and the sanity check treat them alike:
- `AUDIT_CHECKS`: {name: check(row) -> None when the training row is fine, else a short reason};
- `metrics(output, row)`: {name: bool | number} for one generated output, judged against its row's context;
- `summarise(list of metrics dicts)`: {name: rate or mean} over many outputs;
- `ADHERENCE`: the metric that says the output did what the prompt asked (judged against the row's reference),
  and `ADHERENCE_MEANS`, what that is in words; the sanity verdict is "ok" only when most outputs do;
- `signature(output)`: what the output says in the task's terms (a picture's size, colours and shapes; an
  action), hashable, None when it says nothing; fewer distinct signatures than the references have across
  varied prompts means the model ignores the prompt.
Tasks without a module (task=None) are judged on the text: `reference_metrics` (exact match, similarity).
"""

from __future__ import annotations

import importlib
import pkgutil
from difflib import SequenceMatcher
from pathlib import Path
from types import ModuleType

# Every module in this folder is a task: adding one is adding its file.
TASK_NAMES = tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.ispkg))


def load_task(task: str | ModuleType | None) -> ModuleType | None:
    """The task module for a name ("svg", "home_assistant"); a module passes through; None means no task."""
    from freetune.errors import FreetuneError

    if task is None or task == "" or isinstance(task, ModuleType):  # "": the parameters cell's "no task"
        return task or None
    if task not in TASK_NAMES:
        raise FreetuneError(f"Unknown task {task!r}: freetune has task metrics for {', '.join(TASK_NAMES)}. "
                            f'Set `task` to one of them, or to "" to skip task metrics.')
    return importlib.import_module(f"freetune.tasks.{task}")


def audit_checks(task: str | None) -> dict | None:
    """The task's row checks for the data audit (its AUDIT_CHECKS); None for no task (text checks only)."""
    module = load_task(task or None)
    return module.AUDIT_CHECKS if module is not None else None


def summarise_metrics(results: list[dict]) -> dict[str, float | None]:
    """Booleans become the share of outputs where they hold; numbers become their mean per output.

    A metric an output lacks or holds as None (no reference to compare with, no renderer) is left out of that
    metric's share rather than counted as a failure; a metric no output could measure is None.
    """
    if not results:
        return {"outputs": 0}
    summary: dict[str, float | None] = {"outputs": len(results)}
    for name in dict.fromkeys(name for r in results for name in r):
        values = [float(r[name]) for r in results if r.get(name) is not None]
        summary[name] = sum(values) / len(values) if values else None
    return summary


def normalise_answer(text: str) -> str:
    """Case and whitespace do not make two answers different."""
    return " ".join(text.split()).casefold()


def reference_metrics(output: str, reference: str | None) -> dict[str, bool | float]:
    """Any task, against the reference answer: exact_match (after normalise_answer) and similarity (difflib's
    ratio of matching characters, 1.0 = the same text). Empty without a reference."""
    if reference is None:
        return {}
    ours, theirs = normalise_answer(output), normalise_answer(reference)
    return {"exact_match": ours == theirs, "similarity": SequenceMatcher(None, ours, theirs, autojunk=False).ratio()}


def __getattr__(name: str):
    # `freetune.tasks.svg.AUDIT_CHECKS` in a recipe works after a plain `import freetune`.
    if name in TASK_NAMES:
        return importlib.import_module(f"freetune.tasks.{name}")
    raise AttributeError(f"module 'freetune.tasks' has no attribute {name!r}")
