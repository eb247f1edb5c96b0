"""Every place freetune reaches into a library's internals outside its trainer class, each tagged with the release it
was written against; and the check, at import, that the installed releases are the tested ones.

freetune/trainer.py holds the other half: FreetuneTrainer, whose every method overrides one of transformers' or
TRL's. Why gathered in two files: what freetune changes below a library's public API can break on a new release
without an error (a renamed private attribute is simply never read again), so these are what to re-read when a
library is upgraded, and `.ci/newest` runs the tests that lean on them against the newest releases PyPI has.

The tested releases are the pins in pyproject.toml. check_versions() compares the installed ones once per process,
when this module is first imported (freetune.model imports it, before a model or tokenizer is loaded):
- the same release: nothing;
- another release of the same major version, newer or older: a warning naming each difference, the tested version
  and the pip command that installs it. Patch and minor releases rarely touch what is overridden here, and a user
  on a newer Colab image should still be able to train; the warning says where to look when something goes wrong;
- another major version (transformers 6, peft 1, ...): FreetuneError, before any model loads. Major releases rework
  the internals these overrides rely on, and a run would fail hours in, or train wrongly without failing.
check_overridden() checks FreetuneTrainer against the installed classes when freetune.trainer is imported: a method
the library no longer has would never be called, so that is an error too.
"""

from __future__ import annotations

import math
import os
import re
import types
import warnings
from pathlib import Path

from freetune.batching import AlignedPaddingFree
from freetune.errors import FreetuneError

# The libraries whose internals freetune overrides (torch's are tagged too, but its version is the platform's).
WATCHED = ("transformers", "trl", "peft", "bitsandbytes", "accelerate")
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


class VersionWarning(UserWarning):
    """An installed library is another release than the one freetune is tested with."""


# ---- versions ---------------------------------------------------------------------------------------------------

def tested_versions() -> dict[str, str]:
    """{library: version} as pyproject.toml pins them: read from freetune's installed metadata, or from the file in a
    source checkout that is not installed; empty when neither is there."""
    from importlib import metadata

    try:
        requirements = metadata.requires("freetune") or []
    except metadata.PackageNotFoundError:
        requirements = re.findall(r'"([^"]+)"', PYPROJECT.read_text()) if PYPROJECT.is_file() else []
    pins = {}
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", requirement)
        if match and match.group(1).lower() in WATCHED:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def installed_versions(names) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass  # not installed: the import that needs it says so
    return found


def check_versions(installed: dict[str, str] | None = None, tested: dict[str, str] | None = None) -> list[str]:
    """Compare the installed releases of WATCHED with the tested ones (pyproject.toml): warn once, naming each
    difference within a major version; raise FreetuneError for another major version. Returns the differences."""
    tested = tested_versions() if tested is None else tested
    installed = installed_versions(tested) if installed is None else installed
    differ = {name: have for name, have in installed.items() if name in tested and have != tested[name]}
    if not differ:
        return []
    lines = [f"{name} {have} is installed, freetune is tested with {tested[name]}" for name, have in differ.items()]
    install = "pip install " + " ".join(f"'{name}=={tested[name]}'" for name in differ)
    where = ("freetune changes parts of these libraries' internals (freetune/overrides.py, freetune/trainer.py), "
             "which another release may have changed; the tested versions are the pins in freetune's pyproject.toml")
    majors = [name for name, have in differ.items() if have.split(".")[0] != tested[name].split(".")[0]]
    if majors:
        raise FreetuneError(f"{'; '.join(lines)}: another major version of {', '.join(majors)}. {where}. Install the "
                            f"tested versions before training: {install}")
    if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
        warnings.warn(f"{'; '.join(lines)}. {where}. If training fails or looks wrong, install them: {install}",
                      VersionWarning, stacklevel=2)
    return lines


def written_against(release: str):
    """Tag a method that overrides a library's with the release it was written against ("transformers 5.17");
    check_overridden() finds the overrides by their tag."""
    def tag(method):
        method.written_against = release
        return method
    return tag


def check_overridden(cls: type) -> list[str]:
    """The tagged methods of `cls`; raises FreetuneError when no base class has one any more (the library would never
    call the override)."""
    tagged = {name: fn.written_against for name, fn in vars(cls).items() if hasattr(fn, "written_against")}
    missing = [f"{name} ({release})" for name, release in tagged.items()
               if not any(name in vars(base) for base in cls.__mro__[1:])]
    if missing:
        versions = ", ".join(f"{name} {version}" for name, version in installed_versions(WATCHED).items())
        raise FreetuneError(f"{cls.__name__} overrides {', '.join(missing)}, which the installed libraries ({versions}) "
                            f"no longer have: the override would never run. Install the versions pinned in freetune's "
                            f"pyproject.toml.")
    return sorted(tagged)


