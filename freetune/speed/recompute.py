"""Whether the forward that runs now is a checkpoint's recompute, whose output nobody reads.

freetune's own checkpoint of the decoder layers (freetune.speed.layer_graphs) runs each layer twice: once without
autograd for its output, once again in the backward for what autograd saves; it then takes the gradients of that
second run and throws its output away. Where a part of the layer is the last thing the layer does before the residual
add (the MLP of llama, qwen2, qwen3, mistral: freetune.speed.mlp.MLP_MODEL_TYPES) and its backward needs nothing of
its forward's output, that part can skip its output in the recompute: the traced MLP then computes only the LoRA-A
outputs its backward reads (freetune.speed.mlp_traced), not gate, up and down again.

The flag is a module global that compiled code reads: dynamo guards on it, so a compiled layer holds one graph for
the recompute and one for the rest.
"""

from __future__ import annotations

import contextlib

RECOMPUTING = False  # read by freetune.speed.mlp_traced.traced_mlp; set only through recomputing()


@contextlib.contextmanager
def recomputing(on: bool = True):
    """The forward inside runs for a backward that reads only what autograd saves, not its output."""
    global RECOMPUTING
    before, RECOMPUTING = RECOMPUTING, on
    try:
        yield
    finally:
        RECOMPUTING = before
