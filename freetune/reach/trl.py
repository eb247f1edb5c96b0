"""TRL's internals freetune reaches into: the SFT collator's padding-free switch, the chunked loss head's tile size,
the activation-offloading context's cache emptying. Written against TRL 1.16 (the pin in pyproject.toml)."""

from __future__ import annotations

import warnings

from freetune.reach import versions  # imported first: the installed releases checked before any reach is used
from freetune.speed.batching import AlignedPaddingFree

WRITTEN_AGAINST = {"trl": "1.16"}


def apply_batching(trainer, batching: str) -> None:
    """Switch an SFTTrainer's collator to padding-free (TRL 1.16: its DataCollatorForLanguageModeling's padding_free,
    and the trainer's). TRL refuses padding_free=True with max_length at construction (its check predates its own
    truncation step), yet truncates rows to max_length during dataset preparation whenever packing is off: so the
    trainer is built padded, with rows truncated, and only the collator is switched. "grouped" is set in the config
    (train_sampling_strategy). The padding-free batches carry freetune.speed.batching.PAD_KEY, which
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
    if not tokens:
        return
    import trl.kernels.chunked_logprob as chunked

    if not hasattr(chunked, "TOKEN_CHUNK_SIZE"):  # assigning it would change nothing, silently
        why = versions.gone("trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE", f"TRL {WRITTEN_AGAINST['trl']}")
        warnings.warn(f"loss_tile_tokens={tokens} is not applied: {why}. The loss head tiles as the installed TRL "
                      f"does; the memory estimate may be low.", stacklevel=2)
        return
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


