"""GcPauses: how long Python's cyclic garbage collector stopped the process, per generation, between start() and
stop(). Standard library only: scripts/bench.py's runs and the peer's (scripts/bench_unsloth.py, whose process sees
no freetune) both record their measured steps with it."""

from __future__ import annotations

import gc
import time


class GcPauses:
    def __init__(self):
        self.pauses: dict[int, list[float]] = {}  # generation -> seconds of each collection
        self._began = 0.0

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.setdefault(info["generation"], []).append(time.perf_counter() - self._began)

    def start(self) -> None:
        gc.callbacks.append(self._note)

    def stop(self) -> None:
        if self._note in gc.callbacks:
            gc.callbacks.remove(self._note)

    def summary(self) -> dict:
        """{"gen N": [collections, total ms, longest ms]} for each generation collected."""
        return {f"gen {g}": [len(p), round(1000 * sum(p), 1), round(1000 * max(p), 1)]
                for g, p in sorted(self.pauses.items())}
