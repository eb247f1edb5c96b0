"""One of freetune's Triton kernels compiled for a GPU architecture on a machine without a GPU, and what its main loop
costs: instructions a thread runs per loop step (by opcode), layout conversions, local memory (register spills),
shared memory.

Why: the lent GPU's time is scarce and a kernel's cost is mostly decided by what Triton makes of it: a layout
conversion through shared memory, a reduction across threads, a spill. Triton compiles for any target without the
device (its ptxas and nvdisasm come with it), so a change to a kernel can be read as a T4's (sm_75) and an H100's
(sm_90) machine code before any GPU time is spent. Issue 49's fourteenth session read the LoRA dropout product kernel
this way: with Triton 3.6, six layout conversions and, on sm_75, 90 local loads and stores a loop step, where the
kernel laid out by byte has one conversion and no spills (docs/performance.md). Counts are static, not timings, and
they move with Triton's version: the GPU decides.

Usage:  python scripts/kernel_sass.py _dropped_product_kernel --arch 75 --warps 2 \\
            --const PADDED=1536,R=16,ROWS=16,COLS=64,WHOLE_BYTES=1
Arguments are typed from their names (freetune.speed.triton_kernels' conventions): `*_ptr` fp16 pointers except those
in POINTER_TYPES, `scale` fp32, other scalars i32; sizes are taken as multiples of 16, as Triton specialises them at a
launch with such values (the long-row step's are).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
from collections import Counter

POINTER_TYPES = {"seed_ptr": "*i64", "bits_ptr": "*u8", "mask_ptr": "*u8", "part_ptr": "*fp32", "packed_ptr": "*u8",
                 "absmax_ptr": "*u8", "table_ptr": "*fp32", "kept_ptr": "*i1"}
NOT_MULTIPLES = ("threshold", "scale", "rank")  # scalars whose value is no size


def compile_kernel(name: str, arch: int, constants: dict, warps: int):
    """(the compiled kernel, its SASS text) for freetune.speed.triton_kernels' `name`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from freetune.speed import triton_kernels

    fn = getattr(triton_kernels, name)
    signature, attrs = {}, {}
    for i, param in enumerate(inspect.signature(fn.fn).parameters.values()):
        if param.name in constants:
            signature[param.name] = "constexpr"
        elif param.name.endswith("_ptr"):
            signature[param.name] = POINTER_TYPES.get(param.name, "*fp16")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif param.name == "scale":
            signature[param.name] = "fp32"
        else:
            signature[param.name] = "i32"
            if param.name not in NOT_MULTIPLES:
                attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    disasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    path = f"/tmp/kernel_sass_{os.getpid()}.cubin"
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    try:
        sass = subprocess.run([disasm, "-c", path], capture_output=True, text=True, check=True).stdout
    finally:
        os.remove(path)
    return kernel, sass


def loop_costs(kernel, sass: str) -> dict:
    """The first loop's instructions by opcode (from the first label a later branch jumps back to, to that branch; the
    whole kernel's where there is no loop), and the kernel's layout conversions, local memory and shared memory."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^\.(L_x_\d+):", line))}

    def opcodes(first: int, last: int) -> Counter:
        ops = Counter()
        for line in lines[first:last]:
            m = re.match(r"^\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
            if m:
                ops[m.group(1)] += 1
        return ops

    ops = opcodes(0, len(lines))
    for i, line in enumerate(lines):
        m = re.search(r"BRA\s+`\(\.(L_x_\d+)\)", line)
        # a branch back to an earlier label, over more than itself (the kernel's last line branches to itself)
        loop = opcodes(labels[m.group(1)], i + 1) if m and labels.get(m.group(1), i) < i else Counter()
        if sum(loop.values()) > 1:
            ops = loop
            break
    return {"loop_instructions": sum(ops.values()), "by_opcode": dict(ops.most_common()),
            "layout_conversions": kernel.asm["ttgir"].count("ttg.convert_layout"),
            "local_memory_ops": ops["LDL"] + ops["STL"], "shared_bytes": kernel.metadata.shared}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kernel")
    parser.add_argument("--arch", type=int, default=75, help="compute capability x 10 (75: a T4; 90: an H100)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--const", default="", help="the kernel's constexpr values: NAME=INT,...")
    args = parser.parse_args()
    constants = {k: int(v) for k, v in (kv.split("=") for kv in args.const.split(",") if kv)}
    costs = loop_costs(*compile_kernel(args.kernel, args.arch, constants, args.warps))
    print(f"{args.kernel} sm_{args.arch} {args.warps} warps {constants}: {costs['loop_instructions']} instructions a "
          f"loop step, {costs['layout_conversions']} layout conversions, {costs['local_memory_ops']} local memory "
          f"ops, {costs['shared_bytes']} B shared")
    print("  " + ", ".join(f"{op} {n}" for op, n in list(costs["by_opcode"].items())[:16]))


if __name__ == "__main__":
    main()
