"""bitsandbytes' CPU 4-bit kernels, checked once per process, with a correct path where they are wrong.

Written against bitsandbytes 0.50.2. Its native CPU NF4/FP4 dequantisation (the AVX-512 build of
`libbitsandbytes_cpu`) walks the weight row by row, as if every row started a new block of `blocksize`
weights; the quantisation (and the CUDA kernels) block the flat tensor. A layer whose input size is not a multiple
of the block size (64) then dequantises to other weights: on an AVX-512 CPU the round trip of a 96 x 160 weight has
a mean error of ~0.16 against ~0.07 for the same NF4 blocks dequantised correctly, and a 4-bit model would train
on those wrong weights. The same CPUs' inference repacking (`Linear4bit` in eval mode with AVX-512 bf16) cannot
reshape such a layer at all. Where the native kernel is right (AVX2 builds, or rows that are whole blocks) it stays.

`ensure_correct_dequantize()` runs the check once (a few milliseconds) and, where it fails, registers a pure-PyTorch
dequantisation as bitsandbytes' CPU kernel for every shape (the CUDA kernels are untouched) and says so once.
`freetune.reach.peft_bnb.keep_cpu_inference_layout(model)` keeps such layers out of the broken inference repacking.
"""

from __future__ import annotations

import math

from freetune.distributed import print0
from freetune.errors import FreetuneError, reason
from freetune.reach import peft_bnb as peft_bnb_reach

_CHECKED: dict = {}  # "replaced": whether freetune's kernel is in place; set once a correct kernel holds
# A weight whose rows are 2.5 blocks long: the condition the native kernel gets wrong.
PROBE_SHAPE = (96, 160)


def dequantize_4bit_reference(packed, absmax, blocksize: int, quant_type: str, shape, dtype):
    """The 4-bit weight as bitsandbytes' CUDA kernel computes it: two codes per byte (high nibble first), each
    looked up in the NF4/FP4 table and scaled by its block's absmax, blocks of `blocksize` over the flat tensor."""
    from bitsandbytes.functional import get_4bit_type

    return decode_4bit(packed, get_4bit_type(quant_type, device=packed.device), absmax, blocksize, shape, dtype)


def decode_4bit(packed, code, absmax, blocksize: int, shape, dtype):
    """dequantize_4bit_reference with the 16 values of the 4-bit code given as a tensor: plain tensor code, which
    inductor fuses into one kernel inside a compiled graph (freetune.speed.nf4._dequantize). Each byte is read twice,
    shifted by 4 then 0: a stack of its two halves stayed a copy kernel of its own in inductor's (CPU) code."""
    import torch

    flat = packed.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    n = math.prod(shape)
    shifts = 4 - 4 * torch.arange(2, device=flat.device, dtype=torch.uint8)
    codes = (flat.reshape(-1, 1).expand(-1, 2) >> shifts).bitwise_and(0xF).reshape(-1)[:n].long()
    blocks = absmax.shape[0]
    scale = absmax.float()[:, None].expand(blocks, blocksize).reshape(-1)[:n]
    return (code[codes].float() * scale).reshape(shape).to(dtype)


def check_dequantize() -> tuple[bool, str]:
    """(correct, why): bitsandbytes' CPU dequantisation of the probe weight against the reference, NF4 and FP4."""
    import torch
    import bitsandbytes.functional as bnbf

    weight = torch.randn(*PROBE_SHAPE, generator=torch.Generator().manual_seed(0))
    for quant_type in ("nf4", "fp4"):
        packed, state = bnbf.quantize_4bit(weight, quant_type=quant_type, compress_statistics=False)
        got = torch.ops.bitsandbytes.dequantize_4bit.default(packed, state.absmax, state.blocksize, quant_type,
                                                             list(state.shape), torch.float32)
        want = dequantize_4bit_reference(packed, state.absmax, state.blocksize, quant_type, state.shape,
                                         torch.float32)
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            err = (got - weight).abs().mean().item()
            ref_err = (want - weight).abs().mean().item()
            return False, (f"{quant_type} round trip of a {PROBE_SHAPE[0]} x {PROBE_SHAPE[1]} weight: mean error "
                           f"{err:.3f}, against {ref_err:.3f} for the same blocks dequantised correctly")
    return True, "agrees with the reference"


def ensure_correct_dequantize() -> bool:
    """Check bitsandbytes' CPU 4-bit dequantisation once; where it is wrong, replace it (CPU only) with the
    reference and print why. Returns True when the replacement is in place. The check counts as done only once a
    correct kernel holds: after a failure the next call checks again, rather than train on the wrong weights."""
    if "replaced" in _CHECKED:
        return _CHECKED["replaced"]
    import bitsandbytes  # noqa: F401  (registers its ops and CPU kernels first)

    correct, why = check_dequantize()
    if not correct:
        replace_dequantize(dequantize_4bit_reference)
        print0(f"bitsandbytes {bitsandbytes.__version__}'s CPU 4-bit dequantisation is wrong on this CPU for layers "
               f"whose input size is not a multiple of 64 ({why}): freetune dequantises 4-bit weights on the CPU in "
               f"PyTorch instead. GPUs are not affected.")
    _CHECKED["replaced"] = not correct
    return not correct


def replace_dequantize(kernel) -> None:
    """`kernel` (dequantize_4bit_reference's arguments) as bitsandbytes' CPU dequantize_4bit, checked on the probe
    weight; FreetuneError, and the check to be run again, when it cannot be registered or computes other weights."""
    import torch

    _CHECKED.clear()  # whatever happens below, the kernel in place is no longer the one checked
    try:
        peft_bnb_reach.register_cpu_dequantize(kernel)
    except Exception as exc:  # torch < 2.8 has no Library.impl(..., allow_override=True)
        raise FreetuneError(
            f"freetune could not replace bitsandbytes' CPU 4-bit dequantisation, which is wrong on this CPU, under "
            f"torch {torch.__version__} ({reason(exc)}). Install torch 2.8 or newer (pip install 'torch>=2.8'), "
            f"or train on a GPU.") from exc
    correct, why = check_dequantize()
    if not correct:
        raise FreetuneError(f"freetune's CPU 4-bit dequantisation, registered under torch {torch.__version__}, still "
                            f"computes other weights ({why}). Train on a GPU, where bitsandbytes' CUDA kernels are "
                            f"used.")
