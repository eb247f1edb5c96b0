"""Preflight on described machines (P100, T4, A100, H100; 4, 16 and 80 GB) and on this one, through the CLI."""

import json
import subprocess
import sys

import pytest

from freetune.errors import FreetuneError
from freetune.plan import GPU, KNOWN_SHAPES, Hardware, Plan, for_world, make_plan, read_hardware, replan
from freetune.plan import __main__ as cli
from freetune.plan.hardware import torch_supports

# What current PyTorch wheels (CUDA 12.8+) are built for: Turing and newer, no Pascal (sm_60) or Volta (sm_70).
CURRENT_ARCHS = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
# An older wheel (CUDA 11.8 era) that still ran a P100.
OLDER_ARCHS = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


def machine(name, capability, memory_gib, bf16, count=1, arch_list=CURRENT_ARCHS, **kwargs):
    return Hardware(gpus=[GPU(name, capability, memory_gib)] * count, arch_list=list(arch_list), bf16_supported=bf16,
                    torch="2.13.0", cuda="12.8", disk_free_gib={"/work": 60.0}, ram_total_gib=30.0,
                    ram_available_gib=28.0, **kwargs)


P100 = machine("Tesla P100-PCIE-16GB", (6, 0), 15.9, bf16=False)
T4 = machine("Tesla T4", (7, 5), 14.7, bf16=False)
A100 = machine("NVIDIA A100-SXM4-80GB", (8, 0), 79.2, bf16=True)
H100 = machine("NVIDIA H100 80GB HBM3", (9, 0), 79.1, bf16=True)
CARD_4GB = machine("NVIDIA GeForce GTX 1650", (7, 5), 3.8, bf16=False)


def test_p100_is_refused_before_anything_loads_with_what_to_pick_instead():
    with pytest.raises(FreetuneError) as refused:
        make_plan(P100, model_shape="qwen2.5-1.5b")
    message = str(refused.value)
    assert "Tesla P100" in message and "sm_60" in message and "7.5 or newer" in message
    assert 'Settings -> Accelerator -> "GPU T4 x2"' in message
    assert "Runtime -> Change runtime type -> T4 GPU" in message


def test_p100_runs_on_a_torch_still_built_for_it():
    plan = make_plan(machine("Tesla P100-PCIE-16GB", (6, 0), 15.9, bf16=False, arch_list=OLDER_ARCHS))
    assert (plan.precision.compute_dtype, plan.precision.mixed) == ("float16", "fp16")


def test_which_torch_builds_run_which_gpus():
    assert torch_supports((8, 6), ["sm_80"])            # same major, newer minor: the sm_80 cubin runs
    assert not torch_supports((8, 0), ["sm_86"])        # an older minor cannot run newer code
    assert not torch_supports((9, 0), ["sm_80"])        # a cubin does not cross major versions...
    assert torch_supports((9, 0), ["sm_80", "compute_80"])  # ...but PTX is compiled for newer GPUs at load
    assert torch_supports((9, 0), ["sm_90a"])
    assert not torch_supports((6, 0), CURRENT_ARCHS)


@pytest.mark.parametrize("bf16", [False, True])  # recent torch reports emulated bf16 on a T4 as supported
def test_t4_gets_the_fp16_policy_whatever_bf16_reports(bf16):
    plan = make_plan(machine("Tesla T4", (7, 5), 14.7, bf16=bf16))
    assert (plan.layout.device, plan.precision.compute_dtype, plan.precision.mixed, plan.precision.policy) == ("cuda", "float16", "fp16", "turing")
    assert plan.precision.load_dtype == "float16" and plan.precision.lora_dtype == "float32"
    assert plan.kernels.attention == "sdpa"
    assert "BFloat16" in plan.reasons["load_dtype"] and "sm_75" in plan.reasons["compute_dtype"]
    assert "fp32" in plan.reasons["lora_dtype"]
    assert plan.precision.torch_dtype.__repr__() == "torch.float16"


@pytest.mark.parametrize("hardware", [A100, H100], ids=["A100", "H100"])
def test_ampere_and_newer_get_bf16(hardware):
    plan = make_plan(hardware)
    assert (plan.precision.compute_dtype, plan.precision.mixed, plan.precision.policy) == ("bfloat16", "bf16", "ampere")
    assert plan.kernels.attention == "sdpa"
    assert "flash-attn" in plan.reasons["attention"]


