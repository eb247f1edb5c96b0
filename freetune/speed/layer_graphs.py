"""The checkpointed decoder layers' forward and backward as CUDA graphs: each layer's work launched by one call.

Why: a small model's training step on a fast GPU is bound by the host. Each compiled decoder layer still costs the
host its guard checks, its generated wrapper, the custom ops' Python, every matmul's and kernel's launch, and the
autograd engine's bookkeeping, once in the forward, once in the recompute and once in the backward; the GPU waits in
between (docs/performance.md has the profiles). A CUDA graph records a layer's kernels once and replays them with one
call. torch.compile's own CUDA graphs (mode="reduce-overhead") do not survive a checkpoint around the compiled layer
(pytorch/pytorch#154306), and a graph needs fixed shapes and fixed addresses, so the checkpoint here is freetune's own:

- `GraphedLayers.install` replaces each decoder layer's checkpoint function (transformers' GradientCheckpointingLayer
  calls `_gradient_checkpointing_func(partial(layer.__call__, **kwargs), hidden_states)`) with `_Checkpoint`, an
  autograd function whose forward runs the layer without autograd and whose backward runs it again with autograd and
  takes the gradients of its input and of its 16-bit LoRA weights (the copies that
  freetune.speed.lora_kernel.cast_adapters_once_per_forward makes once per forward; their gradients go back to the fp32
  weights as before).
- Fixed shapes: the padding-free batch is padded to a multiple of plan.kernels.cuda_graph_tokens tokens
  (batching.AlignedPaddingFree with rows of at most max_length tokens, which train nothing); the row boundaries
  (cu_seq_lens) are padded with empty rows to a fixed count and the longest row given as max_length (the token count
  where that is shorter), so one graph per token count serves every batch of that count.
- Fixed addresses: the hidden states go through two buffers in turn (layer i reads one and writes the other), the
  output gradient and the input gradient share a third, the position embeddings and row boundaries are copied into
  buffers of their own; the 16-bit LoRA weights are cast into the same buffers at every forward, and each layer's
  backward writes their gradients over them; each layer's input waits in a buffer of host memory (pinned) until its
  backward, copied out and back on a stream of its own while the layers compute.
- The first batch runs those same steps without graphs (it compiles the layers and loads every kernel); after it,
  the first batch of each token count records each layer's forward and backward (all graphs share one memory pool:
  nothing lives in the pool between two graphs, each graph's inputs and outputs are the buffers above), and every
  later batch of that count replays them, one call per layer and direction. A recording that fails runs its batch
  without graphs, says why, and is tried once more at a later batch.
- The training runs on a CUDA stream of its own (freetune.speed.cuda_graphs.callback), the graphs are recorded on it:
  cuBLAS keeps a workspace per stream, and a second stream would hold a second one.

The same arithmetic as transformers' checkpoint over the same compiled layers: the padding rows' gradients are zero
(their labels are ignored and attention keeps rows apart), the loss is the same (tests/test_graphed_layers.py compares
losses and gradients, on a CPU without graphs and on a GPU with them). Where it applies (freetune.plan.decisions): one CUDA
process, every layer checkpointed, compiled layers, fused LoRA layers with their weights cast once per forward, and no
dropout (a graph replays the recompute with other random numbers than the forward drew).
"""


from __future__ import annotations

import contextlib
from functools import partial

from freetune.distributed import print0
from freetune.reach.torch import foreach_copy_, mark_static, stash, stashed
from freetune.reach.transformers import replace_checkpoint_function
from freetune.speed import lora_kernel, recompute

ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")  # row boundaries (int32, rows + 1), padded with empty rows
LENGTH_KEYS = ("max_length_q", "max_length_k")  # longest row: the graphs take max_length, what any row can reach


def decoder_layers(model) -> list:
    """The model's decoder layers in the order they run (transformers' GradientCheckpointingLayer subclasses)."""
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def lora_pairs(layer) -> list | None:
    """The 16-bit (A, B) copies of `layer`'s fused LoRA projections this forward (freetune.speed.lora_kernel), flattened
    in module order; None where a projection has none (its weights are not cast once per forward: not graphed)."""
    pairs = []
    for module in layer.modules():
        if stashed(module, lora_kernel.FUSED_ATTR, False):
            cast = stashed(module, lora_kernel.ADAPTER_16BIT_ATTR)
            if cast is None:
                return None
            pairs.extend(cast)
    return pairs or None


