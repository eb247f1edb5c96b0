"""Python's garbage collector kept off what the warm-up steps leave behind (freetune.trainer.GarbageFrozenAfterWarmup
says why: torch.compile's long-lived objects made every full collection a visible pause on a host-bound card).
"""

from __future__ import annotations

from freetune.speed.feature import Feature, always


def _install(trainer, plan):
    from freetune.trainer import GarbageFrozenAfterWarmup  # the trainer module imports transformers: not at import

    frozen = GarbageFrozenAfterWarmup()
    trainer.add_callback(frozen)
    return frozen.unfreeze


FEATURE = Feature("Garbage collector", always, _install)
