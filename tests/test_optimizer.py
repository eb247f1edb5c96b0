"""freetune.speed.optimizer: bitsandbytes' 8-bit AdamW with a launch per 16 MiB of weights computes what
bitsandbytes' own per-weight step computes, bit for bit, and its checkpoints load into either optimizer.

bitsandbytes 0.50 runs its 8-bit optimizers on a CPU (its CPU backend), so the comparison runs here on the CPU; the same
test runs on a GPU where there is one (the CUDA kernel, the one the training runs)."""

import io

import pytest
import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _weights(device, seed=0):
    """LoRA-like weights: sizes on and off the 256-value blocks, one below bitsandbytes' min_8bit_size (fp32 state) in
    a group of its own (the Trainer's decay and no-decay groups), one a paged optimizer pages (>= 100,000 values)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(16, 512), (256, 16), (16, 300), (300, 16), (8, 100), (16, 520), (16, 7000)]
    weights = [torch.nn.Parameter(torch.randn(s, generator=generator).to(device)) for s in shapes]
    return weights


def _groups(weights):
    return [{"params": weights[:4] + weights[5:], "weight_decay": 0.01}, {"params": weights[4:5], "weight_decay": 0.0}]



def _optimizer(weights, flat: bool, paged: bool = False):
    import bitsandbytes as bnb

    from freetune.speed.optimizer import one_launch

    optimizer = bnb.optim.AdamW(_groups(weights), lr=1e-2, optim_bits=8, is_paged=paged)
    return one_launch(optimizer) if flat else optimizer


def _gradients(weights, step, skip=()):
    generator = torch.Generator().manual_seed(1000 + step)
    for i, w in enumerate(weights):
        g = torch.randn(w.shape, generator=generator).to(w.device)
        w.grad = None if i in skip else g


def _run(optimizer, weights, steps, skip_at=None):
    for step in steps:
        _gradients(weights, step, skip=(2,) if step == skip_at else ())
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("chunk_values", [None, 9000], ids=["one_chunk", "chunks_of_9000"])
@pytest.mark.parametrize("paged", [False, True], ids=["adamw_8bit", "paged_adamw_8bit"])
@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_updates_every_weight_as_bitsandbytes_own_step_does(device, paged, chunk_values, monkeypatch):
    """Also where the gradients are concatenated a few weights at a time (the limit that bounds the step's memory)."""
    from freetune.speed import optimizer as one_launch_optimizer
    from freetune.speed.optimizer import OneLaunchSteps

    if chunk_values:
        monkeypatch.setattr(one_launch_optimizer, "GRADIENT_CHUNK_VALUES", chunk_values)
    plain_weights, flat_weights = _weights(device), _weights(device)
    plain = _optimizer(plain_weights, flat=False, paged=paged)
    flat = _optimizer(flat_weights, flat=True, paged=paged)
    assert isinstance(flat, OneLaunchSteps)
    # The 8-bit-state weights of the first group share one flat tensor; the small one (the other group) does not, nor
    # the one whose state a paged optimizer pages.
    flat_count = 5 if paged else 6
    assert len(flat.freetune_flats) == 1 and len(flat.freetune_flats[0].weights) == flat_count
    storage = flat.freetune_flats[0].tensor.untyped_storage().data_ptr()
    assert all(w.untyped_storage().data_ptr() == storage for w in flat.freetune_flats[0].weights)
    assert flat_weights[4].untyped_storage().data_ptr() != storage
    assert (flat_weights[6].untyped_storage().data_ptr() == storage) is not paged
    # Padded sizes 8192, 4096, 4864, 4864, 8448 (and 112,000 unless paged): within 9,000 values only the 2nd and 3rd
    # go together; the largest, above the limit, is a chunk of its own.
    expected = [(0, 1), (1, 3), (3, 4), (4, 5)] + ([] if paged else [(5, 6)]) if chunk_values else [(0, flat_count)]
    assert flat.freetune_flats[0].chunks == expected

    # Step 3 leaves one weight without a gradient: that step and the next run per weight, as bitsandbytes would.
    _run(plain, plain_weights, range(6), skip_at=3)
    _run(flat, flat_weights, range(6), skip_at=3)
    for a, b in zip(plain_weights, flat_weights):
        assert torch.equal(a, b)
    assert flat.freetune_flats[0].steps == [6, 6, 5] + [6] * (flat_count - 3)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_of_either_optimizer_resumes_in_the_other(device):
    """state_dict gives each weight its own state in bitsandbytes' format; load_state_dict packs it back."""
    weights = {name: _weights(device) for name in ("plain", "flat", "plain_from_flat", "flat_from_plain")}
    plain, flat = _optimizer(weights["plain"], flat=False), _optimizer(weights["flat"], flat=True)
    _run(plain, weights["plain"], range(3), skip_at=1)
    _run(flat, weights["flat"], range(3), skip_at=1)

    def saved(optimizer):
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    for name, source, flat_target, source_weights in (("plain_from_flat", flat, False, "flat"),
                                                       ("flat_from_plain", plain, True, "plain")):
        with torch.no_grad():
            for w, s in zip(weights[name], weights[source_weights]):
                w.copy_(s)
        resumed = _optimizer(weights[name], flat=flat_target)
        resumed.load_state_dict(saved(source))
        _run(resumed, weights[name], range(3, 6))
    _run(plain, weights["plain"], range(3, 6))
    _run(flat, weights["flat"], range(3, 6))
    for name in ("flat", "plain_from_flat", "flat_from_plain"):
        for a, b in zip(weights["plain"], weights[name]):
            assert torch.equal(a, b), name
    # The flat optimizer's own checkpoint keys its state as bitsandbytes does: one entry per weight that stepped.
    assert sorted(saved(flat)["state"]) == sorted(saved(plain)["state"])


def test_weights_moved_after_the_optimizer_was_made_are_moved_into_a_new_flat_tensor(capsys):
    """accelerate moves the model to "cpu:0" under DDP on CPUs after the Trainer made the optimizer (each weight's
    .data replaced): the next step puts the weights, as they are then, into a new flat tensor, state and all."""
    from bitsandbytes.optim.optimizer import Optimizer2State

    from freetune.errors import FreetuneError
    from freetune.speed.optimizer import OneLaunchSteps, one_launch

    plain_weights, flat_weights = _weights("cpu"), _weights("cpu")
    plain, flat = _optimizer(plain_weights, flat=False), _optimizer(flat_weights, flat=True)
    _run(plain, plain_weights, range(2))
    _run(flat, flat_weights, range(2))
    old = flat.freetune_flats[0].tensor
    with torch.no_grad():
        for w in flat_weights:  # as Module._apply does: the same Parameters, new storage
            w.data = w.data.clone()
    _run(plain, plain_weights, range(2, 4))
    _run(flat, flat_weights, range(2, 4))
    assert flat.freetune_flats[0].tensor is not old
    for a, b in zip(plain_weights, flat_weights):
        assert torch.equal(a, b)

    flat_weights[0].data = flat_weights[0].data.double()
    for w in flat_weights:
        w.grad = torch.ones_like(w)
    with pytest.raises(FreetuneError, match="different devices or dtypes"):
        flat.step()

    normed = one_launch(Optimizer2State("adam", _groups(_weights("cpu")), optim_bits=8, max_unorm=1.0))
    assert not isinstance(normed, OneLaunchSteps)
    assert "max_unorm=1.0" in capsys.readouterr().out
    torch_adamw = torch.optim.AdamW(_groups(_weights("cpu")))
    assert one_launch(torch_adamw) is torch_adamw and not isinstance(torch_adamw, OneLaunchSteps)