def test_sm80_without_bf16_support_falls_back_to_fp16_and_says_why():
    plan = make_plan(machine("NVIDIA A100-SXM4-80GB", (8, 0), 79.2, bf16=False))
    assert (plan.precision.compute_dtype, plan.precision.mixed) == ("float16", "fp16")
    assert "no bf16" in plan.reasons["compute_dtype"]


def test_flash_attention_2_only_where_installed_and_sm80_or_newer():
    assert make_plan(machine("NVIDIA H100", (9, 0), 79.1, bf16=True, flash_attn=True)).kernels.attention == \
        "flash_attention_2"
    assert make_plan(machine("Tesla T4", (7, 5), 14.7, bf16=False, flash_attn=True)).kernels.attention == "sdpa"
    # The T4 policy forced on an H100 emulates a T4: no FlashAttention 2 either.
    assert make_plan(machine("NVIDIA H100", (9, 0), 79.1, bf16=True, flash_attn=True),
                     force_policy="turing").kernels.attention == "sdpa"
    assert make_plan(machine("Tesla T4", (7, 5), 14.7, bf16=False, sdpa=False)).kernels.attention == "eager"


def test_forcing_a_policy_overrides_the_gpu():
    forced = make_plan(H100, force_policy="turing")
    assert (forced.precision.compute_dtype, forced.precision.mixed) == ("float16", "fp16")
    assert "forced" in forced.reasons["compute_dtype"]
    assert make_plan(H100, precision="fp16").precision.compute_dtype == "float16"
    assert make_plan(T4, precision="bf16").precision.compute_dtype == "bfloat16"
    assert any("no native bf16" in w for w in make_plan(T4, precision="bf16").warnings)
    with pytest.raises(FreetuneError, match="contradicts"):
        make_plan(H100, force_policy="turing", precision="bf16")
    with pytest.raises(FreetuneError, match="precision must be"):
        make_plan(H100, precision="fp8")


def test_no_gpu_is_fp32_on_the_cpu():
    plan = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), model_shape="qwen2.5-1.5b")
    assert (plan.layout.device, plan.precision.compute_dtype, plan.precision.mixed, plan.layout.kind) == ("cpu", "float32", "no", "cpu")
    assert plan.memory.estimate.settings["optimizer"] == "adamw_torch"  # bitsandbytes' 8-bit optimizers need CUDA
    forced = make_plan(Hardware(), force_policy="turing")
    assert forced.layout.device == "cpu" and any("no GPU" in w for w in forced.warnings)


def test_two_gpus_plan_ddp_through_torchrun():
    plan = make_plan(machine("Tesla T4", (7, 5), 14.7, bf16=False, count=2), model_shape="qwen2.5-1.5b",
                     micro_batch=1, grad_accum=8)
    assert (plan.layout.kind, plan.layout.world_size, plan.rows_per_step) == ("ddp", 2, 16)
    assert "torchrun --nproc_per_node=2" in plan.reasons["layout"] and "DataParallel" in plan.reasons["layout"]
    under_torchrun = make_plan(machine("Tesla T4", (7, 5), 14.7, bf16=False, count=2, torchrun_world_size=1))
    assert (under_torchrun.layout.kind, under_torchrun.layout.world_size) == ("single", 1)


def test_16gb_t4_turns_one_by_eight_into_eight_by_one_for_the_1_5b_model():
    plan = make_plan(T4, model_shape="Qwen/Qwen2.5-Coder-1.5B-Instruct", max_length=1024, grad_accum=8)
    assert (plan.batch.micro_batch, plan.batch.grad_accum, plan.batch.max_length) == (8, 1, 1024)
    assert plan.memory.estimate.fits and plan.memory.estimate.total_gib <= 14.7
    assert not plan.warnings


def test_80gb_takes_the_largest_micro_batch_asked_for():
    plan = make_plan(H100, model_shape="qwen3-8b", max_length=2048, grad_accum=16)
    assert (plan.batch.micro_batch, plan.batch.grad_accum) == (16, 1) and plan.memory.estimate.fits


