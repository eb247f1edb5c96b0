"""What the machine has, as preflight reads it (freetune.preflight.read_hardware): its GPUs, what the installed torch
was built for, disk and RAM. Its own module so that the plan's choices (freetune.choices) and the planner
(freetune.preflight) both read it without importing each other."""

from __future__ import annotations

import platform as _platform
import re
from dataclasses import asdict, dataclass, field


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