class _Shape:
    """Everything that belongs to one token count: the copies of the layers' keyword tensors, the graphs, and how
    many batches of this count have run."""

    def __init__(self):
        self.kwargs = None  # the keyword arguments the layers get (tensors are this shape's own buffers)
        self.sources = {}  # keyword path -> the buffer it is copied into
        self.forward_graphs, self.backward_graphs = {}, {}
        self.batches = 0  # forwards of the first layer so far
        self.failed = None  # why recording failed last
        self.failed_at = 0  # the batch it failed in: recording is tried once more, at a later batch
        self.failures = 0


class GraphedLayers:
    """freetune's checkpoint of every decoder layer of `model`, recorded as CUDA graphs per token count (module
    docstring). max_tokens: the longest padded batch (its buffers are sized for it); max_row: the longest row
    (max_length); max_rows: the most rows a padded batch holds (its row boundaries are padded to that count)."""

    def __init__(self, model, *, max_tokens: int, max_row: int, max_rows: int, graphs: bool = True,
                 fixed_pairs: bool = False):
        self.layers = decoder_layers(model)
        self.max_tokens, self.max_row, self.max_rows = max_tokens, max_row, max_rows
        self.graphs = graphs  # False: the same checkpoint and buffers without graphs (a CPU, or to compare)
        # True: the 16-bit LoRA weights are cast into the same buffers at every forward
        # (cast_adapters_once_per_forward's same_buffers): the graphs read those, no copy of them is made here.
        self.fixed_pairs = fixed_pairs
        # layer index -> its 16-bit LoRA weights as the graphs read them (leaves that require grad); the backward
        # writes their gradients over them
        self.pairs = {}
        self.warm = False  # a first batch has run through every layer (compiled them) without graphs
        self.shapes: dict[int, _Shape] = {}
        self.replaced = {}  # layer index -> the checkpoint function it had
        self.hidden = None  # (2, max_tokens, hidden) buffers the layers read and write in turn
        self.grad = None  # (max_tokens, hidden): the output gradient in, the input gradient out
        self.stored = []  # per layer: its input until its backward (pinned host memory on a GPU)
        self.pool = self.capture_stream = self.copy_stream = None
        # ("out", i) / ("in", i) -> the event after which layer i's input is in host memory / back on the GPU
        self.copied = {}
        self.shape = None  # the _Shape of the batch being computed
        self.recorded = 0  # graphs recorded so far (for the log)
        self.first_keywords = {}  # layer 0's keyword arguments this batch: every layer must get the same

    # ---- set-up --------------------------------------------------------------------------------------------------

    def install(self) -> int:
        """Make every checkpointed decoder layer call this checkpoint; returns how many."""
        for i, layer in enumerate(self.layers):
            if getattr(layer, "gradient_checkpointing", False):
                self.replaced[i] = replace_checkpoint_function(layer, partial(self._checkpoint, i))
        return len(self.replaced)

    def remove(self) -> None:
        """Undo install and free the buffers and graphs."""
        for i, func in self.replaced.items():
            replace_checkpoint_function(self.layers[i], func)
        self.replaced = {}
        self.shapes, self.hidden, self.grad, self.stored, self.pool = {}, None, None, [], None
        self.pairs = {}

    def _buffers(self, hidden) -> None:
        import torch

        if self.hidden is not None:
            return
        size = (self.max_tokens, hidden.shape[-1])
        self.hidden = torch.empty((2, *size), dtype=hidden.dtype, device=hidden.device)
        self.grad = torch.empty(size, dtype=hidden.dtype, device=hidden.device)
        on_gpu = hidden.is_cuda
        # The last layer's input is still in its buffer at the start of the backward: nothing to store.
        self.stored = [torch.empty(size, dtype=hidden.dtype, device="cpu", pin_memory=on_gpu)
                       for _ in range(len(self.layers) - 1)]
        if on_gpu:
            self.copy_stream, self.capture_stream = torch.cuda.Stream(), torch.cuda.Stream()
            if self.graphs:
                self.pool = torch.cuda.graph_pool_handle()

    # ---- the layers' keyword arguments as fixed buffers --------------------------------------------------------

    def _static_kwargs(self, shape: _Shape, kwargs: dict, tokens: int) -> dict:
        """The layers' keyword arguments with every tensor copied into `shape`'s own buffer (made at the first batch
        of this count), the row boundaries padded with empty rows, the longest row set to max_row (the token count
        where the batch is shorter)."""
        import torch

        def fixed(path, value):
            if isinstance(value, (tuple, list)):
                return type(value)(fixed(f"{path}.{j}", v) for j, v in enumerate(value))
            if not isinstance(value, torch.Tensor):
                # no row is longer than the batch: a fused attention kernel refuses a longest row past its keys
                # ("Invalid max_seqlen_k": 2 rows of 150-500 tokens padded to 768, max_length 1,024)
                return min(self.max_row, tokens) if path in LENGTH_KEYS else value
            if path in ROW_KEYS:
                rows = self.max_rows + 1
                if value.numel() > rows:
                    raise ValueError(f"{value.numel() - 1} rows in one batch, more than the {self.max_rows} the "
                                     f"graphs were sized for")
                buffer = shape.sources.get(path)
                if buffer is None:
                    buffer = shape.sources[path] = torch.empty(rows, dtype=torch.int32, device=value.device)
                buffer[:value.numel()].copy_(value, non_blocking=True)
                buffer[value.numel():].fill_(tokens)  # empty rows at the end: no query, no key
                return buffer
            buffer = shape.sources.get(path)
            if buffer is None:
                buffer = shape.sources[path] = torch.empty_like(value)
            elif buffer.shape != value.shape or buffer.dtype != value.dtype:
                raise ValueError(f"the layers' argument {path} changed shape within one token count")
            buffer.copy_(value, non_blocking=True)
            return buffer

        # Row boundaries shared by both keys stay one buffer (transformers passes the same tensor twice).
        same_rows = all(k in kwargs for k in ROW_KEYS) and kwargs[ROW_KEYS[0]] is kwargs[ROW_KEYS[1]]
        out = {k: fixed(k, v) for k, v in kwargs.items() if not (same_rows and k == ROW_KEYS[1])}
        if same_rows:
            out[ROW_KEYS[1]] = out[ROW_KEYS[0]]
        return out

    # ---- the checkpoint ------------------------------------------------------------------------------------------

    def _checkpoint(self, i: int, fn, hidden, *args, **kwargs):
        import torch

        pairs = lora_pairs(self.layers[i])
        if (args or kwargs or not torch.is_grad_enabled() or pairs is None or hidden.dim() != 3 or hidden.shape[0] != 1
                or hidden.shape[1] > self.max_tokens or not isinstance(fn, partial)):
            return self.replaced[i](fn, hidden, *args, **kwargs)  # not a padding-free training batch: as before
        return _function().apply(self, i, fn, hidden, *pairs)

    def forward(self, ctx, i: int, fn, hidden, pairs):
        import torch

        tokens = hidden.shape[1]
        self._buffers(hidden)
        if i == 0:
            shape = self.shapes.setdefault(tokens, _Shape())
            shape.kwargs = self._static_kwargs(shape, fn.keywords, tokens)
            shape.batches += 1
            self.shape = shape
            self.first_keywords = fn.keywords
        elif not same_arguments(fn.keywords, self.first_keywords):
            differ = per_layer_difference(fn.keywords, self.first_keywords)
            raise ValueError(f"decoder layer {i} gets other keyword arguments than layer 0 ({differ}): "
                             f"the graphs replay layer 0's for every layer, which would compute another model. The "
                             f"plan steps CUDA graphs aside for such models (freetune.plan.decisions.graphs_why_not)")
        shape = self.shape
        ctx.shape, ctx.tokens, ctx.input_grad = shape, tokens, hidden.requires_grad
        source, target = self.hidden[i % 2, :tokens], self.hidden[(i + 1) % 2, :tokens]
        if hidden.data_ptr() != source.data_ptr():
            source.copy_(hidden[0])
        static = self.pairs.get(i)
        if static is None:
            static = self.pairs[i] = [(p.detach() if self.fixed_pairs else p.detach().clone()).requires_grad_(True)
                                      for p in pairs]
            for t in static:  # as cast_adapters_once_per_forward marks its copies: fixed sizes, no specialisation
                mark_static(t)
        if any(a.data_ptr() != b.data_ptr() for a, b in zip(static, pairs)):
            foreach_copy_(static, [p.detach() for p in pairs])
        on_gpu = hidden.is_cuda
        if on_gpu:
            current = torch.cuda.current_stream()
            before = self.copied.get(("out", i - 1))
            if before is not None:  # layer i overwrites the buffer the previous layer's input is being copied from
                current.wait_event(before)
        if i < len(self.layers) - 1:  # store this layer's input while it computes
            self._copy(self.stored[i][:tokens], source, ("out", i))
        layer_fn = partial(self._run_forward, i, fn.func, shape, source, target)
        self._run(shape.forward_graphs, i, layer_fn, shape)
        return target.unsqueeze(0).detach()

    def backward(self, ctx, grad):
        import torch

        i, shape, tokens = ctx.i, ctx.shape, ctx.tokens
        source = self.hidden[i % 2, :tokens]
        if grad.is_cuda:
            back = self.copied.get(("in", i))
            if back is not None:
                torch.cuda.current_stream().wait_event(back)
                self.copied[("in", i)] = None
        elif i < len(self.layers) - 1:
            source.copy_(self.stored[i][:tokens])
        if i > 0 and grad.is_cuda:  # the previous layer's input back from host memory while this layer computes
            self._copy(self.hidden[(i - 1) % 2, :tokens], self.stored[i - 1][:tokens], ("in", i - 1))
        dy = self.grad[:tokens]
        if grad.data_ptr() != dy.data_ptr():
            dy.copy_(grad[0])
        layer_fn = partial(self._run_backward, i, ctx.fn.func, shape, source, dy, ctx.input_grad)
        self._run(shape.backward_graphs, i, layer_fn, shape)
        if i == 0:
            self.warm = True
        # The next layer down reads its output gradient from this buffer. The LoRA weights' gradients are in their
        # weights' buffers (below), read by the cast's backward at the end of this backward, before the next
        # forward casts the weights into them again.
        dx = dy.unsqueeze(0).detach() if ctx.input_grad else None
        return dx, [p.detach() for p in self.pairs[i]]

    def _copy(self, out, source, key) -> None:
        """out.copy_(source) on the copy stream (a GPU), after what the current stream has queued; the event is kept
        under `key`. Without a GPU, a plain copy."""
        import torch

        if not source.is_cuda and not out.is_cuda:
            out.copy_(source)
            return
        self.copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.copy_stream):
            out.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.copied[key] = event

    # ---- one layer's work, run, recorded or replayed -----------------------------------------------------------

    def _run(self, graphs: dict, i: int, layer_fn, shape: _Shape) -> None:
        """Replay layer i's graph; record it first once a first batch has compiled the layers; else run layer_fn."""
        import torch

        graph = graphs.get(i)
        if graph is not None:
            graph.replay()
            return
        retry = shape.failures == 0 or (shape.failures == 1 and shape.batches > shape.failed_at)
        if not (self.graphs and self.pool is not None and self.warm and retry):
            layer_fn()
            return
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream()
        # On the training's own stream where it has one (freetune.train gives it one): the kernels' workspaces
        # (cuBLAS keeps one per stream) are the ones the first batch already made.
        capture = current if current != torch.cuda.default_stream() else self.capture_stream
        if capture is not current:
            capture.wait_stream(current)
        try:
            with torch.cuda.stream(capture):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    layer_fn()
                finally:
                    graph.capture_end()
        except Exception as error:  # noqa: BLE001 - any failure to record: this batch runs without graphs
            shape.failed, shape.failed_at = f"{type(error).__name__}: {error}", shape.batches
            shape.failures += 1
            torch.cuda.synchronize()
            then = "tried once more at a later batch" if shape.failures == 1 else "run without graphs from now on"
            print0(f"CUDA graphs: recording layer {i} failed "
                   f"({shape.failed}); batches of this token count are {then}.")
            layer_fn()
            return
        if capture is not current:
            current.wait_stream(capture)
        graphs[i] = graph
        self.recorded += 1
        graph.replay()

    def _run_forward(self, i, call, shape, source, target) -> None:
        import torch

        with torch.no_grad(), self._reading(i, self.pairs[i]):
            out = call(source.unsqueeze(0), **shape.kwargs)
            target.copy_(out[0])

    def _run_backward(self, i, call, shape, source, dy, input_grad: bool) -> None:
        import torch

        pairs = self.pairs[i]
        x = source.unsqueeze(0).detach().requires_grad_(input_grad)
        # Saved tensors stay where they are (an offloading context around the step must not move them). The
        # recompute's output is not read (only its gradients are taken): parts that can, skip computing it
        # (freetune.speed.recompute).
        with (torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_same, _same),
              self._reading(i, pairs)):
            with recompute.recomputing():
                out = call(x, **shape.kwargs)
            got = torch.autograd.grad(out, ([x] if input_grad else []) + list(pairs), dy.unsqueeze(0),
                                      allow_unused=True)
        if input_grad:
            dy.copy_(got[0][0])
            got = got[1:]
        # Each LoRA weight's gradient written over the weight's 16-bit copy, which this layer no longer reads: no
        # buffer of their own (the weights of every layer would be held twice).
        with torch.no_grad():
            foreach_copy_([p.detach() for p in pairs],
                          [g if g is not None else torch.zeros_like(p) for g, p in zip(got, pairs)])

    @contextlib.contextmanager
    def _reading(self, i: int, pairs):
        """Layer i's fused projections read `pairs` (this token count's buffers) as their 16-bit LoRA weights."""
        modules = [m for m in self.layers[i].modules() if stashed(m, lora_kernel.FUSED_ATTR, False)]
        kept = [stashed(m, lora_kernel.ADAPTER_16BIT_ATTR) for m in modules]
        for j, module in enumerate(modules):
            stash(module, lora_kernel.ADAPTER_16BIT_ATTR, (pairs[2 * j], pairs[2 * j + 1]))
        try:
            yield
        finally:
            for module, cast in zip(modules, kept):
                stash(module, lora_kernel.ADAPTER_16BIT_ATTR, cast)