def test_4gb_card():
    # The tiny_4gb recipe's settings fit, with room to spare.
    tiny = make_plan(CARD_4GB, model_shape="TinyLlama/TinyLlama-1.1B-Chat-v1.0", micro_batch=1, grad_accum=8,
                     lora_rank=8, max_length=1024)
    assert (tiny.batch.micro_batch, tiny.batch.grad_accum, tiny.precision.compute_dtype) == (1, 8, "float16")
    assert tiny.memory.estimate.fits and not tiny.warnings
    # An 8B model cannot fit at all, not even one short row: refused before anything is downloaded, with the size
    # of model that would fit and the parameter to change.
    with pytest.raises(FreetuneError, match=r"Qwen3-8B cannot train on this GPU.*even one row of 256 tokens needs "
                                            r"~6\.8 GiB.*fits up to about 3\.\d B parameters: set model_id"):
        make_plan(CARD_4GB, model_shape="qwen3-8b", max_length=1024)
    # A micro-batch asked for that does not fit is kept, with the one that would.
    asked = make_plan(CARD_4GB, model_shape="qwen2.5-1.5b", micro_batch=32, grad_accum=1, max_length=1024)
    assert asked.batch.micro_batch == 32 and asked.memory.estimate.fits is False
    assert any("use micro_batch=" in w for w in asked.warnings)


def test_memory_budget_override_plans_for_a_capped_gpu():
    plan = make_plan(H100, model_shape=KNOWN_SHAPES["qwen2.5-1.5b"], memory_budget_gib=2.5, grad_accum=8)
    assert plan.memory.estimate.budget_gib == 2.5 and plan.batch.micro_batch < 8 and plan.memory.estimate.fits
    # Under a small cap the checkpointed layers' inputs go to host memory: they would be a real share of it.
    assert plan.memory.checkpointing and plan.memory.offload_activations and "pinned host memory" in \
        plan.reasons["gradient_checkpointing"]
    roomy = make_plan(H100, model_shape=KNOWN_SHAPES["qwen2.5-1.5b"], memory_budget_gib=14.5, grad_accum=8)
    assert roomy.memory.checkpointing and not roomy.memory.offload_activations


def test_low_disk_is_warned_about():
    hardware = machine("Tesla T4", (7, 5), 14.7, bf16=False)
    hardware.disk_free_gib = {"/kaggle/working": 1.5}
    plan = make_plan(hardware, model_shape="qwen2.5-1.5b")
    assert any("1.5 GiB free in /kaggle/working" in w for w in plan.warnings)


def test_plan_shows_itself_as_a_table_html_and_json():
    plan = make_plan(T4, model_shape="qwen2.5-1.5b")
    table = plan.table()
    for choice in ("compute dtype", "mixed precision", "attention", "layout", "batch", "max_length", "memory"):
        assert choice in table
    assert "Tesla T4" in table and "fp16" in table
    html = plan._repr_html_()
    assert html.startswith("<table>") and "BFloat16" in html
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["precision"]["compute_dtype"] == "float16" and data["memory"]["estimate"]["fits"] is True
    # The records read back (a Kaggle job file's plan); the estimate is not read back, the decisions and whys are.
    assert Plan.from_dict(data).replace(memory=plan.memory.estimate).table() == table


def test_the_first_version_s_constructor_still_works():
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                      reasons={"precision": "no GPU"})
    assert (plan.layout.kind, plan.layout.world_size, plan.batch.micro_batch, plan.warnings) == ("cpu", 1, 1, [])
    assert Plan.build(device="cuda", compute_dtype="float16", mixed_precision="fp16",
                      attn_implementation="sdpa").layout.kind == "single"


def test_read_hardware_on_this_machine(tmp_path):
    hardware = read_hardware(work_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "not" / "yet" / "made"))
    assert hardware.torch and hardware.python
    assert set(hardware.disk_free_gib) == {str(tmp_path), str(tmp_path / "not" / "yet" / "made")}
    assert hardware.ram_total_gib and hardware.ram_total_gib > 0.5
    assert "Python" in hardware.report()


