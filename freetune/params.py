"""Check the parameters cell's values against the types it declares (`name: type = value  # help`).

papermill injects new values as plain literals after the parameters cell, and a CLI user can type
`-p max_steps fifty`; catching a wrong type here costs a second instead of a crashed run an hour in.
"""

from __future__ import annotations

import typing
from typing import Any

from freetune.errors import FreetuneError


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


def check(namespace: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """Validate the annotated parameters found in `namespace` (a notebook's globals()); return name -> value.

    Only names annotated in the parameters cell are parameters (IPython records them in __annotations__).
    """
    annotations = dict(namespace.get("__annotations__", {}))
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
    if problems:
        raise FreetuneError("Some parameters have the wrong type:\n" + "\n".join(problems) +
                            "\nChange them in the parameters cell (or the -p values you passed to papermill).")
    return values
