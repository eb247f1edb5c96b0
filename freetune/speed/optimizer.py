"""bitsandbytes' 8-bit AdamW with a launch per 16 MiB of LoRA weights, not a launch and a host sync per weight.

Why: bitsandbytes 0.50's 8-bit AdamW updates each parameter with a kernel launch of its own, its own Python, and a
torch.cuda.synchronize() after each. A LoRA model has hundreds of small weights (TinyLlama, every linear layer: 308):
every step, the host waits for the GPU 308 times and the GPU waits for the host's Python in between, 20-35 ms a step
where the step is bound by the host (docs/performance.md, issue 49). The update is element-wise within blocks of 256
values, each block with its own absmax scale for the 8-bit moments, so the same update over one tensor that holds the
weights back to back, each starting on a block boundary, computes the same numbers (tests/test_optimizer.py compares
them bit for bit with bitsandbytes' own step).

How (one_launch, called by FreetuneTrainer.create_optimizer on the optimizer the Trainer made):
- Each parameter group's weights that bitsandbytes would give 8-bit state in ordinary GPU memory (at least
  min_8bit_size values, below the paged optimizers' paging size, no per-parameter override) are moved, per device and
  dtype, into one flat tensor: each weight's .data becomes a view of its segment. Segments start on block boundaries;
  the padding between them gets zero gradients and nothing reads it (its 8-bit moments dequantise below its block's
  largest value, so they never set a block's scale). The weights are the same Parameter objects, so the model, the
  gradient scaler and the clipping see nothing new; only their storage is shared.
- A step concatenates the weights' gradients (with the padding) and runs one update over the flat tensor and its state,
  in chunks of whole weights of at most GRADIENT_CHUNK_VALUES values: the concatenated gradients are the step's own
  memory, and one copy of an 8B model's (43.6 M LoRA values, 166 MiB) raised the run's peak by 80 MiB. Weights outside a
  flat tensor take bitsandbytes' own update. Paged state (paged_adamw_8bit's, for weights of at least 100,000 values) is
  copied asynchronously: one synchronisation at the end of the step, not one per weight.
- A step where some weight of a flat tensor has no gradient updates each of its weights on its own slice of the
  state, as bitsandbytes would (the one without is skipped and keeps its step count); the joint update resumes once
  every weight's count is the same again.
- state_dict() gives each weight its own state (views of its slices) in bitsandbytes' format, so a checkpoint loads
  into either optimizer; load_state_dict() packs each weight's state back into the flat tensors.
- Weights whose storage was replaced after the move (their .data set again: accelerate moves the model to "cpu:0"
  under DDP on CPUs after the Trainer made the optimizer) are moved into a new flat tensor at the next step, their
  state with them; weights moved to different devices or dtypes stop the step with an error that says so.

Where it steps aside: any optimizer but bitsandbytes' 8-bit Adam/AdamW is left as it is; one with an update norm per
whole tensor (max_unorm) too, with a line that says so; FSDP and DeepSpeed, which hold the parameters in flat tensors
of their own, are never handed to it (FreetuneTrainer.create_optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetune.distributed import print0
from freetune.errors import FreetuneError
from freetune.reach import peft_bnb

# 16 MiB of fp32 gradients concatenated at a time, small beside the backward's peak (activations, the loss head, the
# LoRA weights' 16-bit copies). All at once they were not: on Qwen3-8B's shape at the T4 cap they set the run's peak,
# +80 MiB (docs/performance.md). A few launches a step (TinyLlama 4, Qwen3-8B 11), none of them waiting for the GPU.
GRADIENT_CHUNK_VALUES = 4 * 2**20


@dataclass
class FlatWeights:
    """One parameter group's weights of one device and dtype, held back to back in `tensor`."""

    gindex: int                     # the parameter group
    weights: list                   # the Parameters, in the group's order
    offsets: list                   # where each starts in `tensor` (a multiple of OPTIMIZER_BLOCK)
    tensor: object                  # the flat tensor (set by _place); each weight's .data is a view of it
    pointers: list                  # each weight's data_ptr() when moved (a change means its storage was replaced)
    steps: list                     # each weight's update count (bitsandbytes' per-parameter "step")
    padding: dict = field(default_factory=dict)  # {index of the weight before it: zeros} between segments
    chunks: list = field(default_factory=list)   # [(first, end)]: weights updated together (GRADIENT_CHUNK_VALUES)
    state: dict | None = None       # bitsandbytes' state for `tensor`, made at the first update

    def slices(self, i: int) -> tuple[slice, slice]:
        """Weight i's values and its absmax blocks in the flat tensor and state."""
        n = self.weights[i].numel()
        first = self.offsets[i] // peft_bnb.OPTIMIZER_BLOCK
        return slice(self.offsets[i], self.offsets[i] + n), slice(first, first + -(-n // peft_bnb.OPTIMIZER_BLOCK))

    def chunk(self, first: int, end: int) -> tuple[slice, slice]:
        """Weights first..end-1's values, with their padding, and their absmax blocks in the flat tensor and state."""
        stop = self.offsets[end] if end < len(self.weights) else self.offsets[-1] + _padded(self.weights[-1].numel())
        block = peft_bnb.OPTIMIZER_BLOCK
        return slice(self.offsets[first], stop), slice(self.offsets[first] // block, stop // block)

    def state_of(self, values: slice, blocks: slice) -> dict:
        """bitsandbytes' state for the flat tensor's `values` (1-D views of the flat state)."""
        state = {key: value for key, value in self.state.items() if key.startswith("qmap")}
        state.update({key: self.state[key][values] for key in ("state1", "state2")})
        state.update({key: self.state[key][blocks] for key in ("absmax1", "absmax2")})
        return state


def _padded(n: int) -> int:
    return -(-n // peft_bnb.OPTIMIZER_BLOCK) * peft_bnb.OPTIMIZER_BLOCK


def flatten(optimizer) -> list[FlatWeights]:
    """Move each group's 8-bit-state weights into flat tensors (see the module's docstring); returns them."""
    import torch

    min_size, paged_size = peft_bnb.adam_8bit_sizes(optimizer)
    overridden = peft_bnb.adam_8bit_overridden(optimizer)
    flats = []
    for gindex, group in enumerate(optimizer.param_groups):
        kinds: dict = {}
        for weight in group["params"]:
            if min_size <= weight.numel() < paged_size and id(weight) not in overridden and weight.is_contiguous() and (
                    weight.dtype in (torch.float32, torch.float16, torch.bfloat16)):
                kinds.setdefault((weight.device, weight.dtype), []).append(weight)
        for (device, dtype), weights in kinds.items():
            if len(weights) < 2:  # one weight: it is its own flat tensor already
                continue
            offsets = [0]
            for weight in weights[:-1]:
                offsets.append(offsets[-1] + _padded(weight.numel()))
            padding = {i: torch.zeros(_padded(w.numel()) - w.numel(), dtype=dtype, device=device)
                       for i, w in enumerate(weights) if w.numel() % peft_bnb.OPTIMIZER_BLOCK}
            flat = FlatWeights(gindex, weights, offsets, None, [], [0] * len(weights), padding,
                               _chunks(offsets, [_padded(w.numel()) for w in weights]))
            _place(flat, device, dtype)
            flats.append(flat)
    return flats


def _chunks(offsets: list, sizes: list) -> list:
    """[(first, end)] runs of consecutive weights of at most GRADIENT_CHUNK_VALUES values (a larger weight alone)."""
    chunks, first = [], 0
    for i in range(1, len(sizes)):
        if offsets[i] + sizes[i] - offsets[first] > GRADIENT_CHUNK_VALUES:
            chunks.append((first, i))
            first = i
    return chunks + [(first, len(sizes))]


def _place(flat: FlatWeights, device, dtype) -> None:
    """Copy the weights' current values into a new flat tensor on `device` and make each weight a view of it."""
    import torch

    tensor = torch.zeros(flat.offsets[-1] + _padded(flat.weights[-1].numel()), dtype=dtype, device=device)
    with torch.no_grad():
        for weight, offset in zip(flat.weights, flat.offsets):
            view = tensor[offset:offset + weight.numel()].view_as(weight)
            view.copy_(weight)
            weight.data = view
    flat.tensor, flat.pointers = tensor, [w.data_ptr() for w in flat.weights]
    flat.padding = {i: zeros.to(device=device, dtype=dtype) for i, zeros in flat.padding.items()}


def rehome(flat: FlatWeights) -> None:
    """The weights' storage was replaced after they were moved (accelerate's model.to(device) under DDP on CPUs copies
    every parameter to "cpu:0"; a user's model.to()): their current values go into a new flat tensor where they now
    are, and the state follows them. Weights that no longer share one device and dtype cannot share a flat tensor."""
    kinds = {(w.device, w.dtype) for w in flat.weights}
    if len(kinds) != 1:
        raise FreetuneError(f"The LoRA weights the one-launch 8-bit AdamW (freetune.speed.optimizer) updates together "
                            f"were moved to different devices or dtypes after the optimizer was made "
                            f"({sorted(str(k) for k in kinds)}); make the optimizer after the model is in place.")
    (device, dtype), = kinds
    _place(flat, device, dtype)
    if flat.state is not None:
        flat.state = {key: value.to(device) for key, value in flat.state.items()}


class OneLaunchSteps:
    """The step, state_dict and load_state_dict of a bitsandbytes 8-bit Adam whose weights one_launch moved into flat
    tensors (mixed in before the optimizer's own class)."""

    freetune_flats: list = ()

    def step(self, closure=None):
        import torch

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The range torch.optim marks around a step (its wrapper is put on the class the optimizer was made as): a
        # profile (scripts/step_breakdown.py) puts the gradients' concatenation in the optimizer's phase.
        with torch.no_grad(), torch.profiler.record_function(f"Optimizer.step#{type(self).__name__}.step"):
            peft_bnb.adam_8bit_first_step(self)
            for flat in self.freetune_flats:
                self.freetune_flat_step(flat)
            others = self.freetune_others()
            peft_bnb.adam_8bit_step_others(self, others)
            if self.is_paged and any(w.is_cuda for _, _, w in others):
                torch.cuda.synchronize()  # the paged state's copies are asynchronous
        return loss

    def freetune_others(self) -> list:
        """[(group index, index in group, weight)] of the weights outside the flat tensors, found again only when the
        groups' sizes change (add_param_group)."""
        sizes = [len(group["params"]) for group in self.param_groups]
        if getattr(self, "freetune_others_of", None) != sizes:
            in_flats = {id(w) for flat in self.freetune_flats for w in flat.weights}
            self.freetune_others_list = [(g, i, w) for g, group in enumerate(self.param_groups)
                                         for i, w in enumerate(group["params"]) if id(w) not in in_flats]
            self.freetune_others_of = sizes
        return self.freetune_others_list

    def freetune_flat_step(self, flat: FlatWeights) -> None:
        import torch

        if [w.data_ptr() for w in flat.weights] != flat.pointers:
            rehome(flat)
        group = self.param_groups[flat.gindex]
        if flat.state is None:
            flat.state = peft_bnb.adam_8bit_state(self, flat.tensor)
        grads = [w.grad for w in flat.weights]
        if any(g is None for g in grads) or len(set(flat.steps)) > 1:
            for i, (weight, grad) in enumerate(zip(flat.weights, grads)):
                if grad is not None:
                    flat.steps[i] += 1
                    peft_bnb.adam_8bit_update(self, group, grad.reshape(-1), weight.view(-1),
                                              flat.state_of(*flat.slices(i)), flat.steps[i])
            return
        step = flat.steps[0] + 1
        for first, end in flat.chunks:
            pieces = []
            for i in range(first, end):
                pieces.append(grads[i].reshape(-1))
                if i in flat.padding:
                    pieces.append(flat.padding[i])
            values, blocks = flat.chunk(first, end)
            state = flat.state_of(values, blocks)
            peft_bnb.adam_8bit_update(self, group, torch.cat(pieces), flat.tensor[values], state, step)
        flat.steps = [step] * len(flat.weights)

    def state_dict(self):
        members = {}
        for flat in self.freetune_flats:
            if flat.state is None:
                continue
            for i, weight in enumerate(flat.weights):
                if flat.steps[i] == 0:
                    continue
                values, blocks = flat.slices(i)
                members[weight] = {"step": flat.steps[i],
                                   "state1": flat.state["state1"][values].view_as(weight), "qmap1": flat.state["qmap1"],
                                   "state2": flat.state["state2"][values].view_as(weight), "qmap2": flat.state["qmap2"],
                                   "absmax1": flat.state["absmax1"][blocks], "absmax2": flat.state["absmax2"][blocks]}
        self.state.update(members)
        try:
            return super().state_dict()
        finally:
            for weight in members:
                del self.state[weight]

    def load_state_dict(self, state_dict, *args, **kwargs):
        import torch

        super().load_state_dict(state_dict, *args, **kwargs)
        for flat in self.freetune_flats:
            saved = [self.state.pop(w, None) for w in flat.weights]
            flat.state, flat.steps = None, [0] * len(flat.weights)
            if not any(saved):
                continue
            flat.state = peft_bnb.adam_8bit_state(self, flat.tensor)
            for i, entry in enumerate(saved):
                if not entry:
                    continue
                if entry["state1"].dtype != torch.uint8:
                    raise FreetuneError(f"The checkpoint's optimizer state for a LoRA weight of "
                                        f"{flat.weights[i].numel()} values is 32-bit, where this 8-bit AdamW keeps "
                                        f"8-bit state: it was saved with another optimizer setting. Resume with the "
                                        f"optimizer it was trained with.")
                values, blocks = flat.slices(i)
                for key in ("state1", "state2"):
                    flat.state[key][values].copy_(entry[key].reshape(-1))
                for key in ("absmax1", "absmax2"):
                    flat.state[key][blocks].copy_(entry[key].reshape(-1))
                flat.steps[i] = int(entry["step"])


_CLASSES: dict = {}


def release_state(optimizer) -> None:
    """Drop a torch or bitsandbytes optimizer's state (its moments), the flat tensors' state of one made by one_launch
    included; the weights stay where they are (freetune.trainer.FreetuneTrainer.release_optimizer_state)."""
    optimizer.state.clear()
    for flat in getattr(optimizer, "freetune_flats", ()):
        flat.state = None


def one_launch(optimizer):
    """`optimizer` with its weights in flat tensors and OneLaunchSteps' step where it is bitsandbytes' blockwise 8-bit
    Adam (the same object, its class extended); any other optimizer as it is, with a line that says why where it is a
    bitsandbytes 8-bit one."""
    blocker = peft_bnb.adam_8bit_blocker(optimizer)
    if blocker is None:
        return optimizer
    if blocker:
        print0(f"bitsandbytes' 8-bit optimizer updates each LoRA weight with a launch and a host sync of its own "
               f"here: {blocker}.")
        return optimizer
    if any(len(optimizer.state[w]) for group in optimizer.param_groups for w in group["params"]):
        raise FreetuneError("one_launch takes an optimizer before its first step (its state would be left behind).")
    base = type(optimizer)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"OneLaunch{base.__name__}", (OneLaunchSteps, base), {})
    flats = flatten(optimizer)
    # The same object, so that nothing that already holds it (the Trainer, a scheduler) holds a stale one.
    optimizer.__class__ = _CLASSES[base]
    optimizer.freetune_flats = flats
    return optimizer
