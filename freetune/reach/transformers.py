"""transformers' internals freetune reaches into (outside FreetuneTrainer, freetune/trainer.py): TrainingArguments'
GPU count, the order of a step's log and save, the decoder layers' checkpoint function, the SwiGLU MLP classes, and
the 4-bit model from_pretrained builds (FSDP's one host copy, with bitsandbytes' and accelerate's parts of it).
Written against the releases in WRITTEN_AGAINST (the pins in pyproject.toml)."""

from __future__ import annotations

import functools
import math

from freetune.reach import versions  # noqa: F401  (imported for its check of the installed releases, first)

from transformers import TrainerCallback  # noqa: E402  (after the release check)

WRITTEN_AGAINST = {"transformers": "5.17", "accelerate": "1.15", "bitsandbytes": "0.50"}


# ---- transformers 5.17: TrainingArguments, the order of a step's events ---------------------------------------------

def one_gpu_only(config) -> None:
    """transformers 5.17: the GPU count a TrainingArguments computes on its first .device (_n_gpu), set to 1. One
    process that sees two GPUs makes the Trainer wrap the model in nn.DataParallel, which SFTTrainer refuses."""
    _ = config.device
    config._n_gpu = 1


# fp16 AMP skips a step whose gradients overflow (the weights stay as they were) and halves its loss scale, from
# 65,536: a few such steps at the start are the scale finding its level. A scale fallen this far (16 halvings)
# means fp16 cannot hold these gradients at all.
MIN_FP16_LOSS_SCALE = 1.0


class NonFiniteGuard(TrainerCallback):
    """A TrainerCallback that stops the run at the first log step whose loss (or gradient norm) is NaN or inf, and
    keeps that step from being saved: transformers 5.17's _maybe_log_save_evaluate logs a step before it saves it,
    so should_save cleared at the log is what the save reads (FreetuneTrainer._save_checkpoint refuses NaN weights
    at the saves between log steps). The values are the ones the log step already copied to the host: no sync of
    its own (the Trainer's per-micro-batch NaN filter is off for that reason, see freetune.sft_config.make_config).
    Under fp16 AMP an infinite gradient norm is a skipped step, a problem only once the loss scale has collapsed.
    `.reason` says what it saw (None: nothing)."""

    reason: str | None = None

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        logs = logs or {}
        loss, norm = logs.get("loss"), logs.get("grad_norm")
        bad = [f"the loss is {loss}"] if loss is not None and not math.isfinite(loss) else []
        if norm is not None and not math.isfinite(norm):
            scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer under fp16
            scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
            if scale is None or scale < MIN_FP16_LOSS_SCALE:
                bad.append(f"the gradient norm is {norm}" +
                           (f" with fp16's loss scale down to {scale:g}" if scale is not None else ""))
        if bad and self.reason is None:
            self.reason = f"at step {state.global_step} " + " and ".join(bad)
            control.should_training_stop = True
            control.should_save = False  # the log comes before the save of the same step
        return control


# ---- transformers 5.17: the decoder layers' checkpoint function (freetune.speed.cuda_graphs) -------------------------

def replace_checkpoint_function(layer, function):
    """transformers 5.17: a GradientCheckpointingLayer with checkpointing on calls
    `self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)` (gradient_checkpointing_enable sets
    the attribute on each layer). Put `function` there; returns the one it had (give it back the same way)."""
    previous = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = function
    return previous


# ---- transformers 5.17: the batch sampler the Trainer hands to the DataLoader (freetune.speed.sampler) ---------------

