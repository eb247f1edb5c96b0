"""Issue 49: grouped-query causal attention over packed rows, forward + backward, in the layouts freetune could call the
memory-efficient kernel with, on one GPU (the T4's kernel: PyTorch's memory-efficient one, fp16).

    python3 -m scripts.attention_gpu [--shape tinyllama|qwen2.5-1.5b] [--rows 8] [--length 1024]

Layouts, each checked against the first one's output and gradients:
  strided       freetune's "efficient" backend: one call per kv head, k and v a stride-0 view repeated for its q heads
  copied        freetune's "efficient_copied": up to 4 parts of whole kv heads, k and v repeated into copies
  whole         all heads in one call, k and v repeated into copies: what the plan picks where the copies fit
                (Kernels.attention_whole_heads)
  dense_sdpa    scaled_dot_product_attention on (rows, heads, length, dim) with is_causal, k and v repeated, the
                memory-efficient backend only: what Unsloth runs when every row has the same length
Per layout: the median ms of forward, and of forward + backward, over 20 repeats; the memory the call adds at its
peak; the kernels the profiler saw, with their time. The backward's key splits (num_splits_key) by hand against
PyTorch's choice: scripts/attention_key_splits.py.
"""

from __future__ import annotations

import argparse
import statistics

SHAPES = {"tinyllama": (32, 4, 64), "qwen2.5-1.5b": (12, 2, 128)}  # q heads, kv heads, head dim


def layouts(q, k, v, cu, max_len, scale):
    import torch.nn.functional as F

    from freetune.speed.attention_efficient import LAYOUTS, efficient_op

    groups = q.shape[1] // k.shape[1]
    rows = cu.numel() - 1

    def through_op(layout):
        return lambda: efficient_op()(q, k, v, cu, max_len, scale, layout)

    def dense_sdpa():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def heads_first(t):
            return t.unflatten(0, (rows, -1)).transpose(1, 2)

        kr, vr = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            out = F.scaled_dot_product_attention(heads_first(q), heads_first(kr), heads_first(vr), is_causal=True,
                                                 scale=scale)
        return out.transpose(1, 2).flatten(0, 1)

    return {**{layout: through_op(layout) for layout in LAYOUTS}, "dense_sdpa": dense_sdpa}


def main() -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from scripts.step_breakdown import is_annotation

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=1024)
    args = parser.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    tokens = args.rows * args.length
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(h):
        return torch.randn(tokens, h, dim, device="cuda", dtype=torch.float16, generator=gen).requires_grad_()

    # q, k and v as a layer makes them: slices of one projection's output would be views; separate tensors here
    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    grad = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.float16, generator=gen)
    cu = torch.arange(0, tokens + 1, args.length, device="cuda", dtype=torch.int32)
    scale = dim ** -0.5
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.shape}: {heads} q heads, {kv_heads} kv "
          f"heads, dim {dim} | {args.rows} rows x {args.length} tokens, fp16", flush=True)

    reference = None
    print(f"{'layout':12s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'extra MiB':>10s} {'max |d|':>9s}  kernels (calls, ms)")
    for name, fn in layouts(q, k, v, cu, args.length, scale).items():
        try:
            def run(backward: bool):
                for t in (q, k, v):
                    t.grad = None
                out = fn()
                if backward:
                    out.backward(grad)
                return out

            for _ in range(3):
                run(True)
            torch.cuda.synchronize()
            times = {}
            for backward in (False, True):
                ms = []
                for _ in range(20):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    run(backward)
                    end.record()
                    torch.cuda.synchronize()
                    ms.append(start.elapsed_time(end))
                times[backward] = statistics.median(ms)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = run(True)
            torch.cuda.synchronize()
            extra = (torch.cuda.max_memory_allocated() - base) / 2**20
            got = [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]
            if reference is None:
                reference = got
            diff = max((a - b).abs().max().item() for a, b in zip(got, reference))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                run(True)
                torch.cuda.synchronize()
            kernels = sorted(((e.key, e.count, e.self_device_time_total / 1000) for e in prof.key_averages()
                              if e.self_device_time_total > 0 and not is_annotation(e.key)), key=lambda t: -t[2])[:5]
            listed = "; ".join(f"{n[:60]} ({c}, {t:.2f})" for n, c, t in kernels)
            print(f"{name:12s} {times[False]:8.3f} {times[True]:11.3f} {extra:10.1f} {diff:9.4f}  {listed}", flush=True)
        except Exception as exc:  # a layout this torch or GPU refuses: say so, go on with the others
            print(f"{name:12s} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)


if __name__ == "__main__":
    main()
