"""Consistent vs fast MoE expert arithmetic at a realistic layer shape: route_topk, expert_linear (gate/up and
down), the gated activation and moe_combine, forward only (what a rollout step runs per MoE layer).

    python benchmarks/moe_ops.py                         # 8 experts, top-2, hidden 512, expert intermediate 1024
    python benchmarks/moe_ops.py --tokens 8 32 256 --repeats 30 --threads 1

Timing is process CPU time (all threads), the two kernel sets interleaved call by call so that a neighbour's
load hits both alike; the median per layer call is reported. With more than one torch thread, the fast
products' OpenMP workers spin while waiting, and that CPU time counts (consistent products run on one thread).
The last column checks the contract on the same
inputs: tokens whose output bits differ between the batch and a call holding that token alone.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from nemo_rz import ops


def moe_layer(hidden, router_logits, gate_up_t, down_t, k):
    """The expert half of a MoE block: top-k routing, per-expert gate/up, SwiGLU, per-expert down, combine."""
    weights, experts = ops.route_topk(ops.softmax(router_logits), k)
    total = weights[:, :1]
    for j in range(1, k):  # renormalised over the chosen k (Qwen3-MoE), summed in one fixed order
        total = total + weights[:, j : j + 1]
    weights = weights / total
    flat = experts.reshape(-1)
    rows = hidden.repeat_interleave(k, dim=0)  # token n's slot j at row n * k + j
    gate_up = ops.expert_linear(rows, flat, gate_up_t)
    inter = gate_up.shape[1] // 2
    act = ops.silu_and_mul(gate_up[:, :inter], gate_up[:, inter:])
    return ops.moe_combine(ops.expert_linear(act, flat, down_t), weights, experts)


def cpu_ms(fn) -> float:
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8, 32, 256])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate
    gate_up_t = torch.randn(e, h, 2 * i, generator=g) / h ** 0.5
    down_t = torch.randn(e, i, h, generator=g) / i ** 0.5
    print(f"{e} experts, top-{args.top_k}, hidden {h}, expert intermediate {i}; torch threads {torch.get_num_threads()}")
    print(f"{'tokens':>6} {'consistent ms':>14} {'fast ms':>8} {'ratio':>6}   tokens differing alone vs batch (consistent / fast)")
    for n in args.tokens:
        hidden = torch.randn(n, h, generator=g)
        logits = torch.randn(n, e, generator=g)
        call = lambda: moe_layer(hidden, logits, gate_up_t, down_t, args.top_k)  # noqa: E731
        with torch.no_grad():
            times = {"consistent": [], "fast": []}
            for name in times:  # warm-up: probes, weight copies
                with ops.use_kernels(name):
                    call()
            for _ in range(args.repeats):
                for name in times:
                    with ops.use_kernels(name):
                        times[name].append(cpu_ms(call))
            differing = {}
            for name in times:
                with ops.use_kernels(name):
                    batch = call()
                    alone = torch.cat([moe_layer(hidden[t : t + 1], logits[t : t + 1], gate_up_t, down_t, args.top_k)
                                       for t in range(n)])
                    differing[name] = int((alone != batch).any(-1).sum())
        c, f = statistics.median(times["consistent"]), statistics.median(times["fast"])
        print(f"{n:>6} {c:>14.2f} {f:>8.2f} {c / f:>6.2f}   {differing['consistent']} / {differing['fast']}")


if __name__ == "__main__":
    main()
