"""The input embeddings in host RAM for training, where GPU memory is tight.

Why: the input embedding table is a frozen weight that a step only reads a few thousand rows of (one per token).
On a 4 GB card every megabyte counts: TinyLlama's table is 125 MiB in fp16, as much as a quarter of the 4-bit decoder
layers; Qwen3-8B's is 1.16 GiB. Kept in host RAM, each micro-batch's token ids are looked up there and only the rows
they select (tokens x hidden, 29 MiB for 7,000 tokens of TinyLlama) are copied to the GPU, from pinned memory, so the
copy runs alongside the GPU's work. Unsloth does the same under memory pressure.

Where the plan does it (freetune.plan.sizing.choose_embeddings): one GPU, every layer checkpointed, and an lm_head that is
a weight of its own (a tied head would need the table on the GPU for the loss anyway). freetune.train moves the table
to the host when training begins (`at_train_begin`: after accelerate's prepare, which moves every parameter of a
model loaded on one device back to it).

After training the table stays in host RAM, looked up there: moving it back would be the run's peak (on Qwen3-8B's
shape at the T4 cap the table's 1.16 GiB came back on top of what the steps had left, above every step's peak), for a
model the recipes delete right after training (their evaluation and export load the adapter from disk). Generation
from the trained model in the same process works as it is, one lookup per new token. `to_gpu` moves it back.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach.torch import replace_forward, restore_forward, stash, stashed, unstash
from freetune.speed.feature import Feature

# What an embedding whose table is on the host carries (freetune.reach.torch.stash): the GPU its output goes to, and
# Gemma-3's scale of its rows (None for the others).
HOME_ATTR = "_freetune_embeddings_home"
HOST_SCALE_ATTR = "_freetune_host_scale"


def to_host(model) -> int:
    """Move `model`'s input embedding table to pinned host memory and make its forward look tokens up there, with the
    rows copied to the GPU it came from. Returns the bytes freed on the GPU (0 where nothing moved: no CUDA weight, a
    table the output head shares, a max_norm embedding, or already on the host).

    A table that a later run finds on the GPU again with the host lookup still attached (a second train() of the same
    model: accelerate's prepare moves it back) goes to the host again, the lookup kept."""
    import torch

    embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if (weight is None or weight.device.type != "cuda" or getattr(embedding, "max_norm", None) is not None
            or _shares_head(model, weight) or why_not(embedding)):
        return 0
    home = weight.device
    weight.data = weight.data.to("cpu").pin_memory()
    if stashed(embedding, HOME_ATTR) is None:
        attach(embedding, home)
    torch.cuda.empty_cache()
    return weight.numel() * weight.element_size()


def why_not(embedding) -> str:
    """Why the host lookup cannot stand in for this embedding module's forward ('' where it can): it does what
    nn.Embedding does, and what Gemma-3's scaled embedding adds (embed_scale, Gemma3TextScaledWordEmbedding in
    transformers 5.17); any other forward of its own it would drop."""
    import torch

    forward = type(embedding).forward
    if forward is torch.nn.Embedding.forward or _scale_of(embedding) is not None:
        return ""
    return f"{type(embedding).__name__} has a forward of its own, which the host lookup would not run"


def _scale_of(embedding):
    """Gemma-3's embedding scale (a 0-d buffer, sqrt(hidden)), or None."""
    import torch

    scale = getattr(embedding, "embed_scale", None)
    return scale if isinstance(scale, torch.Tensor) and scale.dim() == 0 else None


def at_train_begin():
    """A TrainerCallback that moves the table to the host when training begins (to_host) and says so."""
    from transformers import TrainerCallback

    class EmbeddingsToHost(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            moved = to_host(model)
            embedding = model.get_input_embeddings()
            if why_not(embedding):
                print0(f"Input embeddings: stay on the GPU ({why_not(embedding)}).")
            if moved:
                print0(f"Input embeddings: in host RAM for training and after it, {moved / 2**20:,.0f} MiB off the "
                       f"GPU (freetune.speed.host_embeddings; to_gpu(model) moves them back).")

    return EmbeddingsToHost()


def to_gpu(model) -> bool:
    """Undo `to_host`: the table back on its GPU, the module's own forward again. Returns whether anything moved."""
    embedding = model.get_input_embeddings()
    home = stashed(embedding, HOME_ATTR)
    if home is None:
        return False
    embedding.weight.data = embedding.weight.data.to(home)
    detach(embedding)
    return True


def attach(embedding, home) -> None:
    """Give an embedding module whose table is on the host the forward that looks up there and returns the rows on
    `home` (the GPU the decoder runs on). Split from to_host so that a CPU test can run the same forward."""
    stash(embedding, HOME_ATTR, home)
    scale = _scale_of(embedding)
    # Gemma-3's scale as its own forward applies it, in the table's dtype; kept on the host, with the rows.
    stash(embedding, HOST_SCALE_ATTR, None if scale is None else scale.to("cpu", embedding.weight.dtype))
    replace_forward(embedding, _host_forward)


def detach(embedding) -> None:
    """Undo `attach`: the module's own forward again (the table stays where it is)."""
    restore_forward(embedding)
    unstash(embedding, HOME_ATTR)
    unstash(embedding, HOST_SCALE_ATTR)


def _host_forward(self, ids):
    """nn.Embedding's forward for a table in host memory (frozen, no max_norm: padding_idx only matters to its
    gradient): the rows gathered on the host into a pinned buffer, then copied to the decoder's GPU without waiting.
    The ids' copy to the host waits for the GPU (it made them): once per micro-batch."""
    import torch

    if self.weight.device.type != "cpu":  # moved back by someone else (a model.to(...)): the usual lookup there
        return type(self).forward(self, ids)
    home = stashed(self, HOME_ATTR)
    flat = ids.reshape(-1).to("cpu")
    pinned = self.weight.is_pinned()
    rows = torch.empty((flat.numel(), self.weight.shape[1]), dtype=self.weight.dtype, pin_memory=pinned)
    torch.index_select(self.weight, 0, flat, out=rows)
    scale = stashed(self, HOST_SCALE_ATTR)
    if scale is not None:
        rows.mul_(scale)
    # From pinned memory the copy is queued on the GPU's stream and the host goes on; the caching host allocator keeps
    # the buffer until that copy has run.
    return rows.view(*ids.shape, -1).to(home, non_blocking=pinned)


def _shares_head(model, weight) -> bool:
    head = model.get_output_embeddings()
    head_weight = getattr(head, "weight", None)
    return head_weight is not None and head_weight.data_ptr() == weight.data_ptr()


def _applies(plan, trainer) -> tuple[bool, str]:
    return plan.memory.embeddings_on_host, ""  # the table itself may still refuse at train begin (why_not), and says so


def _install(trainer, plan):
    trainer.add_callback(at_train_begin())
    return None  # nothing to undo: the table stays in host RAM after training (the module's docstring says why)


FEATURE = Feature("Input embeddings", _applies, _install)
