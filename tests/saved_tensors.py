"""What autograd keeps for the backward: the memory tests count it instead of guessing it."""

from __future__ import annotations


def saved_for_backward(model, forward):
    """(bytes, output) of forward(): the bytes of every storage autograd saves for the backward while it runs, each
    storage once, the model's own parameters (weights, LoRA) left out."""
    import torch

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return sum(storages.values()), out
