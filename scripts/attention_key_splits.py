"""The memory-efficient attention kernel's backward at the long-row T4 run's shapes, by key splits (issue 49).

freetune's "efficient" attention (freetune.speed.attention_efficient) calls aten._efficient_attention_backward without
`num_splits_key`, so PyTorch's own heuristic picks how many parts of the keys a block of queries' gradient is split
into. The profile of the long-row T4 step (docs/performance.md) has attention's backward at ~3.8x its forward, where
the work is ~2.5x. This prints the kernels' time for each split count and layout, and how far each one's gradients
are from the default's, so a choice is made from measurements. Needs a CUDA GPU; prints a table. Measured on an H100
(2026-12-06, docs/performance.md): PyTorch's own choice is as fast as any, so freetune leaves it. The layouts' forward
and backward side by side: scripts/attention_gpu.py.

    python3 scripts/attention_key_splits.py [--tokens 8192] [--row 1024] [--heads 12] [--kv-heads 2] [--dim 128]
"""

from __future__ import annotations

import argparse

import torch

from freetune.reach.torch import efficient_attention_backward, efficient_attention_forward
from freetune.speed.attention_efficient import _parts, _repeated

SPLITS = (None, 1, 2, 4, 8, 16)


def forward(q, k, v, cu, row, layout):
    # the layouts of freetune.speed.attention_efficient ("strided": a call per kv head; "whole": all heads at once)
    groups = q.shape[1] // k.shape[1]
    saved = []
    for qs, ks in _parts(q, k, layout):
        qp, kp, vp = q[:, qs], _repeated(k[:, ks], groups, layout), _repeated(v[:, ks], groups, layout)
        out, lse = efficient_attention_forward(qp[None], kp[None], vp[None], None, cu, cu, row, row, 0.0, 1, True,
                                               scale=None)[:2]
        saved.append((qp, kp, vp, out, lse))
    return saved


def backward(saved, grads, cu, row, splits, layout):
    unused = torch.empty((), dtype=torch.long)
    results = []
    for (qp, kp, vp, out, lse), g in zip(saved, grads):
        kwargs = {} if splits is None else {"num_splits_key": splits}
        results.append(efficient_attention_backward(
            g, qp[None], kp[None], vp[None], None, out, cu, cu, row, row, lse, 0.0, unused, unused, 1, False,
            scale=None, **kwargs)[:3])
    return results


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--row", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()

    torch.manual_seed(0)
    device, dtype = "cuda", torch.float16
    q = torch.randn(args.tokens, args.heads, args.dim, device=device, dtype=dtype)
    k = torch.randn(args.tokens, args.kv_heads, args.dim, device=device, dtype=dtype)
    v = torch.randn(args.tokens, args.kv_heads, args.dim, device=device, dtype=dtype)
    cu = torch.arange(0, args.tokens + 1, args.row, device=device, dtype=torch.int32)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: {args.tokens} tokens in rows of {args.row}, "
          f"{args.heads} q / {args.kv_heads} kv heads of {args.dim}; ms a layer, {args.reps} repetitions")
    print("| layout | num_splits_key | forward ms | backward ms | backward / forward | max |d| vs default |")
    print("|---|---|---|---|---|---|")
    for layout in ("strided", "whole"):
        saved = forward(q, k, v, cu, args.row, layout)
        grads = [torch.randn_like(s[3]) for s in saved]
        forward_ms = timed(lambda: forward(q, k, v, cu, args.row, layout), args.reps)
        reference = backward(saved, grads, cu, args.row, None, layout)
        for splits in SPLITS:
            try:
                got = backward(saved, grads, cu, args.row, splits, layout)
                ms = timed(lambda: backward(saved, grads, cu, args.row, splits, layout), args.reps)
            except RuntimeError as error:
                print(f"| {layout} | {splits} | {forward_ms:.3f} | failed: {str(error).splitlines()[0][:80]} | | |")
                continue
            diff = max((a.float() - b.float()).abs().max().item()
                       for pair_got, pair_ref in zip(got, reference) for a, b in zip(pair_got, pair_ref))
            print(f"| {layout} | {splits} | {forward_ms:.3f} | {ms:.3f} | {ms / forward_ms:.2f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
