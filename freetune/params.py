"""Check the parameters cell before anything loads: each value's declared type (`name: type = value  # help`), its
range or choices (RULES, one table for every recipe's parameters), and names papermill was given that the cell
does not have.

papermill injects new values as plain literals after the parameters cell, and a CLI user can type
`-p max_steps fifty`, `-p max_steps -5` or `-p lora_r 8`; catching it here costs a second instead of a model
download and a crashed (or silently wrong) run an hour in. Every problem is listed at once, each naming the
parameter and what to change.
"""

from __future__ import annotations

import ast
import difflib
import re
import typing
from typing import Any, Callable

from freetune.errors import FreetuneError

# papermill's injected-parameters cell starts with this comment (papermill.translators, `comment='Parameters'`).
INJECTED_CELL_COMMENT = "# Parameters"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # a Hub repo id: user-or-org/name
_COLUMN_KEYS = ("messages", "prompt", "completion")

Rule = Callable[[Any], "str | None"]  # None when the value is fine, else what is wrong and what to put instead


def _num(x: float) -> str:
    return f"{x:g}" if abs(x) < 1e6 else f"{int(x):,}"


def at_least(low: float, why: str) -> Rule:
    return lambda value: None if value >= low else f"must be {_num(low)} or more ({why})"


def between(low: float, high: float, why: str, *, low_included: bool = True) -> Rule:
    """low <= value < high (low < value < high when low is not included)."""
    def rule(value):
        if (low <= value if low_included else low < value) and value < high:
            return None
        span = (f"from {_num(low)} to below {_num(high)}" if low_included
                else f"above {_num(low)} and below {_num(high)}")
        return f"must be {span} ({why})"
    return rule


def one_of(*choices: str) -> Rule:
    return lambda value: None if value in choices else f"must be one of {', '.join(map(repr, choices))}"


def _not_empty(why: str) -> Rule:
    return lambda value: None if str(value).strip() else f"must not be empty ({why})"


def _hub_repo_or_empty(value: str) -> str | None:
    if value == "" or HUB_ID.fullmatch(value):
        return None
    return "must be '' (off) or a Hub repo id 'your-name/repo-name'"


def _run_name(value: str) -> str | None:
    if not value.strip() or "/" in value or "\\" in value or value in (".", ".."):
        return "must be a plain folder name such as 'svg-coder' (no slashes; output_dir picks the parent folder)"
    return None


def _columns(value: dict) -> str | None:
    unknown = sorted(set(map(str, value)) - set(_COLUMN_KEYS))
    if unknown:
        return (f"has key(s) {unknown}; its keys are freetune's names {list(_COLUMN_KEYS)}, its values your data "
                f"set's columns, e.g. {{'prompt': 'question', 'completion': 'answer'}}")
    bad = [k for k, v in value.items() if not (isinstance(v, str) or isinstance(v, list) and v
                                                and all(isinstance(c, str) for c in v))]
    return f"maps {bad} to something other than a column name or a list of them" if bad else None


def _task(value: str) -> str | None:
    from freetune.tasks import TASK_NAMES

    if value == "" or value in TASK_NAMES:
        return None
    return f"must be '' (text checks only) or one of {', '.join(map(repr, TASK_NAMES))}"