def test_cli_json_on_this_machine():
    out = subprocess.run([sys.executable, "-m", "freetune.plan", "--json", "--model-shape", "qwen2.5-1.5b",
                          "--max-length", "512"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    if not data["hardware"]["gpus"]:
        assert (data["plan"]["layout"]["device"], data["plan"]["precision"]["compute_dtype"]) == ("cpu", "float32")
    assert data["plan"]["batch"]["max_length"] == 512
    assert data["plan"]["memory"]["estimate"]["settings"]["model"] == "Qwen2.5-1.5B"


def test_cli_refuses_an_unsupported_gpu(monkeypatch, capsys):
    monkeypatch.setattr(cli, "read_hardware", lambda *a, **k: P100)
    assert cli.main(["--json"]) == 2
    captured = capsys.readouterr()
    assert "GPU T4 x2" in json.loads(captured.out)["error"]
    assert "preflight refused" in captured.err
    monkeypatch.setattr(cli, "read_hardware", lambda *a, **k: T4)
    assert cli.main([]) == 0
    assert "Tesla T4" in capsys.readouterr().out


def test_gradient_checkpointing_takes_auto_on_off_and_refuses_anything_else():
    # "auto" on an 80 GB card: 8 x 1,024 tokens of the 1.5B shape fit without recomputation, so it goes off.
    assert make_plan(A100, model_shape="qwen2.5-1.5b", grad_accum=8).memory.checkpointing is False
    assert make_plan(A100, model_shape="qwen2.5-1.5b", gradient_checkpointing="on").memory.checkpointing is True
    assert make_plan(T4, model_shape="qwen2.5-1.5b", gradient_checkpointing="off").memory.checkpointing is False
    with pytest.raises(FreetuneError, match="'auto'.*'on' or 'off'"):
        make_plan(T4, model_shape="qwen2.5-1.5b", gradient_checkpointing="yes")


def test_a_card_with_room_for_some_layers_checkpoints_only_every_nth(tmp_path):
    """Between "fits without checkpointing" and "needs it everywhere": every n-th layer is checkpointed, the largest n
    that fits (the others skip the recompute), and the Trainer is told through every_n_layers. Every n is tried: here
    5 fits and 6 does not (a list of 8, 4, 3, 2 picked 4, one layer's recompute more: issue 49)."""
    from freetune.plan import estimate
    from freetune.platform import Paths
    from freetune.sft_config import make_config

    shape = KNOWN_SHAPES["qwen2.5-1.5b"]
    plan = make_plan(H100, model_shape=shape, memory_budget_gib=14.5, grad_accum=8)
    assert plan.batch.micro_batch == 8 and plan.memory.checkpointing and plan.memory.checkpoint_every == 5
    assert "on for 6 of 28 layers (every 5)" in plan.reasons["gradient_checkpointing"]
    settings = {k: v for k, v in plan.memory.estimate.settings.items() if k not in ("model", "max_length", "micro_batch")}
    sparser = estimate(shape, max_length=1024, micro_batch=8, **{**settings, "checkpoint_every": 6})  # one layer fewer recomputed
    assert sparser.total_gib * 1.1 > 14.5 >= plan.memory.estimate.total_gib * 1.1
    assert "every 5 layers" in plan.table() and not plan.memory.offload_activations
    run = tmp_path / "run"
    paths = Paths(platform="local", run_dir=str(run), checkpoints=f"{run}/c", adapter=f"{run}/a", data=f"{run}/d",
                  reports=f"{run}/r").make()
    cpu_check = plan.replace(device="cpu", compute_dtype="float32", mixed_precision="no")  # this machine has no GPU
    config = make_config(paths, cpu_check, max_steps=2, micro_batch=8, grad_accum=1, learning_rate=1e-4,
                         max_length=1024)
    assert config.gradient_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 5}


def test_replanned_for_the_datas_longest_row_a_t4_drops_checkpointing():
    """Short rows (the SVG sample's are a few hundred tokens) planned as max_length each would overstate the memory
    several times: replan sizes the batch for the data's longest row, keeps max_length as the cut, and says so."""
    first = make_plan(T4, model_shape="Qwen/Qwen2.5-Coder-1.5B-Instruct", grad_accum=8)
    assert first.batch.micro_batch == 8 and first.memory.checkpointing
    data = replan(first, T4, longest_row=420)
    assert data.batch.micro_batch == 8 and not data.memory.checkpointing and data.batch.max_length == 1024
    assert data.memory.estimate.total_gib < first.memory.estimate.total_gib
    assert "8 x 420 tokens" in data.reasons["batch"] and "longest row" in data.reasons["batch"]
    assert "checkpointing off" in data.one_line()
    # A plan read back from a Kaggle job file (JSON: the shape is a dict there) replans the same way.
    import dataclasses

    shaped = make_plan(T4, model_shape=KNOWN_SHAPES["qwen2.5-1.5b"], grad_accum=8)
    read_back = Plan.from_dict(json.loads(json.dumps(dataclasses.asdict(shaped))))
    assert replan(read_back, T4, longest_row=420).one_line() == data.one_line()


def test_for_world_re_decides_the_sampler_and_counts_the_ranks_of_every_host():
    # The notebook planned for its own machine (one T4); the job that trains holds more ranks.
    one = make_plan(T4, model_shape="qwen2.5-1.5b")
    assert one.layout.sampler != "rank_balanced" and one.layout.world_size == 1
    two_ranks = for_world(one, 2)
    assert two_ranks.layout.sampler == "rank_balanced" and "2 ranks" in two_ranks.reasons["sampler"]
    assert two_ranks.layout.world_size == 1 and two_ranks.reasons["layout"] == one.reasons["layout"]  # one host: as planned
    hosts = for_world(one, 4, hosts=2)
    assert hosts.layout.world_size == 4 and hosts.reasons["layout"].startswith(
        "2 hosts x 2 process(es) = 4 ranks through torchrun's c10d rendezvous; ")
    assert one.layout.sampler != "rank_balanced" and one.layout.world_size == 1  # a copy: the notebook's plan stays as shown
    assert for_world(one, 1).layout.sampler == one.layout.sampler


def test_input_embeddings_go_to_host_ram_only_where_memory_is_tight_and_the_head_is_a_weight_of_its_own():
    """A 4 GB card with TinyLlama (every layer checkpointed, an untied head): the embedding table waits in host RAM and
    the estimate counts it off the GPU; a roomy card, a tied head (Qwen2.5), DDP and a CPU run keep it where it is."""
    from freetune.plan import estimate
    from freetune.plan.memory import embedding_bytes

    shape = KNOWN_SHAPES["tinyllama-1.1b"]
    tight = make_plan(H100, model_shape=shape, memory_budget_gib=4.0, grad_accum=8, precision="fp16")
    assert tight.memory.checkpointing and tight.memory.checkpoint_every == 1 and tight.memory.embeddings_on_host
    assert "125 MiB off the GPU" in tight.reasons["embeddings"] and "host RAM" in tight.table()
    settings = {k: v for k, v in tight.memory.estimate.settings.items() if k not in ("model", "max_length", "micro_batch")}
    kept = estimate(shape, max_length=1024, micro_batch=tight.batch.micro_batch, **{**settings, "embeddings_on_host": False})
    assert kept.other_weights_gib - tight.memory.estimate.other_weights_gib == pytest.approx(
        embedding_bytes(shape, "float16") / 2**30)
    roomy = make_plan(H100, model_shape=shape, grad_accum=8)
    assert not roomy.memory.embeddings_on_host and "memory to spare" in roomy.reasons["embeddings"]
    tied = make_plan(H100, model_shape="qwen2.5-1.5b", memory_budget_gib=4.0, grad_accum=8, precision="fp16")
    assert tied.memory.checkpoint_every == 1 and not tied.memory.embeddings_on_host and "shares" in tied.reasons["embeddings"]
    two = make_plan(machine("Tesla T4", (7, 5), 4.0, bf16=False, count=2), model_shape=shape, grad_accum=8)
    assert two.layout.kind == "ddp" and not two.memory.embeddings_on_host
    cpu = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), model_shape=shape)
    assert not cpu.memory.embeddings_on_host


def test_the_plan_decides_once_whether_the_fused_layers_keep_8bit_absmax():
    assert make_plan(T4, model_shape="qwen2.5-1.5b").memory.keep_8bit_absmax  # fused, compiled, per-projection MLP
    chunked = make_plan(T4, model_shape="qwen2.5-1.5b", max_length=32768, memory_budget_gib=4.0)
    assert chunked.kernels.mlp == "chunked" and not chunked.memory.keep_8bit_absmax  # the chunked op reads fp32 values
    assert not make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), model_shape="qwen2.5-1.5b").memory.keep_8bit_absmax


def test_planning_loads_no_run_time_module_until_it_probes_a_gpus_attention_kernel():
    code = ("import sys; from freetune.plan import Hardware, make_plan; "
            "make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), model_shape='qwen2.5-1.5b'); "
            "print(sorted(m for m in sys.modules if m in ('freetune.speed.attention', 'freetune.speed.lora_kernel', 'freetune.speed.mlp', "
            "'freetune.train', 'freetune.trainer', 'freetune.model')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
