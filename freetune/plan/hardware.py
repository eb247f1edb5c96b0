"""What the machine has, read before anything loads (read_hardware): its GPUs, what the installed torch was built for,
disk and RAM; whether its variable-length attention kernel works (probe_varlen: the one probe that runs a kernel); and
the refusal of a GPU the installed torch cannot run (check_gpus_supported). The plan's decisions
(freetune.plan.decisions) read these records; nothing here decides."""

from __future__ import annotations

import importlib.util
import os
import platform as _platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

from freetune import resources
from freetune.errors import FreetuneError
from freetune.plan.memory import GIB

# What to pick instead of a GPU the installed PyTorch cannot run, where people meet one (Kaggle's P100).
SUPPORTED_GPU_ADVICE = ('on Kaggle, Settings -> Accelerator -> "GPU T4 x2"; '
                        'on Colab, Runtime -> Change runtime type -> T4 GPU')
# Below these, a run has no room for checkpoints, or for the merged 16-bit model at export.
MIN_FREE_DISK_GIB = 2.0


@dataclass(frozen=True)
class GPU:
    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass
class Hardware:
    """What preflight reads. Every field has a default so tests can describe a machine by hand."""

    gpus: list[GPU] = field(default_factory=list)
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list(): what this torch was built for
    bf16_supported: bool = False                        # native bf16 (compute capability 8.0+), not emulated
    python: str = field(default_factory=_platform.python_version)
    torch: str = ""
    cuda: str | None = None                             # the CUDA version torch was built with
    driver: str | None = None                           # the NVIDIA driver (nvidia-smi)
    flash_attn: bool = False                            # the flash_attn package is importable
    sdpa: bool = True                                   # torch has scaled_dot_product_attention (2.0+)
    work_dir: str = "."
    checkpoint_dir: str = "."
    disk_free_gib: dict = field(default_factory=dict)   # folder -> GiB free
    ram_total_gib: float | None = None
    ram_available_gib: float | None = None
    torchrun_world_size: int | None = None              # WORLD_SIZE when launched by torchrun

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def built_for(self, gpu: GPU) -> bool | None:
        """Whether the installed torch has kernels for this GPU (None: the arch list is unknown)."""
        return torch_supports(gpu.capability, self.arch_list) if self.arch_list else None

    def summary(self) -> str:
        if not self.gpus:
            return "no GPU (CPU only)"
        names = sorted({g.name for g in self.gpus})
        first = self.gpus[0]
        return (f"{self.gpu_count} x {' / '.join(names)} ({first.sm}, "
                f"{min(g.memory_gib for g in self.gpus):.1f} GiB)")

    def report(self) -> str:
        """The hardware report, a few lines of plain text."""
        versions = f"Python {self.python} | torch {self.torch or '?'}"
        if self.cuda:
            versions += f" (CUDA {self.cuda})"
        if self.driver:
            versions += f" | NVIDIA driver {self.driver}"
        lines = [versions]
        if not self.gpus:
            lines.append("GPU: none visible to torch")
        for i, gpu in enumerate(self.gpus):
            built = {True: "yes", False: "NO", None: "unknown"}[self.built_for(gpu)]
            lines.append(f"GPU {i}: {gpu.name}, compute capability {gpu.capability[0]}.{gpu.capability[1]} "
                         f"({gpu.sm}), {gpu.memory_gib:.1f} GiB, torch built for it: {built}")
        if self.gpus:
            lines.append(f"bf16: {'yes' if self.bf16_supported else 'no (native bf16 needs compute capability 8.0+)'}"
                         f"; torch built for: {', '.join(self.arch_list) or 'unknown'}")
        disk = ", ".join(f"{gib:.1f} GiB free in {folder}" for folder, gib in self.disk_free_gib.items())
        lines.append(f"disk: {disk or 'unknown'}")
        if self.ram_total_gib is not None:
            available = f" ({self.ram_available_gib:.1f} GiB available)" if self.ram_available_gib is not None else ""
            lines.append(f"RAM: {self.ram_total_gib:.1f} GiB{available}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["gpus"] = [{**asdict(g), "sm": g.sm, "torch_built_for_it": self.built_for(g)} for g in self.gpus]
        data["gpu_count"] = self.gpu_count
        return data


def torch_supports(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch built for arch_list runs on a GPU of this compute capability.

    A cubin built for sm_XY runs on the same major version with minor >= Y (sm_80 code runs on an sm_86 card);
    PTX (compute_XY) is compiled at load time for any GPU of capability >= X.Y.
    """
    major, minor = capability
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)[a-z]?", arch)
        if not match:
            continue
        arch_major, arch_minor = divmod(int(match.group(2)), 10)
        if match.group(1) == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if match.group(1) == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def _disk_free_gib(folder: str) -> float | None:
    try:
        return round(resources.free_disk_bytes(folder) / GIB, 1)
    except OSError:
        return None


def _ram_gib() -> tuple[float | None, float | None]:
    return tuple(None if n is None else round(n / GIB, 1) for n in resources.ram_bytes())


def _driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _gpus() -> tuple[list[GPU], list[str], bool]:
    """(the GPUs torch sees, what it was built for, native bf16) from device properties: no tensor, no memory taken."""
    import torch

    if not torch.cuda.is_available():
        return [], [], False
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GPU(props.name, (props.major, props.minor), round(props.total_memory / GIB, 2)))
    try:
        bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.3 has no including_emulation (and reports native support only)
        bf16 = bool(torch.cuda.is_bf16_supported())
    return gpus, list(torch.cuda.get_arch_list()), bf16


def read_hardware(work_dir: str = ".", checkpoint_dir: str = ".") -> Hardware:
    """Read this machine: versions, GPUs and what torch was built for, bf16, free disk, RAM.

    Reads device properties only: no tensor is created, so no memory is taken on the GPUs.
    """
    import torch

    gpus, arch_list, bf16 = _gpus()
    disk = {}
    for folder in dict.fromkeys([work_dir, checkpoint_dir]):
        free = _disk_free_gib(folder)
        if free is not None:
            disk[folder] = free
    ram_total, ram_available = _ram_gib()
    world = os.environ.get("WORLD_SIZE") if "LOCAL_RANK" in os.environ else None
    return Hardware(
        gpus=gpus, arch_list=arch_list, bf16_supported=bf16, torch=torch.__version__, cuda=torch.version.cuda,
        driver=_driver_version() if gpus else None,
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
        sdpa=hasattr(torch.nn.functional, "scaled_dot_product_attention"),
        work_dir=work_dir, checkpoint_dir=checkpoint_dir, disk_free_gib=disk,
        ram_total_gib=ram_total, ram_available_gib=ram_available,
        torchrun_world_size=int(world) if world else None,
    )


def check_gpus_supported(hardware: Hardware) -> None:
    """Refuse a GPU the installed torch has no kernels for (Kaggle's P100 is sm_60; current wheels start at sm_75)."""
    for gpu in hardware.gpus:
        if hardware.built_for(gpu) is False:
            built = [divmod(int(m.group(1)), 10) for a in hardware.arch_list
                     if (m := re.fullmatch(r"sm_(\d+)[a-z]?", a))]
            minimum = f" (compute capability {min(built)[0]}.{min(built)[1]} or newer)" if built else ""
            raise FreetuneError(
                f"This GPU, {gpu.name} (compute capability {gpu.capability[0]}.{gpu.capability[1]}, {gpu.sm}), "
                f"is too old for the installed PyTorch {hardware.torch}, which was built for "
                f"{', '.join(hardware.arch_list)}: nothing can train on it. Pick a supported GPU{minimum} "
                f"instead: {SUPPORTED_GPU_ADVICE}.")


@dataclass(frozen=True)
class VarlenProbe:
    """What this process's GPU said when its variable-length attention kernels ran against sdpa (probe_varlen)."""

    works: bool
    why: str                # the probe's own words: which kernel passed, or why each failed
    kernel: str = ""        # the kernel's name as the plan shows it ("FlashAttention-2", ...)
    efficient: bool = False  # the memory-efficient kernel, which a T4 (sm75) runs too
    attention: str = ""     # the attn_implementation it is registered under with transformers


def probe_varlen(policy: str) -> VarlenProbe | None:
    """Run the policy's variable-length kernels once on this process's GPU (freetune's attention module keeps the
    answer for the run); None where the policy has none (a CPU run)."""
    from freetune.speed.attention import (EFFICIENT_BACKENDS, POLICY_BACKENDS, VARLEN_ATTENTION, VARLEN_KERNEL_NAMES,
                                          varlen_backend, varlen_works)

    if policy not in POLICY_BACKENDS:
        return None
    device = this_gpu()
    works, why = varlen_works(device, policy)
    backend = varlen_backend(device)
    return VarlenProbe(works, why, VARLEN_KERNEL_NAMES.get(backend, "attention"), backend in EFFICIENT_BACKENDS,
                       VARLEN_ATTENTION)


def this_gpu() -> int:
    """This process's GPU (under torchrun, LOCAL_RANK's), where the varlen kernel is probed and its choice kept:
    probing GPU 0 from every rank would put a CUDA context on it for each of them."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def disk_warnings(hardware: Hardware, shape) -> list[str]:
    """Folders without room for checkpoints and the merged 16-bit export of `shape` (a ModelShape or None)."""
    # Checkpoints are small (the adapter and its optimizer state); the merged export writes the whole model in
    # 16 bits, which is what needs the room.
    need = MIN_FREE_DISK_GIB + (shape.total_params * 2 / GIB if shape is not None else 0)
    return [f"only {free:.1f} GiB free in {folder}: checkpoints and the merged 16-bit export need ~{need:.1f} GiB. "
            f"Free some space or point output_dir elsewhere"
            for folder, free in hardware.disk_free_gib.items() if free < need]
