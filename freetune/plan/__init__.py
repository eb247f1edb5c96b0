"""The training plan, decided before anything loads, with a reason for each choice.

Most failed free-tier runs die of the machine, not the model: a P100 that current PyTorch cannot use, bf16 asked of
a T4, a batch that does not fit. The package reads the machine, then decides, refusing what cannot run before a model
is downloaded; the plan shows itself as a table in a notebook.

    hardware   what the machine has (read_hardware), the varlen kernel's probe, the refusal of an unsupported GPU
    decisions  each choice one function: choose_* -> Decision(value, why)
    sizing     the decisions that weigh the memory estimate (checkpointing, offloading, kernels, CUDA graphs)
    shapes     the model's shape from its config.json (a folder, or huggingface_hub's cache), a table for the rest
    memory     the memory arithmetic: estimate() and fit()
    record     the Plan: every decision's value and why, its warnings, its memory estimate
    make       make_plan, replan, for_world: the steps

    python -m freetune.plan [--json] [--model-shape qwen2.5-1.5b] [--max-length 1024]
"""

from freetune.errors import FreetuneError
from freetune.plan.decisions import Decision
from freetune.plan.hardware import GPU, Hardware, check_gpus_supported, read_hardware
from freetune.plan.make import for_world, make_plan, replan
from freetune.plan.memory import MemoryEstimate, estimate, fit
from freetune.plan.record import Plan
from freetune.plan.shapes import KNOWN_SHAPES, ModelShape, shape_of

__all__ = ["GPU", "KNOWN_SHAPES", "Decision", "FreetuneError", "Hardware", "MemoryEstimate", "ModelShape", "Plan",
           "check_gpus_supported", "estimate", "fit", "for_world", "make_plan", "read_hardware", "replan", "shape_of"]
