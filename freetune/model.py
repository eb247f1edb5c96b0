"""The 4-bit base model and its LoRA adapter (QLoRA), loaded the way the preflight plan says.

Why each step:
- NF4 with double quantisation: 4-bit weights (~0.5 byte/param) plus quantised quantisation constants; the
  matmuls run in the plan's compute dtype (fp16 on a T4, bf16 on Ampere+, fp32 on a CPU).
- The non-quantised weights (norms, embeddings) load in the plan's dtype, not the config's: a checkpoint that
  says bfloat16 on a T4 otherwise makes LoRA/AMP fail with `_amp_foreach_non_finite_check_and_unscale_cuda not
  implemented for 'BFloat16'`.
- prepare_model_for_kbit_training upcasts norms to fp32 and enables input gradients for checkpointing;
  gradient checkpointing uses use_reentrant=False (the reentrant variant breaks with DDP and frozen inputs).
- LoRA weights are kept in fp32 (peft's autocast_adapter_dtype): fp16 master weights underflow small updates.
"""

from __future__ import annotations

import os
from pathlib import Path

from freetune import params, templates
from freetune.distributed import context, print0
from freetune.errors import FreetuneError, reason
from freetune.platform import require_hub
from freetune.plan import Plan
from freetune.reach import peft_bnb as peft_bnb_reach
from freetune.reach import transformers as transformers_reach
from freetune.speed import bnb_cpu
from freetune.speed.attention import VARLEN_ATTENTION, register_attention


def _check_model_source(model_id: str) -> None:
    path = Path(model_id).expanduser()
    looks_local = model_id.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path / "config.json").exists():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FreetuneError(f"Model folder {str(path)!r} {what}. Set `model_id` to a hub id such as "
                            f"'Qwen/Qwen2.5-Coder-1.5B-Instruct' or to a folder saved with save_pretrained().")
    if not looks_local:
        require_hub(f"the model {model_id!r}", "model_id")


def load_tokenizer(model_id: str, chat_template: str = "auto"):
    """The model's tokenizer; chat_template: "auto" keeps its own chat template, a name from
    freetune.templates.TEMPLATES ("chatml", "llama3", "zephyr") replaces it (a base model has none)."""
    from transformers import AutoTokenizer

    _check_model_source(model_id)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError) as exc:  # missing files; a tokenizer class transformers does not know
        raise FreetuneError(f"Could not load the tokenizer of {model_id!r}: {reason(exc)}. Check `model_id`, "
                            f"that this machine is online, and HF_TOKEN for gated models.") from exc
    templates.apply(tokenizer, chat_template, model_id)
    if tokenizer.pad_token is None:
        # A pad token equal to EOS would hide EOS from the loss (padding is masked): prefer a distinct token.
        tokenizer.pad_token = tokenizer.unk_token or tokenizer.eos_token
    return tokenizer


def check_chat_template(tokenizer, dataset) -> str:
    """Make sure the tokenizer can mark what to learn in this data; returns how the loss will be masked."""
    conversational = "messages" in dataset.column_names or not isinstance(dataset[0]["prompt"], str)
    if not conversational:
        return "completion only (prompt/completion text)"
    if not tokenizer.chat_template:
        raise FreetuneError("The data is chat-shaped but the model's tokenizer has no chat template (a base model?). "
                            f"{templates.describe_choices(tokenizer)} Or use an instruct/chat model.")
    if "messages" in dataset.column_names:
        templates.training_template(tokenizer)  # TRL's own check, before the model loads: names what to set
        return "assistant turns only (chat template with generation markers)"
    return "completion only (chat prompt/completion)"