def _same(t):
    return t


def same_arguments(keywords: dict, first: dict) -> bool:
    """Whether a layer's keyword arguments are layer 0's: the very same tensors (transformers hands every layer the
    same mask and rotary embeddings unless they differ by layer type), equal values otherwise."""
    return not per_layer_difference(keywords, first)


def per_layer_difference(keywords: dict, first: dict) -> str:
    """The names of the keyword arguments that differ from layer 0's ('' where none)."""
    import torch

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return a is b
        if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a is b or a == b

    names = sorted(set(keywords) | set(first))
    return ", ".join(n for n in names if n not in keywords or n not in first or not same(keywords[n], first[n]))


_FUNCTION = {}


def _function():
    """The autograd function (built on first use: torch is imported lazily in this package)."""
    if "f" in _FUNCTION:
        return _FUNCTION["f"]
    import torch

    class _Checkpoint(torch.autograd.Function):
        @staticmethod
        def forward(ctx, runner, i, fn, hidden, *pairs):
            ctx.runner, ctx.i, ctx.fn = runner, i, fn
            return runner.forward(ctx, i, fn, hidden, pairs)

        @staticmethod
        def backward(ctx, grad):
            dx, grads = ctx.runner.backward(ctx, grad)
            return (None, None, None, dx, *grads)

    _FUNCTION["f"] = _Checkpoint
    return _Checkpoint
