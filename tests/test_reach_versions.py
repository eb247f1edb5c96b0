"""freetune.reach and freetune.trainer: the library internals freetune changes, checked against what is installed.

The tested releases are pyproject.toml's pins; another release of the same major version is a warning that names
the difference and the fix, another major version an error before anything loads, and an override whose method
the installed library no longer has an error too (it would never run).
"""

import re
import tomllib
import warnings

import pytest

from conftest import REPO
from freetune.reach import trl as trl_reach
from freetune.reach import versions
from freetune.errors import FreetuneError


def test_the_tested_versions_are_the_pins_in_pyproject_and_this_environment_has_them():
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    pins = dict(re.fullmatch(r"([\w.-]+)==(\S+)", req).groups() for req in train if "==" in req)
    tested = versions.tested_versions()
    assert tested == {name: pins[name] for name in versions.WATCHED}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CI installs the pins: no warning here
        assert versions.check_versions() == []


def test_a_newer_minor_release_warns_naming_it_the_tested_one_and_the_fix():
    with pytest.warns(versions.VersionWarning) as caught:
        differ = versions.check_versions(installed={"transformers": "5.24.0", "trl": "1.16.0"},
                                          tested={"transformers": "5.17.0", "trl": "1.16.0"})
    assert differ == ["transformers 5.24.0 is installed, freetune is tested with 5.17.0"]
    message = str(caught[0].message)
    assert "pyproject.toml" in message and "pip install 'transformers==5.17.0'" in message
    assert "trl" not in message  # only what differs


def test_an_older_patch_release_warns_too():
    with pytest.warns(versions.VersionWarning, match="peft 0.21.1 is installed"):
        versions.check_versions(installed={"peft": "0.21.1"}, tested={"peft": "0.21.2"})


def test_another_major_version_stops_before_anything_loads():
    with pytest.raises(FreetuneError) as refused:
        versions.check_versions(installed={"transformers": "6.0.0", "peft": "0.22.0"},
                                 tested={"transformers": "5.17.0", "peft": "0.21.2"})
    message = str(refused.value)
    assert "another major version of transformers" in message
    assert "pip install 'transformers==5.17.0' 'peft==0.21.2'" in message


def test_every_trainer_override_is_tagged_and_exists_in_the_installed_libraries():
    from trl import SFTTrainer

    from freetune.trainer import FreetuneTrainer

    tagged = versions.check_overridden(FreetuneTrainer)
    # Every method FreetuneTrainer defines over one of its bases carries the release it was written against.
    overriding = sorted(name for name, value in vars(FreetuneTrainer).items() if callable(value)
                        and name != "__init__" and any(name in vars(base) for base in SFTTrainer.__mro__))
    assert tagged == overriding and "compute_loss" in tagged and "_save_checkpoint" in tagged

    class Drifted(SFTTrainer):
        @versions.written_against("transformers 5.17")
        def _a_hook_no_release_has(self):
            pass

    with pytest.raises(FreetuneError, match="_a_hook_no_release_has .transformers 5.17.*would never run"):
        versions.check_overridden(Drifted)


def test_trl_activation_offloading_keeps_the_cuda_cache_between_micro_batches(monkeypatch):
    """TRL's activation offloading context empties the device cache each time it is entered (every micro-batch) once
    bitsandbytes is imported; keep_cuda_cache_between_steps leaves it out and keeps the rest of the context's device
    module. On a CPU the context is built with the CPU as its accelerator and torch.cpu as its device module, its
    empty_cache calls counted."""
    import types

    import bitsandbytes  # noqa: F401  (TRL empties the cache only where it is imported)
    import torch
    from trl.models.activation_offloading import OffloadActivations

    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))

    class Counting:  # torch.cpu, with its empty_cache calls counted
        def __init__(self, calls):
            self.calls = calls

        def __getattr__(self, name):
            return getattr(torch.cpu, name)

        def empty_cache(self):
            self.calls.append("empty_cache")

    def context():
        calls = []
        ctx = OffloadActivations(use_pin_memory=False, use_streams=False)
        ctx.device_module = Counting(calls)
        return ctx, calls

    ctx, calls = context()
    with ctx:  # TRL as it comes: the cache emptied on entering
        pass
    assert calls == ["empty_cache"]

    ctx, calls = context()
    trainer = types.SimpleNamespace(maybe_activation_offload_context=ctx)
    assert trl_reach.keep_cuda_cache_between_steps(trainer)
    assert not trl_reach.keep_cuda_cache_between_steps(trainer)  # once
    for _ in range(3):
        with ctx:
            x = torch.randn(64, 64, requires_grad=True)
            (x * x).sum().backward()  # the context's pack and unpack hooks still run
    assert calls == []
    assert ctx.device_module.current_stream() == torch.cpu.current_stream()  # everything else is the module's
    # a trainer without offloading (a null context) is left as it is
    assert not trl_reach.keep_cuda_cache_between_steps(types.SimpleNamespace(maybe_activation_offload_context=None))


