"""Context-parallel attention (2 ranks) and a 2-stage pipeline vs one process, over gloo on this machine.

CP: `ring_attention` forward + backward of a packed row; one process (the same function, and ops.attention with
its library backward) vs 2 gloo ranks (wall time of the slower rank). PP: one `Pipeline.step` (GPipe,
micro-batches, token-logprob loss) in one process vs 2 stages. Every process runs 1 torch thread (the ranks
together use 2 cores). Median wall and process CPU seconds over --repeat steps after one warm-up step (CPU
time: each rank's own, the larger of the two; it shows how the work splits whatever else the cores run).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/parallel_overhead.py --shape tiny
    ... python benchmarks/parallel_overhead.py --shape realistic

Shapes: tiny = the default job's model (hidden 64, 2 layers, 4/2 heads, head_dim 16) and a learner batch of 64
sequences of 12-28 tokens; realistic = SmolLM2-135M's attention (9/3 heads, head_dim 64) on a packed row of
two 1,024-token sequences, and its model with 8 of its 30 layers on a [4, 128] batch.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models import Decoder, DecoderConfig  # noqa: E402
from nemo_rz.parallel.context import ZigzagShard, ring_attention  # noqa: E402
from nemo_rz.parallel.pipeline import Pipeline  # noqa: E402

SHAPES = {
    "tiny": dict(cp=dict(heads=4, kv_heads=2, dim=16, lengths=[12 + (7 * i) % 17 for i in range(64)]),
                 pp=dict(preset="tiny", layers=2, batch=64, length=16, micro=4)),
    "realistic": dict(cp=dict(heads=9, kv_heads=3, dim=64, lengths=[1024, 1024]),
                      pp=dict(preset="smollm2-135m", layers=8, batch=4, length=128, micro=4)),
}


def _cp_inputs(c):
    g = torch.Generator().manual_seed(0)
    n = sum(c["lengths"])
    return [torch.randn(n, h, c["dim"], generator=g) for h in (c["heads"], c["kv_heads"], c["kv_heads"])]


def _cu(lengths):
    return [0] + torch.tensor(lengths).cumsum(0).tolist()


def _timed(fn, repeat, barrier=lambda: None):
    """(median wall seconds, median process CPU seconds) of fn over `repeat` calls after a warm-up call."""
    wall, cpu = [], []
    for i in range(repeat + 1):
        barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        c1 = time.process_time()
        barrier()
        if i:
            wall.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
    return statistics.median(wall), statistics.median(cpu)


def _cp_step(inputs, shard, scale, group=None):
    xs = [x.clone().requires_grad_() for x in inputs]
    ring_attention(*xs, shard, scale, group).sum().backward()


def _ops_step(inputs, lengths, scale):
    q, k, v = [x.clone().requires_grad_() for x in inputs]
    seq = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    cu, length = _cu(lengths), max(lengths) + (-max(lengths)) % ops.KV_BLOCK
    cache = lambda x: torch.stack([torch.nn.functional.pad(x[a:b], (0, 0, 0, 0, 0, length - (b - a))).transpose(0, 1)
                                   for a, b in zip(cu, cu[1:])])
    ops.attention(q, cache(k), cache(v), seq, pos, scale).sum().backward()


def _pp_model(p):
    s = dict(shapes.PRESETS[p["preset"]], layers=p["layers"])
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                        num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                        tie_word_embeddings=s["tie"], rope_theta=s["rope_theta"], qk_norm=s["family"] == "qwen3")
    ids = torch.randint(0, s["vocab"], (p["batch"], p["length"]), generator=torch.Generator().manual_seed(1))
    return Decoder(cfg), ids


def _loss(model, hidden, ids):
    b, length = ids.shape
    h = hidden.view(b, length, -1)[:, :-1].reshape(b * (length - 1), -1)
    return -ops.token_logprobs(model.logits(h), ids[:, 1:].reshape(-1)).mean()


def _pp_step(pipe, ids, micro):
    pipe.model.zero_grad(set_to_none=True)
    pipe.step(ids, micro, _loss)


def _worker(rank, world, port, shape, repeat, out_dir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        c, p = SHAPES[shape]["cp"], SHAPES[shape]["pp"]
        shard = ZigzagShard(_cu(c["lengths"]), world, rank)
        local = [x[shard.index] for x in _cp_inputs(c)]
        cp = _timed(lambda: _cp_step(local, shard, c["dim"] ** -0.5), repeat, dist.barrier)
        model, ids = _pp_model(p)
        pipe = Pipeline(model, dist.group.WORLD)
        pp = _timed(lambda: _pp_step(pipe, ids, p["micro"]), repeat, dist.barrier)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(dict(cp=cp, pp=pp)))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    c, p = SHAPES[args.shape]["cp"], SHAPES[args.shape]["pp"]
    inputs, scale = _cp_inputs(c), c["dim"] ** -0.5
    one = ZigzagShard(_cu(c["lengths"]), 1, 0)
    model, ids = _pp_model(p)
    pipe = Pipeline(model)
    torch.set_num_threads(1)
    rows = {
        "ring_attention / Pipeline.step, 1 process": (_timed(lambda: _cp_step(inputs, one, scale), args.repeat),
                                                      _timed(lambda: _pp_step(pipe, ids, p["micro"]), args.repeat)),
        "ops.attention + library backward, 1 process": (_timed(lambda: _ops_step(inputs, c["lengths"], scale), args.repeat), None),
    }
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_worker, args=(2, port, args.shape, args.repeat, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    rows["2 ranks / 2 stages over gloo (slower rank)"] = tuple(
        tuple(max(r[part][i] for r in ranks) for i in range(2)) for part in ("cp", "pp"))
    cp_base, pp_base = rows["ring_attention / Pipeline.step, 1 process"]
    print(f"# {datetime.date.today()} shape={args.shape} cp={c['heads']}/{c['kv_heads']} heads, head_dim {c['dim']}, "
          f"{len(c['lengths'])} sequences, {sum(c['lengths'])} tokens; pp={p['preset']} x {p['layers']} layers, "
          f"batch {p['batch']}x{p['length']}, {p['micro']} micro-batches; 1 torch thread per process; "
          f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| run | CP fwd+bwd wall s | vs 1 process | CP CPU s | PP step wall s | vs 1 process | PP CPU s |")
    print("|---|---|---|---|---|---|---|")

    def cells(x, base):
        return ["-"] * 3 if x is None else [f"{x[0]:.3f}", f"{x[0] / base[0]:.2f}x", f"{x[1]:.3f}"]

    for name, (cp, pp) in rows.items():
        print(f"| {name} | {' | '.join(cells(cp, cp_base) + cells(pp, pp_base))} |")

if __name__ == "__main__":
    main()
