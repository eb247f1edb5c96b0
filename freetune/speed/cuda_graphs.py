"""CUDA graphs as a speed feature: whether the plan's graphs can replay this model's layers in this run (why_not), the
batches padded to the token counts they were recorded for, and the callback that installs freetune.speed.layer_graphs'
GraphedLayers when training begins, on a CUDA stream of its own, and takes them out when it ends (that module says how
the layers are recorded and replayed, and why).
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach.torch import free_cublas_workspaces, stashed
from freetune.speed import lora_kernel
from freetune.speed.batching import AlignedPaddingFree, most_rows
from freetune.speed.feature import Feature
from freetune.speed.layer_graphs import GraphedLayers, decoder_layers


def why_not(model, plan, world_size: int, cast_once: bool) -> str | None:
    """Why the plan's CUDA graphs cannot be used for this model and run (None: they can). cast_once: the LoRA
    weights are cast once per forward into the same buffers (lora_kernel.cast_adapters_once_per_forward)."""
    import torch

    from freetune.plan import ModelShape
    from freetune.plan.decisions import graphs_why_not

    dropouts = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    config = getattr(model, "config", None)
    try:
        architecture = graphs_why_not(ModelShape.from_config(config))
    except (AttributeError, KeyError, TypeError):  # no transformers config with a decoder's shape: nothing to check
        architecture = ""
    unfused = unfused_trainable(model)
    reasons = [
        (bool(architecture), architecture),
        (bool(unfused), f"trainable weights outside the fused LoRA layers ({', '.join(unfused[:3])}), which the "
                        f"graphs would not give gradients to"),
        (plan.layout.device != "cuda", "no GPU"),
        (world_size != 1, "more than one process"),
        (plan.batch.batching != "padding_free", "batches that are not padding-free"),
        (not decoder_layers(model) or not plan.memory.checkpointing or plan.memory.checkpoint_every != 1,
         "not every decoder layer checkpointed"),
        (not cast_once, "LoRA weights not cast once per forward (fused LoRA layers in one process)"),
        (bool(dropouts), f"dropout {max(dropouts, default=0):g} (a replayed recompute would draw other numbers)"),
    ]
    found = [text for failed, text in reasons if failed]
    return "; ".join(found) if found else None


def unfused_trainable(model) -> list[str]:
    """Names of the decoder layers' trainable parameters that belong to no fused LoRA layer: the graphs' backward
    takes the gradients of the layer's input and of its fused layers' LoRA weights only (a mixture of experts' LoRA
    through peft's ParamWrapper, say, would get none)."""
    names = []
    for i, layer in enumerate(decoder_layers(model)):
        fused = {id(p) for m in layer.modules() if stashed(m, lora_kernel.FUSED_ATTR, False) for p in m.parameters()}
        names += [f"layer {i} {n}" for n, p in layer.named_parameters() if p.requires_grad and id(p) not in fused]
    return names


def pad_batches(trainer, plan) -> None:
    """Pad the trainer's padding-free batches to a multiple of plan.kernels.cuda_graph_tokens tokens, in rows of at most
    max_length (batching.AlignedPaddingFree): a few token counts, each recorded once."""
    collator = trainer.data_collator
    if not isinstance(collator, AlignedPaddingFree):
        raise TypeError(f"CUDA graphs need freetune's padding-free collator, not {type(collator).__name__}")
    collator.multiple, collator.max_row = plan.kernels.cuda_graph_tokens, plan.batch.max_length


def callback(plan):
    """A TrainerCallback that installs GraphedLayers when training begins (after the Trainer turned checkpointing on)
    and removes them when it ends, and runs the training on a CUDA stream of its own meanwhile (module docstring)."""
    from transformers import TrainerCallback

    class CudaGraphs(TrainerCallback):
        graphed = stream = None

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            import torch

            from freetune.plan.sizing import graph_buffer_tokens

            multiple = plan.kernels.cuda_graph_tokens
            # sized by the plan for the data's longest row; a plan without it (built by hand): for rows of max_length
            max_tokens = (plan.kernels.cuda_graph_max_tokens
                          or graph_buffer_tokens(plan.batch.micro_batch, plan.batch.max_length, multiple))
            self.graphed = GraphedLayers(model, max_tokens=max_tokens, max_row=plan.batch.max_length,
                                         max_rows=most_rows(plan.batch.micro_batch, multiple, plan.batch.max_length),
                                         fixed_pairs=True)
            self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())  # after the model's loading
            torch.cuda.set_stream(self.stream)
            # cuBLAS keeps a workspace per stream: the default stream's, made while loading, is not needed now.
            free_cublas_workspaces()
            count = self.graphed.install()
            if count != len(self.graphed.layers):  # a layer the Trainer did not checkpoint keeps its own inputs
                self.remove()
                print0(f"CUDA graphs: off ({count} of the decoder layers checkpointed, not all).")
                return
            print0(f"CUDA graphs: {count} decoder layers' forward and backward recorded once per token count and "
                   f"replayed (batches padded to a multiple of {multiple} tokens; freetune.speed.cuda_graphs).")

        def on_train_end(self, args, state, control, **kwargs):
            self.remove()

        def remove(self):
            import torch

            if self.stream is not None:  # what runs after training (saving, generation) waits for the training
                torch.cuda.default_stream().wait_stream(self.stream)
                torch.cuda.set_stream(torch.cuda.default_stream())
                self.stream = None
            if self.graphed is not None:
                self.graphed.remove()
                self.graphed = None

    return CudaGraphs()


def _applies(plan, trainer) -> tuple[bool, str]:
    if not plan.kernels.cuda_graph_tokens:
        return False, ""
    reason = why_not(trainer.model, plan, trainer.args.world_size, cast_once=lora_kernel.casts_once(trainer.model))
    return not reason, reason or ""


def _install(trainer, plan):
    pad_batches(trainer, plan)
    graphs = callback(plan)
    trainer.add_callback(graphs)
    return graphs.remove


FEATURE = Feature("CUDA graphs", _applies, _install)