def _optimizer(value: str) -> str | None:
    from transformers.training_args import OptimizerNames

    names = [o.value for o in OptimizerNames]
    if value == "auto" or value in names:
        return None
    close = difflib.get_close_matches(value, names, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"is not a Trainer optimizer: {hint}use 'auto', 'adamw_torch_fused' or 'paged_adamw_8bit'"


# The recipes' parameters and what each may hold beyond its type. A name missing here is checked for its type only.
RULES: dict[str, Rule] = {
    "model_id": _not_empty("a hub id such as 'Qwen/Qwen2.5-Coder-1.5B-Instruct', or a local model folder"),
    "dataset": _not_empty("a hub id, or a local .jsonl/.json/.csv/.parquet file or folder"),
    "dataset_split": _not_empty("the split to read, usually 'train'"),
    "columns": _columns,
    "task": _task,
    "eval_rows": at_least(1, "the evaluation at the end generates from held-out rows; 16 is plenty"),
    "max_steps": at_least(1, "the optimizer steps to train, e.g. 300; the Trainer reads -1 as a whole epoch"),
    "micro_batch": at_least(0, "rows per forward pass; 0 lets the preflight pick the largest that fits"),
    "grad_accum": at_least(1, "micro-batches per optimizer step; 1 means no accumulation"),
    "learning_rate": between(0, 1, "LoRA trains well at 1e-5 to 1e-3; 2e-4 is the usual start",
                             low_included=False),
    "max_length": at_least(16, "tokens per row; a chat template alone takes a dozen"),
    "lora_rank": at_least(1, "the adapter's rank, e.g. 8 or 16; higher learns more"),
    "lora_alpha": at_least(1, "the adapter's scale, usually 2 x lora_rank"),
    "lora_dropout": between(0, 1, "the share of adapter inputs dropped; 0.05 for small data sets, 0 for large"),
    "lora_targets": _not_empty("'all-linear', or a regular expression of module names such as '.*(q_proj|v_proj)'"),
    "optimizer": _optimizer,
    "max_grad_norm": at_least(0, "gradient clipping; 0 turns it off"),
    "gradient_checkpointing": one_of("auto", "on", "off"),
    "precision": one_of("auto", "fp16", "bf16"),
    "torch_compile": one_of("auto", "on", "off"),
    "gpu_memory_cap_gib": at_least(0, "0 means no cap"),
    "save_steps": at_least(1, "checkpoint every N steps, e.g. 50, so a lost session resumes"),
    "time_budget_min": at_least(0, "minutes training may run; 0 means the platform's session limit minus an hour"),
    "hub_checkpoint_repo": _hub_repo_or_empty,
    "logging_steps": at_least(1, "print progress every N steps"),
    "run_name": _run_name,
    "ddp_processes": at_least(0, "0 means one process per visible GPU"),
    "sanity_rows": at_least(1, "held-out prompts the evaluation generates from"),
    "max_new_tokens": at_least(1, "tokens generated per prompt in the evaluation"),
    "hub_repo": _hub_repo_or_empty,
    "seed": between(0, 2**32, "numpy and torch take seeds from 0 to 2**32 - 1"),
}


def problems_with(values: dict[str, Any]) -> list[str]:
    """One line per value that breaks its RULES entry: `name = value: what is wrong (what to put instead)`."""
    problems = []
    for name, value in values.items():
        rule = RULES.get(name)
        problem = rule(value) if rule is not None else None
        if problem:
            problems.append(f"  {name} = {value!r}: {problem}")
    return problems


def require(**values: Any) -> None:
    """Raise FreetuneError listing every value that breaks its rule (for library callers, e.g. make_config)."""
    problems = problems_with(values)
    if problems:
        raise FreetuneError("Some settings are out of range:\n" + "\n".join(problems))


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if annotation is Any:
        return True
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin in (list, dict, tuple):
        return isinstance(value, origin)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def injected_names(namespace: dict[str, Any]) -> list[str]:
    """The names papermill assigned in its injected-parameters cell, read from IPython's input history (`In`).

    A name the parameters cell does not declare would otherwise be assigned and never read: `-p lora_r 8` trains
    at the default rank and says nothing."""
    names = []
    for source in namespace.get("In") or []:
        if isinstance(source, str) and source.lstrip().startswith(INJECTED_CELL_COMMENT):
            try:
                tree = ast.parse(source)
            except SyntaxError:
                continue
            names += [t.id for node in tree.body if isinstance(node, ast.Assign)
                      for t in node.targets if isinstance(t, ast.Name)]
    return names


def _unknown(names: list[str], declared: list[str]) -> list[str]:
    lines = []
    for name in dict.fromkeys(n for n in names if n not in declared):
        close = difflib.get_close_matches(name, declared, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"the parameters are: {', '.join(declared)}"
        lines.append(f"  {name}: not a parameter of this notebook ({hint})")
    return lines


def check(namespace: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """Validate the annotated parameters found in `namespace` (a notebook's globals()); return name -> value.

    Only names annotated in the parameters cell are parameters (IPython records them in __annotations__). Checked:
    each value's type, then its RULES entry, then that every name papermill injected is one of them.
    """
    annotations = dict(namespace.get("__annotations__", {}))
    declared = list(annotations)
    if names is not None:
        annotations = {n: annotations[n] for n in names if n in annotations}
    problems = []
    values = {}
    for name, annotation in annotations.items():
        if isinstance(annotation, str):  # `from __future__ import annotations` or a quoted type
            annotation = eval(annotation, {"typing": typing}, {})  # noqa: S307 - the recipe's own literal types
        value = namespace.get(name)
        if not _matches(value, annotation):
            shown = getattr(annotation, "__name__", str(annotation))
            problems.append(f"  {name} = {value!r} ({type(value).__name__}), but it must be {shown}")
        else:
            values[name] = float(value) if annotation is float else value
    problems += problems_with(values)
    problems += _unknown(injected_names(namespace), declared)
    if problems:
        raise FreetuneError("Some parameters need changing before anything is loaded:\n" + "\n".join(problems) +
                            "\nChange them in the parameters cell (or the -p values you passed to papermill).")
    return values
