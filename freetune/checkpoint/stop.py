"""Stopping early: a time budget (default: the platform's session limit minus a margin) and SIGTERM both stop at the
end of a step and save a complete checkpoint; under DDP the ranks agree on the step through one tiny all_reduce per
step, or one rank would wait forever for the others at the save.
"""

from __future__ import annotations

import signal
import threading
import time
from contextlib import contextmanager

from freetune.distributed import print0
from freetune import params
from freetune.platform import PLATFORMS

# The platform limit minus this: time for the final save, the evaluation and the export after training.
BUDGET_MARGIN_MIN = 60


def time_budget(minutes: float, platform: str) -> tuple[float | None, str]:
    """(seconds or None, why): minutes > 0 is the user's budget; 0 is the platform's limit minus a margin."""
    params.require(time_budget_min=minutes)
    if minutes > 0:
        return minutes * 60, f"{minutes:g} min (time_budget_min)"
    limit_h = PLATFORMS[platform].time_limit_h if platform in PLATFORMS else None
    if not limit_h:
        return None, "none (no session limit here; set time_budget_min to have one)"
    budget_min = max(limit_h * 60 - BUDGET_MARGIN_MIN, 1)
    return budget_min * 60, (f"{budget_min:g} min ({platform}'s {limit_h:g} h session limit minus {BUDGET_MARGIN_MIN} "
                             f"min for the final save, evaluation and export)")


def stop_callback(budget_s: float | None, budget_text: str):
    """A TrainerCallback that stops at a step end, saving a complete checkpoint, when the budget runs out or a
    SIGTERM arrived. `.reason` says why it stopped (None: it did not)."""
    from transformers import TrainerCallback

    class StopAndSave(TrainerCallback):
        SIGTERM, BUDGET = 2, 1  # the all_reduce keeps the larger: a SIGTERM anywhere wins

        def __init__(self):
            self.reason: str | None = None
            self.sigterm = False
            self.started = self.first_step = None
            self.agreement = StopAgreement()

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.first_step = time.monotonic(), state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            flag = 0
            if self.sigterm:
                flag = self.SIGTERM
            elif budget_s is not None:
                elapsed = time.monotonic() - self.started
                per_step = elapsed / max(state.global_step - self.first_step, 1)
                # The stop comes `lag` steps after the flag is raised (the ranks learn it a step later), so the
                # check looks that much further ahead: the last step still ends inside the budget.
                if elapsed + (1 + self.agreement.lag) * per_step >= budget_s:
                    flag = self.BUDGET
            flag = self.agreement.exchange(flag, args.device)
            if flag and state.global_step < state.max_steps:
                self.reason = "SIGTERM received" if flag == self.SIGTERM else f"time budget of {budget_text} reached"
                control.should_save = True
                control.should_training_stop = True
                print0(f"Stopping at step {state.global_step} of {state.max_steps}: {self.reason}. Saving a "
                       f"checkpoint; run this again with the same run_name to continue.")
            return control

    return StopAndSave()


class StopAgreement:
    """Every rank's stop flag, agreed on without making the host wait for the GPU.

    Under DDP all ranks must stop at the same step, so each step end takes the largest flag over the ranks. Read
    at once (an all_reduce, then .item()), that is a host sync at every step: the CPU waits for everything queued
    on the GPU, including the other rank's gradients, and the two ranks then run in lock step, each waiting for
    the slower one's host at every step. Here the step's all_reduce and its copy to pinned host memory are only
    queued, and read at the next step end, by which time they have long finished: every rank stops one step
    after a flag is raised, all at the same step. One process: the flag itself, at once (`lag` 0)."""

    def __init__(self):
        self.pending = None  # (the wait for the last exchange, the tensor its agreed flag lands in)
        self.host = self.done = None  # CUDA: one pinned host slot and one event, reused at every step

    @property
    def lag(self) -> int:
        import torch.distributed as dist

        return 1 if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else 0

    def exchange(self, flag: int, device) -> int:
        """Queue this step's flag; return the flag agreed at the previous step (0 at the first)."""
        import torch
        import torch.distributed as dist

        if not self.lag:
            return flag
        agreed = self.collect()  # also frees the host slot for this step's copy
        # torch.full, not torch.tensor([flag], device=...): a copy from host memory would wait for the GPU too.
        tensor = torch.full((1,), flag, dtype=torch.int32, device=device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        if tensor.is_cuda:
            if self.host is None:
                self.host, self.done = torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
            work.wait()  # NCCL: the current stream waits for the all_reduce; the host goes on
            self.host.copy_(tensor, non_blocking=True)
            self.done.record()
            # Waited for at the next step end, long reached by then: the GPU has run a whole step since.
            self.pending = (self.done.synchronize, self.host)
        else:  # gloo: the host runs the collective itself (Work.wait; its synchronize() does not wait for it)
            self.pending = (work.wait, tensor)
        return agreed

    def collect(self) -> int:
        """The flag agreed at the last exchange (0 if none is pending)."""
        if self.pending is None:
            return 0
        wait, tensor = self.pending
        self.pending = None
        wait()
        return int(tensor.item())


@contextmanager
def sigterm_stops(callback):
    """While training, SIGTERM asks `callback` to stop and save at the end of the step (a second one acts as
    before). Signal handlers can only be set from the main thread; elsewhere SIGTERM keeps its usual meaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def request_stop(signum, frame):
        callback.sigterm = True
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


