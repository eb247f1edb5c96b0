"""The loss head's tiles and the CUDA cache between micro-batches: two settings of TRL's that every run takes from the
plan (freetune.reach.trl says what each reaches into and why).
"""

from __future__ import annotations

from freetune.reach import trl as trl_reach
from freetune.speed.feature import Feature, always


def _install(trainer, plan) -> None:
    trl_reach.set_loss_tile_tokens(plan.kernels.loss_tile_tokens)  # 0: TRL's own tiles
    trl_reach.keep_cuda_cache_between_steps(trainer)


FEATURE = Feature("Loss head", always, _install)
