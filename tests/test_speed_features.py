"""freetune.speed: training installs the speed features the plan chose, in freetune.speed.FEATURES' order, says why
one the plan chose steps aside, and undoes what it installed when training ends.

One CPU run of the tiny 4-bit model (~25 s of CPU): the fused LoRA layers and the chunked MLP apply on a CPU, the
CUDA graphs the plan asks for cannot (no GPU) and say so.
"""

import gc
import re
from pathlib import Path

import torch

from freetune import speed
from freetune.speed import host_embeddings, lora_kernel
from test_fast_path import run_paths, varied_rows
from test_kernels import quantized_lora_model


def test_each_feature_module_exposes_one_feature_in_the_listed_order():
    features = speed.features()
    assert len(features) == len(speed.FEATURES) == len({f.name for f in features})
    for module, feature in zip(speed.FEATURES, features):
        assert feature.install.__module__ == f"freetune.speed.{module}"  # each module installs its own


def test_training_installs_the_chosen_features_in_order_says_why_one_steps_aside_and_undoes_them(
        tiny_model_dir, tmp_path, capsys, monkeypatch):
    """...and saves the adapter before it undoes them, frees the optimizer's moments first, and leaves the input
    embeddings in host RAM (their return to the GPU was the 8B run's peak): the trained model still computes the same
    logits there."""
    import freetune
    from freetune.plan import Plan
    from transformers import TrainerCallback

    seen = {}

    class Optimizer(TrainerCallback):
        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            seen["optimizer"] = getattr(optimizer, "optimizer", optimizer)  # under accelerate's wrapper
            seen["moments"] = len(seen["optimizer"].state)

    real_save = freetune.train._save

    def save(trainer, *args, **kwargs):
        seen["installed_at_save"] = lora_kernel.casts_once(trainer.model)
        return real_save(trainer, *args, **kwargs)

    monkeypatch.setattr(freetune.train, "_save", save)

    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                micro_batch=2, grad_accum=1, gradient_checkpointing=False, batching="padding_free",
                lora_kernel="fused", mlp_kernel="chunked", cuda_graph_tokens=64, optimizer="adamw_torch",
                embeddings_on_host=True)
    model = quantized_lora_model(tiny_model_dir, torch.float32)
    # As host_embeddings.to_host leaves a table it moved off a GPU (on this machine the table's home is the CPU).
    host_embeddings.attach(model.get_input_embeddings(), torch.device("cpu"))
    paths = run_paths(tmp_path, "speed")
    config = freetune.sft_config.make_config(paths, plan, max_steps=2, learning_rate=1e-3, max_length=64,
                                        logging_steps=1, save_steps=100, save_total_limit=2, seed=0)
    tokenizer = freetune.model.load_tokenizer(str(tiny_model_dir))
    summary = freetune.train.train(model, tokenizer, varied_rows(), config, plan=plan, paths=paths, resume=False,
                                   extra_callbacks=[Optimizer()])
    out = capsys.readouterr().out

    assert summary["steps"] == 2 and summary["last_loss"] == summary["last_loss"]  # trained, loss not NaN
    lora = re.search(r"^LoRA kernel: fused on (\d+) of \1 LoRA layers \(freetune\.speed\.lora_kernel\); their weights "
                     r"cast to 16 bits once per forward, all together\.$", out, re.M)
    graphs = re.search(r"^CUDA graphs: off \((.*)\)\.$", out, re.M)
    mlp = re.search(r"^MLP kernel: (\d+) of \1 MLPs in chunks of 2048 tokens \(freetune\.speed\.mlp\)\.$", out, re.M)
    assert lora and graphs and mlp, out
    assert int(lora.group(1)) > 0 and int(mlp.group(1)) > 0
    assert "no GPU" in graphs.group(1)
    assert lora.start() < graphs.start() < mlp.start()  # FEATURES' order
    assert "Sampler:" not in out and "torch.compile:" not in out  # not chosen: nothing to say
    # Undone: no cast-once hook or mark left on the model, the garbage collector no longer frozen.
    assert not lora_kernel.casts_once(model) and not model._forward_pre_hooks
    assert gc.get_freeze_count() == 0
    # The adapter was written while the features were still installed; the optimizer's moments (one entry per LoRA
    # weight while training) are gone.
    assert seen["installed_at_save"] is True and (Path(paths.adapter) / "adapter_config.json").is_file()
    assert seen["moments"] > 0 and len(seen["optimizer"].state) == 0
    # The input embeddings are still looked up in host RAM, and give what the module's own lookup gives.
    embedding = model.get_input_embeddings()
    assert embedding.forward.__func__ is host_embeddings._host_forward
    ids = torch.randint(0, embedding.num_embeddings, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(embedding(ids), torch.nn.functional.embedding(ids, embedding.weight))