def cap_gpu_memory(cap_gib: float, device: int = 0) -> None:
    """Let this process use at most cap_gib of the GPU: emulates a smaller card (a 4 GB laptop GPU, a T4's
    ~14.5 usable GiB) on a bigger one. Allocations past the cap fail with the same out-of-memory error."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory / 2**30
    if cap_gib >= total:
        raise FreetuneError(f"gpu_memory_cap_gib={cap_gib} is not below this GPU's {total:.1f} GiB; use 0 for no cap.")
    torch.cuda.set_per_process_memory_fraction(cap_gib / total, device)
    print(f"GPU memory capped at {cap_gib:.2f} of {total:.1f} GiB (emulating a smaller card)", flush=True)


def nf4_config(compute_dtype, storage=None):
    """QLoRA's 4-bit quantisation (transformers' BitsAndBytesConfig): NF4 with double quantisation, the matmuls in
    compute_dtype. storage: the dtype the packed 4-bit weights are kept in (None: uint8)."""
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype, bnb_4bit_quant_storage=storage or torch.uint8)


def load_base_model(model_id: str, plan: Plan, *, local_rank: int = 0, gradient_checkpointing: bool | None = None,
                    quantize: bool = True, memory_cap_gib: float = 0.0):
    """The base model in 4-bit NF4 (double quantisation), prepared for k-bit training on this rank's device.

    gradient_checkpointing: None follows the plan."""
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM

    _check_model_source(model_id)
    if memory_cap_gib and plan.layout.device == "cuda":
        cap_gpu_memory(memory_cap_gib, local_rank)
    if gradient_checkpointing is None:
        gradient_checkpointing = plan.memory.checkpointing
    if plan.kernels.attention == VARLEN_ATTENTION:
        register_attention()  # transformers must know the name before from_pretrained
    if quantize and plan.layout.device == "cpu":
        bnb_cpu.ensure_correct_dequantize()  # some CPUs' native 4-bit kernels dequantise odd-sized layers wrongly
    # The non-quantised weights load in the compute dtype (fp16 on a T4 whatever the config says).
    kwargs = dict(dtype=plan.precision.torch_dtype, attn_implementation=plan.kernels.attention)
    fsdp = plan.layout.kind == "fsdp"
    if quantize:
        # FSDP shards floating-point tensors only, and flattens one dtype per wrapped decoder layer: the packed
        # 4-bit weights are stored in the compute dtype (same bytes, 2 or 4 weights per element) so that
        # they shard beside the layer's norms. uint8 storage fails there ("Integer parameters are unsupported")
        # or, under FSDP2, silently loses the quantisation state (accelerate issue #3983).
        kwargs["quantization_config"] = nf4_config(plan.precision.torch_dtype, storage=plan.precision.torch_dtype if fsdp else None)
    if fsdp:
        # A model that does not fit one GPU is quantised in host memory (by global rank 0 alone, see
        # _load_fsdp_rank0_only), and FSDP then moves it to the GPU one wrapped decoder layer at a time, keeping
        # 1/N of each. device_map must not name a GPU here.
        kwargs["device_map"] = {"": "cpu"}
    elif plan.layout.device == "cpu":
        kwargs["device_map"] = {"": "cpu"}  # bitsandbytes would put a 4-bit model on a GPU that a CPU plan ignores
    elif plan.layout.device == "cuda":
        # One full copy per process on its own GPU (DDP). Never "auto"/"balanced": those split the layers
        # across GPUs, which runs them one after another, slower than one GPU.
        kwargs["device_map"] = {"": local_rank}
    print0(f"Loading {model_id}" + (" in 4-bit NF4" if quantize else "") + " ...")
    try:
        if fsdp and quantize and _distributed():  # unquantised models: transformers' own rank-0 loading does it
            model = _load_fsdp_rank0_only(model_id, kwargs)
        else:
            model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    except OSError as exc:
        raise FreetuneError(f"Could not load model {model_id!r}: {reason(exc)}. Check `model_id`, that this "
                            f"machine is online, and HF_TOKEN for gated models.") from exc
    if fsdp or (quantize and plan.precision.frozen_dtype != "float32"):
        # Not prepare_model_for_kbit_training: its fp32 upcast of norms and embeddings would mix dtypes inside
        # a wrapped layer, which FSDP cannot flatten, and on a GPU only doubles what frozen weights and the residual
        # stream take (Plan.frozen_dtype). The rest of what it does, done here: freeze the base, let gradients reach
        # the checkpointed layers' inputs.
        for param in model.parameters():
            param.requires_grad_(False)
        model.enable_input_require_grads()
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif quantize:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # the KV cache is useless in training and conflicts with checkpointing
    if quantize and plan.layout.device == "cpu":
        peft_bnb_reach.keep_cpu_inference_layout(model)
    return model


def attach_lora(model, *, rank: int, alpha: int, dropout: float, target_modules: str | list[str] = "all-linear",
                seed: int | None = None):
    """Wrap the model with a LoRA adapter; returns (peft_model, trainable, total) parameter counts.

    seed: seeds LoRA's random A matrices, so two runs with the same seed start from the same adapter.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    params.require(lora_rank=rank, lora_alpha=alpha, lora_dropout=dropout)  # else peft blames target_modules
    if seed is not None:
        set_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                        bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config, autocast_adapter_dtype=True)
    except ValueError as exc:
        if "lora_dropout" in str(exc):  # peft 0.21's ParamWrapper (a mixture's experts): "does not work with ..."
            raise FreetuneError(f"LoRA could not attach: {exc} peft adapts this model's experts through its "
                                f"ParamWrapper, which takes no dropout. Set lora_dropout = 0.0") from exc
        raise FreetuneError(f"LoRA could not attach to {target_modules!r}: {exc}. {targets_advice(model)}") from exc
    trainable, total = peft_model.get_nb_trainable_parameters()
    return peft_model, trainable, total


