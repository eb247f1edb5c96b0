"""What the Trainer feeds each rank under torchrun, with the plan freetune makes there (tests/test_rank_balance.py).

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/sampler_driver.py MODEL OUT_DIR

The plan (make_plan on this machine, under torchrun), its config (freetune.sft_config.make_config) and the trainer
freetune.train.train uses (freetune.trainer.FreetuneTrainer) build the training DataLoader; each rank walks one epoch of it and writes
OUT_DIR/rank<R>.json: the plan's sampler and, per micro-batch, the row ids it got and their real token counts.
Row i of the data set starts with token 10 + i, so the ids are read back from the batches themselves.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROWS, MICRO_BATCH, GRAD_ACCUM = 40, 2, 2


def row_lengths() -> list[int]:
    return [5 + (i * 37) % 40 for i in range(ROWS)]  # 5-44 tokens, in no order


def main() -> None:
    model_dir, out_dir = sys.argv[1], Path(sys.argv[2])
    from datasets import Dataset

    import freetune
    from freetune.platform import Paths
    from freetune.plan import make_plan
    from freetune.trainer import FreetuneTrainer

    ctx = freetune.distributed.init(timeout_s=60)
    run = out_dir / "run"
    paths = Paths.under(run)
    if ctx.is_main:
        paths.make()
    freetune.distributed.barrier()
    plan = make_plan(micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM)
    tokenizer = freetune.model.load_tokenizer(model_dir)
    model = freetune.model.load_base_model(model_dir, plan, local_rank=ctx.local_rank)
    model, _, _ = freetune.model.attach_lora(model, rank=4, alpha=8, dropout=0.0, seed=0)
    dataset = Dataset.from_dict({"input_ids": [[10 + i] + [5] * (n - 1) for i, n in enumerate(row_lengths())]})
    config = freetune.sft_config.make_config(paths, plan, max_steps=-1, micro_batch=MICRO_BATCH, grad_accum=GRAD_ACCUM,
                                        learning_rate=1e-4, max_length=64, optimizer="adamw_torch", seed=0)
    trainer = FreetuneTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer, plan=plan)
    batches = []
    for batch in trainer.get_train_dataloader():
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        batches.append({"rows": [int(r[0]) - 10 for r in ids],  # padding is on the right: the first token is real
                        "tokens": [int(m.sum()) for m in mask] if mask is not None else [int(ids.numel())]})
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps({
        "sampler": plan.layout.sampler, "why": plan.reasons.get("sampler"), "world_size": ctx.world_size,
        "sampler_class": type(trainer._get_train_sampler()).__name__, "batches": batches}))
    freetune.distributed.cleanup()


if __name__ == "__main__":
    main()
