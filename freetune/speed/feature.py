"""The shape of a speed feature, as training installs it (freetune.train._speed_up, in freetune.speed.FEATURES' order).

A feature is one object with
- name: the word the lines printed about it start with ("LoRA kernel", "CUDA graphs");
- applies(plan, trainer) -> (bool, why): whether it applies to this plan, model and run. A feature that does not
  apply says why when the reason is news to the user ("CUDA graphs: off (more than one process)."); an empty why
  means there is nothing to tell (the plan did not choose it, and the plan's report already said why);
- install(trainer, plan) -> undo or None: puts it in place, printing what it did, before training starts; `undo`
  (no arguments) takes it out again after training, also after an error (the model may go on to generate or export).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Feature:
    name: str
    applies: Callable  # (plan, trainer) -> (bool, why)
    install: Callable  # (trainer, plan) -> undo callable or None


def always(plan, trainer) -> tuple[bool, str]:
    """applies() of a feature every run takes (its install decides, from the plan, how much it does)."""
    return True, ""


def off_line(feature: Feature, why: str) -> str | None:
    """What is printed when `feature` steps aside, or None when there is nothing to tell."""
    return f"{feature.name}: off ({why})." if why else None
