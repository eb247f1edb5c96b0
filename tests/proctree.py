"""Process-tree helpers for the tests that kill torchrun jobs: a launcher's ranks are its children (and theirs),
and a test that kills "the whole job" must reach every one of them, not only the launcher."""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(root: int) -> set[int]:
    """root and every process descended from it, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree


def send_signal(pid: int, sig: int) -> None:
    """os.kill that ignores a process which has already exited."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
