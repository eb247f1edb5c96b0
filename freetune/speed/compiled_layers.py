"""torch.compile'd decoder layers: each layer's forward and backward as a few fused kernels instead of hundreds of
launches (the fused LoRA and MLP ops are traced into the graphs), undone after training for generation.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach.torch import compile_settings, uncompile
from freetune.speed.feature import Feature


def compile_layers(model, backend: str = "inductor") -> int:
    """torch.compile every decoder layer of `model` in place (module.compile, so the module tree, the adapter's
    parameter names and checkpoints stay as they are); returns how many. Shapes are marked dynamic: padding-free
    and length-grouped batches change length every step. A layer dynamo cannot compile runs eagerly
    (suppress_errors) rather than stopping the run."""
    compile_settings()
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    return len(layers)


def uncompile_layers(model) -> int:
    """Undo compile_layers (after training): generation runs token by token through a KV cache, shapes the
    training graphs were not compiled for; eager layers serve it without recompiling. Returns how many."""
    return sum(uncompile(module) for module in model.modules())


def _applies(plan, trainer) -> tuple[bool, str]:
    return plan.kernels.compile, ""


def _install(trainer, plan):
    from freetune.plan.memory import dequantises_backward_in_graph
    from freetune.speed import nf4

    kernels = plan.kernels
    # Read when the layers are traced (their first step); the plan's estimate counted what they cost.
    nf4.dequantise_backward_in_graph(dequantises_backward_in_graph(kernels.lora, kernels.compile, kernels.mlp,
                                                                   bool(kernels.cuda_graph_tokens)))
    compiled = compile_layers(trainer.model)
    print0(f"torch.compile: {compiled} decoder layers; the first steps are slower while they compile.")

    def undo():
        nf4.dequantise_backward_in_graph(False)
        uncompile_layers(trainer.model)  # the model may go on to generate: eager layers for that

    return undo


FEATURE = Feature("torch.compile", _applies, _install)