# ---- TRL 1.16: the collator, the loss head ------------------------------------------------------------------------

def apply_batching(trainer, batching: str) -> None:
    """Switch an SFTTrainer's collator to padding-free (TRL 1.16: its DataCollatorForLanguageModeling's padding_free,
    and the trainer's). TRL refuses padding_free=True with max_length at construction (its check predates its own
    truncation step), yet truncates rows to max_length during dataset preparation whenever packing is off: so the
    trainer is built padded, with rows truncated, and only the collator is switched. "grouped" is set in the config
    (train_sampling_strategy). The padding-free batches carry freetune.batching.PAD_KEY, which
    freetune.trainer.FreetuneTrainer takes out before the model is called."""
    if batching != "padding_free":
        return
    collator = trainer.data_collator
    if isinstance(collator, AlignedPaddingFree):
        return
    if not hasattr(collator, "padding_free"):
        raise TypeError(f"padding-free batching needs TRL's DataCollatorForLanguageModeling, not {type(collator)}")
    collator.padding_free = True
    trainer.padding_free = True
    trainer.data_collator = AlignedPaddingFree(collator)


def set_loss_tile_tokens(tokens: int) -> None:
    """Tokens per tile of TRL's chunked loss head (TRL 1.16: trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, read at
    every call). Each tile holds tokens x 32,768 logits in the compute dtype: 256 MiB at TRL's 4,096
    tokens, a real share of a 4 GB card; smaller tiles only mean more, smaller matmuls. 0 keeps TRL's."""
    if tokens:
        import trl.kernels.chunked_logprob as chunked

        chunked.TOKEN_CHUNK_SIZE = int(tokens)


