"""Host time per matmul launch on this GPU, per cuBLAS backend, with PyTorch's own cuBLAS workspace and with a T4's.

Why: a QLoRA step of a 1B model is bound by the host's launches, and bench.py's emulated T4 modes could set a T4's
cuBLAS workspace (--t4-cublas-workspace). On an H200 that small workspace made every matmul cost about three times
the host time of the default one (cuBLASLt about ten times): an emulation artefact both tools would pay, which a T4's
own kernels do not. Each setting runs in a process of its own (the workspace is read once per process).

Usage (GPU machine):  python3 scripts/matmul_host_cost.py > reports/gpu/matmul_host_cost.jsonl
Each line: the backend, the workspace setting, and per matmul shape (LoRA-sized and weight-sized, 7,144 tokens as in
the 4 GiB benchmark) the host microseconds per call and the wall microseconds per call (host-bound where equal).
"""

import json
import os
import subprocess
import sys
import time

T4_WORKSPACE = ":4096:2:16:8"
TOKENS = 7144
SHAPES = [((TOKENS, 2048), (2048, 16)), ((TOKENS, 16), (16, 2048)), ((16, TOKENS), (TOKENS, 2048)),
          ((TOKENS, 2048), (2048, 2048)), ((TOKENS, 2048), (2048, 5632))]


def per_call_us(fn, calls: int = 300) -> tuple[float, float]:
    """(host us, wall us) per call of fn, the GPU drained before and after."""
    import torch

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    for _ in range(calls):
        fn()
    cpu1 = time.thread_time()
    torch.cuda.synchronize()
    wall1 = time.perf_counter()
    return round((cpu1 - cpu0) / calls * 1e6, 1), round((wall1 - wall0) / calls * 1e6, 1)


def measure(backend: str) -> dict:
    import torch

    if backend != "default":
        torch.backends.cuda.preferred_blas_library(backend)
    out = {"backend": str(torch.backends.cuda.preferred_blas_library()),
           "workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "default")}
    for a, b in SHAPES:
        x = torch.randn(*a, device="cuda", dtype=torch.float16)
        w = torch.randn(*b, device="cuda", dtype=torch.float16)
        host, wall = per_call_us(lambda: torch.mm(x, w))
        out[f"mm {a[0]}x{a[1]} @ {b[0]}x{b[1]}"] = {"host_us": host, "wall_us": wall}
    y = torch.randn(TOKENS, 2048, device="cuda", dtype=torch.float16)
    h = torch.randn(TOKENS, 16, device="cuda", dtype=torch.float16)
    lora_b = torch.randn(2048, 16, device="cuda", dtype=torch.float16)
    out["addmm_ (a LoRA B term, in place)"] = dict(zip(("host_us", "wall_us"),
                                                       per_call_us(lambda: y.addmm_(h, lora_b.t(), alpha=2.0))))
    out["mul_ (one elementwise launch, for scale)"] = dict(zip(("host_us", "wall_us"), per_call_us(lambda: h.mul_(1.0))))
    return out


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1])), flush=True)
        return
    for workspace in (None, T4_WORKSPACE):
        for backend in ("default", "cublas", "cublaslt"):
            env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
            if workspace:
                env["CUBLAS_WORKSPACE_CONFIG"] = workspace
            subprocess.run([sys.executable, __file__, backend], env=env, check=True)


if __name__ == "__main__":
    main()
