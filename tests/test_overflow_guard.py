"""A NaN/inf loss stops the run at a log step, keeps the last good checkpoint and writes nothing poisoned.

Real training runs on a CPU (the tiny model, TRL's SFTTrainer through freetune.train.train). The overflow is made
real: after one step a callback writes inf into one LoRA weight, as an fp16 overflow would leave it, and the model's
next forward really produces a non-finite loss.
"""

import math

import pytest
import torch
from resume_driver import synthetic_rows

import freetune
from freetune.checkpoint import complete_checkpoints
from freetune.errors import FreetuneError
from freetune.platform import Paths
from freetune.plan import Plan

pytestmark = pytest.mark.slow


def poison_after(step: int):
    from transformers import TrainerCallback

    class Poison(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == step:
                lora_b = next(p for name, p in model.named_parameters() if "lora_B" in name)
                with torch.no_grad():
                    lora_b.fill_(math.inf)

    return Poison()


def run(tmp_path, model_dir, *, poison_at: int, logging_steps: int, save_steps: int, max_steps: int = 8):
    """Train until the guard stops it; returns (the FreetuneError's message, the run's Paths)."""
    import transformers

    run_dir = str(tmp_path / "run")
    paths = Paths.under(run_dir).make()
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa")
    transformers.set_seed(0)
    model = freetune.model.load_base_model(str(model_dir), plan)
    model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0)
    config = freetune.sft_config.make_config(
        paths, plan, max_steps=max_steps, micro_batch=2, grad_accum=1, learning_rate=5e-3, max_length=64,
        optimizer="adamw_torch", logging_steps=logging_steps, save_steps=save_steps, save_total_limit=2, seed=0)
    with pytest.raises(FreetuneError) as caught:
        freetune.train.train(model, freetune.model.load_tokenizer(str(model_dir)), synthetic_rows(), config,
                             plan=plan, paths=paths, extra_callbacks=[poison_after(poison_at)])
    return str(caught.value), paths


def saved_weights_finite(folder) -> bool:
    from safetensors.torch import load_file

    tensors = load_file(str(next(folder.glob("*.safetensors"))))
    return bool(tensors) and all(torch.isfinite(t).all() for t in tensors.values())


def test_a_non_finite_loss_at_a_log_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model_dir):
    # Logs and saves at steps 2, 4, ...: checkpoint-2 is good; the weights go bad after step 3; step 4's loss is
    # the first non-finite one the log sees, and step 4 is also a save step.
    message, paths = run(tmp_path, tiny_model_dir, poison_at=3, logging_steps=2, save_steps=2)
    assert "at step 4 the loss is nan" in message
    assert "checkpoint-2, is kept" in message and "Lower learning_rate (now 0.005; try 0.00125)" in message
    kept = complete_checkpoints(paths.checkpoints)
    assert [p.name for p in kept] == ["checkpoint-2"] and saved_weights_finite(kept[0])
    assert [p.name for p in paths_in(paths.checkpoints) if "checkpoint-" in p.name] == ["checkpoint-2"]  # not even
    # a part of checkpoint-4
    assert not any(paths_in(paths.adapter)), "no adapter of poisoned weights"
    assert "precision='bf16'" not in message  # an fp32 run: the fp16 advice would be wrong here


def test_a_save_between_log_steps_writes_no_poisoned_checkpoint(tmp_path, tiny_model_dir):
    # Logs at 4, 8; saves at 3, 6: the weights go bad right before step 3's save, which no log step guards.
    message, paths = run(tmp_path, tiny_model_dir, poison_at=3, logging_steps=4, save_steps=3)
    assert "at step 3 the adapter's weights hold NaN or inf" in message
    assert "No checkpoint was saved before it" in message
    assert not [p for p in paths_in(paths.checkpoints) if "checkpoint-" in p.name] and not any(paths_in(paths.adapter))


def paths_in(folder):
    from pathlib import Path

    return Path(folder).iterdir() if Path(folder).exists() else iter(())


def test_fp16_overflow_skips_are_tolerated_until_the_loss_scale_collapses():
    # Under fp16 AMP an infinite gradient norm means the step was skipped (the weights untouched) and the loss scale
    # halved; only a collapsed scale stops the run. The real GradScaler and accelerate's optimizer wrapper.
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.state import AcceleratorState
    from transformers import TrainerControl, TrainerState, TrainingArguments

    args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
    weight = torch.nn.Parameter(torch.zeros(2))
    Accelerator(cpu=True)  # the state an AcceleratedOptimizer reads; reset below for the tests after this one

    def verdict(loss, grad_norm, scaler):
        guard, state, control = freetune.train.NonFiniteGuard(), TrainerState(global_step=7), TrainerControl()
        optimizer = AcceleratedOptimizer(torch.optim.SGD([weight], lr=0.1), device_placement=False, scaler=scaler)
        guard.on_log(args, state, control, logs={"loss": loss, "grad_norm": grad_norm}, optimizer=optimizer)
        assert control.should_training_stop == (guard.reason is not None)
        return guard.reason

    try:
        fresh = torch.amp.GradScaler("cpu")  # starts at 65,536
        assert verdict(2.5, math.inf, fresh) is None
        assert verdict(2.5, math.inf, torch.amp.GradScaler("cpu", init_scale=0.5)) == (
            "at step 7 the gradient norm is inf with fp16's loss scale down to 0.5")
        assert verdict(2.5, math.inf, None) == "at step 7 the gradient norm is inf"  # no scaler: the step was applied
        assert verdict(math.nan, 1.0, fresh) == "at step 7 the loss is nan"
        assert verdict(2.5, 1.0, fresh) is None
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