@functools.cache
def rank_balanced_sampler_class(deal):
    """transformers 5.17: a BatchRebalanceSampler whose rows per rank and micro-batch come from
    `deal(order, lengths, ranks, grad_accum)` (freetune.speed.sampler.step_rows). It overrides the private _assign,
    which the base class's private _yield_global_batch calls for every optimizer step's rows."""
    # A subclass of transformers' BatchRebalanceSampler: the Trainer hands that class to the DataLoader as its
    # batch_sampler and keeps accelerate from sharding it again (it is rank-aware already). Its own assignment
    # sizes micro-batches by a padded-cost model (more rows where rows are short), which would break the plan's
    # memory budget; this one keeps every micro-batch at micro_batch rows.
    import torch
    from transformers.trainer_pt_utils import BatchRebalanceSampler, get_length_grouped_indices

    class RankBalancedSampler(BatchRebalanceSampler):
        """Every rank draws the same random permutation (same seed, no communication) and takes its share of each
        optimizer step's rows from `deal`. group_by_length: the permutation is length-grouped first (padded
        batches on GPUs without a variable-length kernel), so a step's rows have similar lengths."""

        def __init__(self, *args, group_by_length: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.group_by_length = group_by_length

        def __iter__(self):
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            n = len(self.lengths)
            if self.group_by_length:
                order = get_length_grouped_indices(self.lengths, self.effective_batch_size, generator=g)
            elif self.shuffle:
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            size = self.effective_batch_size
            for step in range(self.num_global_batches):
                rows = order[step * size:(step + 1) * size]
                short = self.dp_size * self.grad_accum - len(rows)
                if short > 0:  # the last, partial step (drop_last off): at least one row per micro-batch
                    rows = rows + (order * math.ceil(short / n))[:short]
                yield from self._yield_global_batch(rows)

        def _assign(self, indices, lengths):
            # deal looks lengths up by dataset index (a padded last step may repeat an index).
            return deal(list(indices), self.lengths, self.dp_size, self.grad_accum)

    return RankBalancedSampler


# ---- transformers 5.17: the SwiGLU MLPs (freetune.speed.mlp) --------------------------------------------------------

# transformers 5.17's Llama, Qwen2, Qwen3 and Mistral MLPs: forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)).
SWIGLU_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


def fusable_mlp(module) -> str | None:
    """None when `module` is not one of transformers 5.17's SwiGLU MLPs (SWIGLU_MLPS); '' when freetune.speed.mlp can
    stand in for its forward; else why not."""
    import torch

    if type(module).__name__ not in SWIGLU_MLPS:
        return None
    act = getattr(module, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        return f"activation {type(act).__name__}, not SiLU"
    for name in ("gate_proj", "up_proj", "down_proj"):
        base = getattr(getattr(module, name, None), "base_layer", None)
        if base is None:
            return f"{name} has no LoRA adapter"
        if getattr(base, "bias", None) is not None:
            return f"{name} has a bias"
    return ""


# ---- transformers 5.17 / bitsandbytes 0.50 / accelerate 1.15: FSDP's one host copy (freetune.model) -----------------

def quantized_spec(model) -> dict:
    """What the other ranks need to rebuild rank 0's 4-bit layers without the weights
    (freetune.model._load_fsdp_rank0_only says how)."""
    import torch

    spec = {"layers": {}, "attributes": {}}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            spec["layers"][name] = dict(shape=tuple(weight.shape), dtype=str(weight.dtype).removeprefix("torch."),
                                        bias=module.bias is not None,
                                        state={k: v.cpu() if torch.is_tensor(v) else v
                                               for k, v in weight.quant_state.as_dict(packed=True).items()})
    spec["attributes"] = {k: getattr(model, k) for k in _QUANTIZED_MODEL_ATTRIBUTES if hasattr(model, k)}
    return spec


# What from_pretrained sets on a 4-bit model, read by peft (which LoRA layer class to use) and the Trainer.
_QUANTIZED_MODEL_ATTRIBUTES = ("is_loaded_in_4bit", "is_quantized", "quantization_method", "is_4bit_serializable")


def skeleton_from_spec(model_id: str, kwargs: dict, spec: dict):
    """The model's module tree with rank 0's 4-bit layout and unread (uninitialised) weights
    (freetune.model._load_fsdp_rank0_only)."""
    import bitsandbytes as bnb
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.quantizers import AutoHfQuantizer

    quant_config = kwargs["quantization_config"]
    config = AutoConfig.from_pretrained(model_id)
    config.quantization_config = quant_config
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=kwargs["dtype"],
                                                 attn_implementation=kwargs.get("attn_implementation"))
    for name, layer in spec["layers"].items():
        old = model.get_submodule(name)
        new = bnb.nn.Linear4bit(old.in_features, old.out_features, bias=layer["bias"],
                                compute_dtype=quant_config.bnb_4bit_compute_dtype,
                                compress_statistics=quant_config.bnb_4bit_use_double_quant,
                                quant_type=quant_config.bnb_4bit_quant_type,
                                quant_storage=getattr(torch, layer["dtype"]), device="meta")
        packed = torch.empty(layer["shape"], dtype=getattr(torch, layer["dtype"]), device="cpu")
        new.weight = bnb.nn.Params4bit.from_prequantized(packed, layer["state"], requires_grad=False, device="cpu",
                                                         module=new)
        if layer["bias"]:
            new.bias = old.bias  # still on meta; given memory below with the other parameters
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    given = {}  # id(meta parameter) -> its host replacement: tied parameters stay one parameter
    for module in model.modules():
        for pname, param in list(module._parameters.items()):
            if param is not None and param.is_meta:
                if id(param) not in given:
                    given[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="cpu"),
                                                          requires_grad=param.requires_grad)
                module._parameters[pname] = given[id(param)]
    model.tie_weights()  # as from_pretrained does (lm_head = embed_tokens where the config ties them)
    for key, value in spec["attributes"].items():
        setattr(model, key, value)
    model.hf_quantizer = AutoHfQuantizer.from_config(quant_config, pre_quantized=False)
    model.eval()  # as from_pretrained returns it
    return model


