"""How many graphs each compiled decoder layer becomes under DDP (tests/test_kernels.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/compile_ddp_driver.py MODEL OUT_DIR

A 4-bit model with LoRA adapters big enough that one layer's gradients overflow DDP's first 1 MB bucket, its LoRA
layers fused and its decoder layers compiled by freetune.speed.compiled_layers.compile_layers (aot_eager: dynamo and the
autograd graph as inductor gets them, no C compiler), wrapped in torch's DDP (gloo), runs one forward and
backward. Then again with dynamo's DDPOptimizer switched back on (what compile_layers turns off). Each rank writes
OUT_DIR/rank<R>.json: per pass, the number of graphs the backend was handed, the ops in each, and a checksum of
the LoRA gradients (the ranks' must agree: the all-reduce ran).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LORA_RANK = 128  # hidden 256: ~2 MB of fp32 LoRA weights per decoder layer


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    import torch
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel

    import freetune
    from freetune.plan import make_plan
    from freetune.speed import compiled_layers, lora_kernel

    ctx = freetune.distributed.init(timeout_s=60)
    plan = make_plan(micro_batch=1, grad_accum=1)
    model = freetune.model.load_base_model(model_dir, plan, local_rank=ctx.local_rank)
    model, _, _ = freetune.model.attach_lora(model, rank=LORA_RANK, alpha=LORA_RANK, dropout=0.0, seed=0)
    lora_kernel.use_fused_lora(model)
    layer_bytes = sum(p.numel() * p.element_size() for p in model.get_base_model().model.layers[0].parameters()
                      if p.requires_grad)

    graphs: list[int] = []  # ops per graph handed to the backend

    def counting_backend(gm, example_inputs):
        graphs.append(sum(1 for node in gm.graph.nodes if node.op == "call_function"))
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    ddp = DistributedDataParallel(model, broadcast_buffers=False, find_unused_parameters=False)
    ids = torch.randint(3, 500, (1, 24 + 8 * ctx.rank), generator=torch.Generator().manual_seed(ctx.rank))
    passes = {}
    for name, split in (("freetune", False), ("ddp_optimizer", True)):
        torch._dynamo.reset()
        graphs.clear()
        compiled_layers.uncompile_layers(model)
        compiled_layers.compile_layers(model, backend=counting_backend)
        if split:
            torch._dynamo.config.optimize_ddp = True  # dynamo's default, which compile_layers turns off
        ddp.zero_grad(set_to_none=True)
        ddp(input_ids=ids, labels=ids).loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        passes[name] = {"optimize_ddp": torch._dynamo.config.optimize_ddp, "graphs": list(graphs),
                        "grad_checksum": float(sum(g.double().abs().sum() for g in grads))}
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps({
        "world_size": ctx.world_size, "layers": len(model.get_base_model().model.layers),
        "layer_lora_bytes": layer_bytes, "passes": passes}))
    freetune.distributed.cleanup()


if __name__ == "__main__":
    main()