def targets_advice(model) -> str:
    """What to set lora_targets to: values the parameters cell accepts (a string: 'all-linear' or a regular
    expression peft matches against the full module names), built from this model's own linear layers."""
    import torch

    names = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] != "lm_head"})
    example = f"'.*({'|'.join(names[:2])})'" if names else "'.*(q_proj|v_proj)'"
    shown = f" Its linear layers: {', '.join(names)}." if names else ""
    return (f"Set `lora_targets` to 'all-linear' (every linear layer), or to a regular expression of module names, "
            f"e.g. {example}.{shown}")


def adapter_dtype_guard(dtype: str = "float32"):
    """A TrainerCallback that puts the trainable (LoRA) weights back in `dtype` once the trainer is built.

    TRL's SFTTrainer casts the trainable weights of a quantised model to bfloat16 in its constructor (following
    the QLoRA paper). On a T4 that is exactly the failure freetune exists to prevent: fp16 AMP's gradient
    unscaling then meets bf16 gradients and stops with `_amp_foreach_non_finite_check_and_unscale_cuda not
    implemented for 'BFloat16'` (reproduced on an H200 forced onto the fp16 path). fp32 LoRA weights also keep
    small updates that bf16 would round away. on_init_end runs after that cast and before the optimizer exists.
    """
    from transformers import TrainerCallback

    class _AdapterDtypeGuard(TrainerCallback):
        def on_init_end(self, args, state, control, model=None, **kwargs):
            import torch

            target = getattr(torch, dtype)
            recast = 0
            for param in model.parameters():
                if param.requires_grad and param.dtype != target:
                    param.data = param.data.to(target)
                    recast += 1
            if recast and state.is_world_process_zero:
                print(f"LoRA weights kept in {dtype} ({recast} tensors the trainer had cast to 16-bit).", flush=True)

    return _AdapterDtypeGuard()


# ------------------------------------------------------------------------------------ FSDP: one host copy --

def _distributed() -> bool:
    import torch.distributed as dist

    return context().distributed and dist.is_available() and dist.is_initialized()


# Seconds the other ranks wait for rank 0 to load the model (download included) under FSDP.
LOAD_TIMEOUT_S = int(os.environ.get("FREETUNE_LOAD_TIMEOUT_S", str(2 * 3600)))


def _load_fsdp_rank0_only(model_id: str, kwargs: dict):
    """The 4-bit model for FSDP with one copy of its weights in host memory for the whole job, not one per rank.

    transformers loads only on rank 0 under FSDP for ordinary models, but not for quantised ones (5.17 skips its
    rank-0-only path when a quantizer is set), and bitsandbytes' quantisation state (absmax, code, nested
    constants) is neither a parameter nor a buffer, so FSDP's sync_module_states could not carry it anyway.
    So here:
    - global rank 0 loads and quantises the model as usual (on the CPU: device_map cpu);
    - it broadcasts, for each 4-bit layer, the packed weight's shape and dtype and its quantisation state (small:
      ~1/60 of the 4-bit bytes, pickled through the process group);
    - every other rank builds the same module tree without reading the weights: parameters on the meta device
      (buffers such as the rotary frequencies computed as usual), the 4-bit layers rebuilt as bitsandbytes
      Linear4bit from the broadcast state, then every parameter given uninitialised host memory (never written
      on these ranks, so the OS commits no pages for it);
    - FSDP (sync_module_states=True, sft_config.fsdp_settings) moves each wrapped layer to the GPU and broadcasts rank
      0's values into it, so all ranks start from rank 0's weights.
    Tied weights (lm_head = embed_tokens) are tied as from_pretrained ties them. tests/test_multihost.py runs it
    on 2 CPU processes: the ranks without the weights grow by a fraction of rank 0's memory and train to the
    same losses.
    """
    from datetime import timedelta

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    # The other ranks wait while rank 0 downloads and quantises, which can take far longer than the job's collective
    # timeout (a few minutes: a dead rank must end the job quickly). So they wait on a CPU (gloo) group of their
    # own with a loading-sized timeout; a rank that dies meanwhile still ends the job through torchrun. The spec
    # travels through host memory, not through a GPU that may be near its cap.
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=LOAD_TIMEOUT_S))
    try:
        if dist.get_rank() == 0:
            model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
            dist.broadcast_object_list([transformers_reach.quantized_spec(model)], src=0, group=group)
            return model
        received = [None]
        dist.broadcast_object_list(received, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    return transformers_reach.skeleton_from_spec(model_id, kwargs, received[0])