class _CacheKept:
    """A device module (torch.cuda) whose empty_cache does nothing; everything else is the module's."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def empty_cache(self) -> None:
        return None


def keep_cuda_cache_between_steps(trainer) -> bool:
    """TRL 1.16: its activation offloading's context (trl.models.activation_offloading.OffloadActivations, the
    trainer's maybe_activation_offload_context) empties the CUDA cache on entering, i.e. every micro-batch, whenever
    bitsandbytes is imported. The leak it guards against (tensors its tracker kept from the previous step, ~0.6 GiB a
    step in TRL's QLoRA runs) is removed by the tracker's clear just before it; the emptying itself gives every cached
    block back to the driver, which waits for the GPU, and the next step asks the driver for them again (a profiled
    step at 4 GiB: 39 cudaMallocs of ~0.1 ms each), on a step that is bound by the host. Here the context keeps its
    device module but without empty_cache: the allocator still frees its cache by itself when an allocation would not
    fit otherwise (the memory cap included). Returns whether the context was changed."""
    context = getattr(trainer, "maybe_activation_offload_context", None)
    module = getattr(context, "device_module", None)
    if module is None or isinstance(module, _CacheKept) or not hasattr(module, "empty_cache"):
        return False
    context.device_module = _CacheKept(module)
    return True


# ---- transformers 5.17: TrainingArguments, the order of a step's events --------------------------------------------

def one_gpu_only(config) -> None:
    """transformers 5.17: the GPU count a TrainingArguments computes on its first .device (_n_gpu), set to 1. One
    process that sees two GPUs makes the Trainer wrap the model in nn.DataParallel, which SFTTrainer refuses."""
    _ = config.device
    config._n_gpu = 1


# fp16 AMP skips a step whose gradients overflow (the weights stay as they were) and halves its loss scale, from
# 65,536: a few such steps at the start are the scale finding its level. A scale fallen this far (16 halvings)
# means fp16 cannot hold these gradients at all.
MIN_FP16_LOSS_SCALE = 1.0


class NonFiniteGuard:
    """A TrainerCallback that stops the run at the first log step whose loss (or gradient norm) is NaN or inf, and
    keeps that step from being saved: transformers 5.17's _maybe_log_save_evaluate logs a step before it saves it,
    so should_save cleared at the log is what the save reads (FreetuneTrainer._save_checkpoint refuses NaN weights
    at the saves between log steps). The values are the ones the log step already copied to the host: no sync of
    its own (the Trainer's per-micro-batch NaN filter is off for that reason, see freetune.train.make_config).
    Under fp16 AMP an infinite gradient norm is a skipped step, a problem only once the loss scale has collapsed.
    `.reason` says what it saw (None: nothing)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Guard(TrainerCallback):
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

        return _Guard()


# ---- torch 2.13: dynamo and functorch settings, compiled modules ---------------------------------------------------

def compile_settings() -> None:
    """The process-wide torch.compile settings freetune.kernels.compile_layers needs (torch 2.13's dynamo and functorch
    config). A layer dynamo cannot compile runs eagerly (suppress_errors) rather than stopping the run."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    # The fused function dequantises each weight again in its backward rather than keep a 16-bit copy (the whole
    # model's worth over a step without checkpointing, more than a 4 GiB card has spare). Common-subexpression
    # elimination of the joint forward-backward graph would merge the two
    # dequantisations into one whose output the forward then saves; without it the backward keeps its own.
    import torch._functorch.config

    torch._functorch.config.cse = False
    # One compiled graph serves every layer of a model (same code, different weights): the cache must hold at
    # least one entry per layer's guards.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # Under DDP, dynamo's DDPOptimizer cuts every compiled graph where a gradient bucket fills, so that each
    # bucket's all-reduce can start before the rest of the backward. The layers are compiled one by one, so DDP
    # already gets each layer's gradients as soon as its backward ends; the cut only split every layer into two
    # graphs (its first bucket is smaller than one LoRA layer's gradients): twice the compiled-graph calls per
    # step, host time that a launch-bound step pays in full, and more peak memory per GPU (docs/history.md).
    torch._dynamo.config.optimize_ddp = False
    # Python floats (the LoRA scaling, dropout's p, the attention scale, the norms' eps) as constants of the graph, not
    # as its inputs: as inputs each one was wrapped into a 0-dim float64 tensor and guarded on, at every call of every
    # layer (torch._as_tensor_fullprec, a few thousand calls a step in a sampled host profile). They never change
    # during a run; a changed one makes a new graph.
    torch._dynamo.config.specialize_float = True


def uncompile(module) -> bool:
    """torch 2.13: drop what nn.Module.compile installed on `module` (_compiled_call_impl); True if there was any."""
    if getattr(module, "_compiled_call_impl", None) is None:
        return False
    module._compiled_call_impl = None
    return True


# ---- transformers 5.17 / torch 2.13: the checkpoint function, cuBLAS workspaces (freetune.graphed_layers) -------

def replace_checkpoint_function(layer, function):
    """transformers 5.17: a GradientCheckpointingLayer with checkpointing on calls
    `self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)` (gradient_checkpointing_enable sets
    the attribute on each layer). Put `function` there; returns the one it had (give it back the same way)."""
    previous = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = function
    return previous


def free_cublas_workspaces() -> bool:
    """torch 2.13: free the cuBLAS workspaces torch keeps per handle and stream (torch._C._cuda_clearCublasWorkspaces,
    after the GPU is done with them); the next matmul on a stream makes its own again. False where torch lacks it."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    torch.cuda.synchronize()
    clear()
    return True


# ---- peft 0.21 / bitsandbytes 0.50: the layers the fused LoRA kernel stands in for (freetune.kernels) --------------

def fusable(module) -> str:
    """'' when `module` can take the fused forward, else why not (peft 0.21's lora.bnb.Linear4bit and its adapter
    dicts, bitsandbytes 0.50's Linear4bit and QuantState)."""
    import torch

    try:
        from bitsandbytes.nn import Linear4bit
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError as exc:
        return f"bitsandbytes/peft unavailable: {exc}"
    if not isinstance(module, LoraLinear4bit):
        return "not a peft LoRA layer over a 4-bit base"
    base = module.base_layer
    if not isinstance(base, Linear4bit) or getattr(base.weight, "quant_state", None) is None:
        return "base layer has no quantisation state"
    if getattr(base.weight.quant_state, "packing_format_for_cpu", False):
        return "weight repacked for CPU inference"
    if base.weight.dim() != 2 or base.weight.shape[1] != 1:  # _dequantize reads the (n, 1) layout Linear4bit keeps
        return f"packed weight of shape {tuple(base.weight.shape)}"
    if module.lora_variant or any(module.use_dora.values()):
        return "a LoRA variant (DoRA, ...) has its own forward"
    if len(module.lora_A) != 1:
        return "several adapters"
    dropout = next(iter(module.lora_dropout.values()))
    if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
        return f"dropout module {type(dropout).__name__}"
    if base.weight.quant_state.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"compute dtype {base.weight.quant_state.dtype}"
    return ""


def single_quantised(quant_state, absmax) -> None:
    """bitsandbytes 0.50: a double-quantised weight's QuantState made single-quantised, its absmax values `absmax`
    (dequantised once to fp32 by freetune.kernels.quant_args). The 8-bit values and their own state go (nothing reads
    them any more); bitsandbytes' own kernels (generation, merging an adapter) read the fp32 values as they read any
    single-quantised weight's."""
    quant_state.absmax = absmax
    quant_state.nested = False
    quant_state.state2 = None
    quant_state.offset = None


# transformers 5.17's Llama, Qwen2, Qwen3 and Mistral MLPs: forward is down_proj(act_fn(gate_proj(x)) * up_proj(x)).
SWIGLU_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


def fusable_mlp(module) -> str | None:
    """None when `module` is not one of transformers 5.17's SwiGLU MLPs (SWIGLU_MLPS); '' when freetune.fused_mlp can
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


def replace_forward(module, forward) -> None:
    """A module's forward replaced on the instance (peft 0.21's LoRA layers, a torch nn.Embedding): the class's own
    stays reachable as type(module).forward, which the replacement calls for everything it does not do itself."""
    module.forward = types.MethodType(forward, module)


def restore_forward(module) -> None:
    """Undo replace_forward: the class's own forward again."""
    module.__dict__.pop("forward", None)


# ---- bitsandbytes 0.50: its CPU 4-bit kernel and layouts (freetune.bnb_cpu) -----------------------------------------

_BNB_CPU_KERNELS: list = []  # the torch.library.Library holding freetune's kernel: freed, it would unregister it


def register_cpu_dequantize(dequantize) -> None:
    """bitsandbytes 0.50 / torch 2.8-2.13: `dequantize` registered as the CPU kernel of bitsandbytes' dequantize_4bit
    op, for every shape (the CUDA kernels are untouched).

    bitsandbytes registers its own CPU kernel from Python (torch.library.register_kernel). torch before 2.13 refuses
    a second register_kernel over another library's Python kernel ("already a kernel registered from python
    overriding dequantize_4bit's behavior"); Library.impl with allow_override=True (torch 2.8 on; the default from
    2.13) replaces it on every release. torch.compiler.disable, as register_kernel does: dynamo never traces into it."""
    import torch

    library = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        library.impl("dequantize_4bit", torch.compiler.disable(dequantize), "CPU", allow_override=True)
    _BNB_CPU_KERNELS.append(library)


def _keep_out_of_cpu_repacking(model, partial_blocks_only: bool) -> int:
    """bitsandbytes 0.50: turn off the AVX-512 bf16 inference repacking of Linear4bit layers (all of them, or those
    whose input size is not a whole number of quantisation blocks); returns how many were turned off."""
    from bitsandbytes.nn import Linear4bit

    kept = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit) or not getattr(module, "support_avx512bf16_for_cpu", False):
            continue
        state = getattr(module.weight, "quant_state", None)
        if partial_blocks_only and (state is None or not module.in_features % state.blocksize):
            continue
        module.support_avx512bf16_for_cpu = False
        kept += 1
    return kept


def keep_cpu_inference_layout(model) -> int:
    """bitsandbytes 0.50: keep its Linear4bit layers whose input size is not a whole number of blocks out of the CPU
    inference repacking (AVX-512 bf16 CPUs, eval mode), which cannot reshape them; returns how many."""
    return _keep_out_of_cpu_repacking(model, partial_blocks_only=True)


def keep_training_layout(model) -> int:
    """bitsandbytes 0.50: keep every Linear4bit layer of a model that trains out of the CPU inference repacking; returns how many.

    bitsandbytes 0.50.2 repacks a layer's 4-bit weight for its AVX-512 bf16 inference kernel the first time the layer
    runs in eval mode without gradients (an evaluation between training steps) and never packs it back: every later
    training step then runs the inference kernel, whose in-place bias add on a tensor that needs its gradient raises
    "a view of a leaf Variable that requires grad is being used in an in-place operation"."""
    return _keep_out_of_cpu_repacking(model, partial_blocks_only=False)


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


check_versions()
