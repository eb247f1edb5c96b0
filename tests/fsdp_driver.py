"""FSDP over the 4-bit QLoRA model on CPUs (gloo): what tests/test_multihost.py can run without a GPU.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/fsdp_driver.py MODEL fsdp OUT_DIR
    python tests/fsdp_driver.py MODEL plain OUT_DIR   # one process, both ranks' rows in one batch, the usual path

accelerate's FSDP plugin (what the Trainer uses) refuses a machine without an accelerator, so this wraps the model
with torch's FSDP directly, with the settings freetune.sft_config.fsdp_settings gives the Trainer: FULL_SHARD, FSDP1,
use_orig_params=False, and the wrap policy the Trainer installs for a peft model (peft's fsdp_auto_wrap_policy:
each decoder layer, and each LoRA layer on its own). The model comes from freetune.model.load_base_model with
layout "fsdp" (4-bit weights stored in the compute dtype, no fp32 upcast) and attach_lora, as in a recipe.
Three steps of AdamW; each rank trains on its own rows, so the sharded job must match one process that sees all
rows at once. Each rank writes OUT_DIR/<mode>-rank<R>.json: the losses (mean over ranks) and what it held.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


SHORT_TIMEOUT_S = 10


def main() -> None:
    model_dir, mode, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    import torch

    import freetune
    from freetune.plan import Plan

    # A short collective timeout, and rank 0's loading made longer than it (a slow download): the other ranks must
    # wait for the model on the loader's own long timeout (freetune.model.LOAD_TIMEOUT_S) and not fail the job.
    ctx = freetune.distributed.init(timeout_s=SHORT_TIMEOUT_S if mode == "fsdp" else 60)
    if mode == "fsdp" and ctx.rank == 0:
        import time

        import transformers

        loader = transformers.AutoModelForCausalLM.from_pretrained.__func__

        def slow_download(cls, *args, **kwargs):
            time.sleep(2 * SHORT_TIMEOUT_S)
            return loader(cls, *args, **kwargs)

        transformers.AutoModelForCausalLM.from_pretrained = classmethod(slow_download)
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                layout="fsdp" if mode in ("fsdp", "single") else None)
    import bitsandbytes  # noqa: F401 - imported before the measurement below, so that it counts weights only
    import peft  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    rss_before = _rss_mib()
    model = freetune.model.load_base_model(model_dir, plan, gradient_checkpointing=True)
    load_rss_mib = _rss_mib() - rss_before  # host memory the loaded model took in this process
    model, trainable, total = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
    quantized = {type(m.weight).__name__: str(m.weight.dtype) for m in model.modules()
                 if type(m).__name__ == "Linear4bit"}
    # Two rows per rank, different on each rank; "single" (FSDP loading, no sharding) and "plain" (the usual
    # loading) take all four rows in one batch.
    rows = [torch.arange(r * 7, r * 7 + 32).reshape(2, 16) + 100 for r in range(2)]
    if mode == "fsdp":
        from peft.utils.other import fsdp_auto_wrap_policy
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy

        # Rank 0 alone read the weights (freetune.model._load_fsdp_rank0_only). On GPUs FSDP's sync_module_states
        # (sft_config.fsdp_settings) broadcasts them into the other ranks' unread parameters; FSDP refuses that option for
        # CPU modules, so here the same broadcast is done before wrapping: every parameter and buffer from rank 0.
        for tensor in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)
        model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(model), sharding_strategy=ShardingStrategy.FULL_SHARD,
                     use_orig_params=False, device_id=torch.device("cpu"))
        batch = rows[ctx.rank]
    else:
        batch = torch.cat(rows)
    held = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = torch.tensor([loss.item()], dtype=torch.float64)
        if ctx.distributed:  # the mean over ranks = the loss over all rows (every row has the same length)
            torch.distributed.all_reduce(value)
            value /= ctx.world_size
        losses.append(value.item())
    record = {"mode": mode, "rank": ctx.rank, "world_size": ctx.world_size, "losses": losses, "held": held,
              "total": total, "trainable": trainable, "quantized": quantized, "load_rss_mib": load_rss_mib}
    (out_dir / f"{mode}-rank{ctx.rank}.json").write_text(json.dumps(record))
    freetune.distributed.cleanup()


def _rss_mib() -> float:
    """This process's resident memory now (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


if __name__ == "__main__":
    main()
