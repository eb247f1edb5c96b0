"""freetune.speed.bnb_cpu: 4-bit weights dequantise to the weights they quantised, on every x86-64 CPU.

bitsandbytes 0.50.2's native CPU dequantisation is wrong on AVX-512 CPUs for layers whose input size is not a
multiple of the 64-weight block (and right on AVX2 builds). These tests hold on both kinds: where the native
kernel is right, freetune keeps it; where it is wrong, freetune's replacement must be right. Either way a 4-bit
model freetune loads on the CPU trains on weights within NF4's rounding of the originals.
"""

import pytest
import torch

from freetune.speed import bnb_cpu


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("shape", [(64, 128), (96, 160), (40, 80)])
def test_the_reference_is_bitsandbytes_own_portable_dequantisation(shape, quant_type):
    """freetune's replacement computes what bitsandbytes' portable ("default" backend, pure PyTorch) kernel
    computes, bit for bit, for rows of whole blocks and for rows that are not; and that is the weight."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    portable = _dequantize_4bit_compute.__wrapped__  # bitsandbytes wraps it in torch.compile; the plain function
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    packed, state = bnbf.quantize_4bit(weight, quant_type=quant_type, compress_statistics=False)
    code = _get_4bit_code(quant_type, packed.device)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = bnb_cpu.dequantize_4bit_reference(packed, state.absmax, state.blocksize, quant_type, state.shape, dtype)
        want = portable(packed.reshape(-1), state.absmax, code, state.blocksize, state.shape, dtype)
        assert got.dtype == dtype and got.shape == weight.shape
        assert torch.equal(got, want)
    # NF4 / FP4 rounding of a unit-normal weight: mean error ~0.07 / ~0.1; a wrongly blocked row gives ~0.16+.
    assert (got.float() - weight).abs().mean() < (0.09 if quant_type == "nf4" else 0.12)


def test_after_the_check_bitsandbytes_dequantises_odd_sized_layers_correctly():
    import bitsandbytes.functional as bnbf

    bnb_cpu.ensure_correct_dequantize()
    correct, why = bnb_cpu.check_dequantize()
    assert correct, why
    weight = torch.randn(96, 160, generator=torch.Generator().manual_seed(3))
    packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    got = bnbf.dequantize_4bit(packed, state)
    want = bnb_cpu.dequantize_4bit_reference(packed, bnbf.dequantize_blockwise(state.absmax, state.state2)
                                             + state.offset, state.blocksize, "nf4", state.shape, torch.float32)
    assert torch.allclose(got, want, atol=1e-6)
    assert (got - weight).abs().mean() < 0.09


@pytest.fixture(scope="module")
def odd_sized_model(tmp_path_factory, tiny_model_dir):
    """A Qwen2-architecture model whose layers take 80 and 160 inputs: 1.25 and 2.5 blocks of 64 per row."""
    from freetune.fixtures import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("odd"), "qwen2", hidden_size=80, tokenizer_dir=tiny_model_dir)


def test_a_4bit_model_loaded_on_the_cpu_holds_its_own_weights(odd_sized_model):
    """freetune.model.load_base_model on a CPU: every 4-bit layer dequantises to within NF4's rounding of the
    checkpoint's weight (on an AVX-512 CPU without freetune's check, the mean error doubles)."""
    import bitsandbytes.functional as bnbf
    from bitsandbytes.nn import Linear4bit
    from safetensors.torch import load_file

    from freetune.model import load_base_model
    from freetune.plan import Hardware, make_plan

    plan = make_plan(Hardware())
    model = load_base_model(str(odd_sized_model), plan, gradient_checkpointing=False)
    original = load_file(str(odd_sized_model / "model.safetensors"))
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Linear4bit)}
    assert len(layers) == 14 and any(m.in_features % 64 for m in layers.values())
    for name, module in layers.items():
        weight = original[f"{name}.weight"].float()
        got = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        relative = (got - weight).abs().mean() / weight.abs().mean()
        assert relative < 0.12, f"{name}: mean error {relative:.3f} of the weights' mean magnitude"


def test_an_odd_sized_4bit_layer_runs_in_eval_mode_on_the_cpu(odd_sized_model):
    """Generation on a CPU (eval mode, no gradients): bitsandbytes' AVX-512 bf16 repacking cannot reshape a layer
    of 80 inputs and raised; freetune keeps such layers on the plain layout, which computes the same product."""
    from bitsandbytes.nn import Linear4bit

    from freetune.model import load_base_model
    from freetune.plan import Hardware, make_plan

    model = load_base_model(str(odd_sized_model), make_plan(Hardware()), gradient_checkpointing=False)
    layer = next(m for m in model.modules() if isinstance(m, Linear4bit) and m.in_features == 80)
    x = torch.randn(1, 1, 80, dtype=torch.bfloat16)
    layer.train()
    with torch.no_grad():
        want = layer(x)
    layer.eval()
    with torch.no_grad():
        got = layer(x)
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_a_replacement_that_fails_is_checked_again_not_trusted(tmp_path):
    """The check counts as done only once a correct kernel holds. A replacement that computes other weights (here a
    kernel that returns zeros) raises, naming the torch version; the next ensure_correct_dequantize() checks again
    and puts the reference in place, rather than trust the wrong kernel and train on its weights. In a process of
    its own (~5 s): the kernels it registers would otherwise stay for the other tests."""
    import subprocess
    import sys

    script = """
import torch
from freetune.errors import FreetuneError
from freetune.speed import bnb_cpu

bnb_cpu.ensure_correct_dequantize()
zeros = lambda A, absmax, blocksize, quant_type, shape, dtype: torch.zeros(shape, dtype=dtype)
try:
    bnb_cpu.replace_dequantize(zeros)
except FreetuneError as error:
    assert f"torch {torch.__version__}" in str(error), error
else:
    raise AssertionError("a kernel of zeros passed the check")
assert not bnb_cpu.check_dequantize()[0]
assert bnb_cpu.ensure_correct_dequantize() is True
correct, why = bnb_cpu.check_dequantize()
assert correct, why
print("checked again")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "checked again" in done.stdout
    assert "freetune dequantises 4-bit weights on the CPU in PyTorch instead" in done.stdout