def test_the_trainer_walks_the_model_once_for_its_flops_estimate_and_its_gradient_clipping(tiny_model_dir, tmp_path):
    """FreetuneTrainer.floating_point_ops and _clip_grad_norm give what transformers' give (the same FLOPs estimate;
    the same norm and clipped gradients) without walking every module of the model at each step: the parameter count
    and the trainable parameters are taken once."""
    import torch
    from datasets import Dataset
    from transformers import Trainer

    import freetune
    from freetune.platform import Paths
    from freetune.plan import make_plan
    from freetune.trainer import FreetuneTrainer

    plan = make_plan(micro_batch=2, grad_accum=1)
    paths = Paths.under(tmp_path / "run")
    paths.make()
    model = freetune.model.load_base_model(str(tiny_model_dir), plan)
    model, _, _ = freetune.model.attach_lora(model, rank=4, alpha=8, dropout=0.0, seed=0)
    config = freetune.sft_config.make_config(paths, plan, max_steps=2, micro_batch=2, grad_accum=1, learning_rate=1e-4,
                                        max_length=32, optimizer="adamw_torch", seed=0)
    config.max_grad_norm = 0.01  # small: the gradients are clipped
    trainer = FreetuneTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": [[5, 6, 7]] * 4}),
                              processing_class=freetune.model.load_tokenizer(str(tiny_model_dir)), plan=plan)
    inputs = {"input_ids": torch.ones(2, 17, dtype=torch.long)}
    counted = []
    real_count = model.num_parameters
    model.num_parameters = lambda *a, **k: counted.append(1) or real_count(*a, **k)
    want = Trainer.floating_point_ops(trainer, inputs)
    counted.clear()
    assert [trainer.floating_point_ops(inputs) for _ in range(3)] == [want] * 3 and want > 0
    assert len(counted) == 1

    trainable = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in trainable]

    def clipped(clip):
        for p, g in zip(trainable, grads):
            p.grad = g.clone()
        norm = clip(trainer, model)
        return norm, [p.grad.clone() for p in trainable]

    want_norm, want_grads = clipped(Trainer._clip_grad_norm)
    walks = []
    real_parameters = model.parameters
    model.parameters = lambda *a, **k: walks.append(1) or real_parameters(*a, **k)
    for _ in range(3):
        norm, got = clipped(FreetuneTrainer._clip_grad_norm)
        assert torch.equal(norm, want_norm) and want_norm > config.max_grad_norm
        assert all(torch.equal(a, b) for a, b in zip(got, want_grads))
    assert len(walks) == 1  # the trainable parameters listed once


def test_the_garbage_collector_is_kept_off_what_the_warm_up_left_until_training_ends():
    """GarbageFrozenAfterWarmup: nothing changes during the warm-up steps (counted from the session's first step, a
    resumed one's too); then the cyclic garbage of the warm-up is collected and every survivor frozen (out of the
    collector's generations: later full collections do not walk it); at the end of training all of it is unfrozen."""
    import gc
    import weakref
    from types import SimpleNamespace

    from freetune.trainer import GarbageFrozenAfterWarmup

    class Node:
        pass

    def in_generations(obj) -> bool:
        return any(o is obj for o in gc.get_objects())

    assert gc.get_freeze_count() == 0
    frozen = GarbageFrozenAfterWarmup(warmup_steps=2)
    state = SimpleNamespace(global_step=40)  # resumed at step 40
    was_enabled = gc.isenabled()
    gc.disable()  # no automatic collection in between: the cycle below stays until a collection is asked for
    try:
        frozen.on_step_begin(None, state, None)
        garbage = Node()
        garbage.cycle = garbage
        collected = weakref.ref(garbage)
        del garbage
        kept = Node()
        kept.cycle = kept
        state.global_step = 41
        frozen.on_step_end(None, state, None)
        frozen.on_step_begin(None, state, None)
        assert gc.get_freeze_count() == 0 and collected() is not None and in_generations(kept)
        state.global_step = 42
        frozen.on_step_end(None, state, None)
        assert collected() is None  # the warm-up's garbage was collected, not frozen
        assert gc.get_freeze_count() > 0 and not in_generations(kept)
        later = Node()
        later.cycle = later
        later_collected = weakref.ref(later)
        del later
        frozen.on_step_end(None, SimpleNamespace(global_step=43), None)
        assert later_collected() is not None  # once only: no collection at the later steps
        frozen.on_train_end(None, state, None)
        assert gc.get_freeze_count() == 0 and in_generations(kept)
        frozen.unfreeze()  # freetune.train's undo after training: nothing left to do
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
