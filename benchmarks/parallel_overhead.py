"""Context-parallel attention and decoder (2 ranks) vs one process, over gloo here.

CP: `ring_attention` forward + backward of a packed row; one process (the same function, and ops.attention with
its library backward) vs 2 gloo ranks (wall time of the slower rank). Decoder: a whole model's forward +
backward of the same packed row (`cp_token_logprobs`, the loss -sum of logprobs, `reduce_gradients`); one
process (the same functions, and `Decoder.token_logprobs` of the sequences padded into one batch) vs 2 ranks.
(Pipeline stages are Megatron's schedule now: benchmarks/megatron_pipeline.py times them.) Every process
runs 1 torch thread (the ranks together use 2 cores). Median wall and process CPU seconds over --repeat steps
after one warm-up step (CPU time: each rank's own, the larger of the two; it shows how the work splits
whatever else the cores run).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/parallel_overhead.py --shape tiny
    ... python benchmarks/parallel_overhead.py --shape realistic --parts decoder

Shapes: tiny = the default job's model (hidden 64, 2 layers, 4/2 heads, head_dim 16) and a learner batch of 64
sequences of 12-28 tokens; realistic = SmolLM2-135M's attention (9/3 heads, head_dim 64) on a packed row of
two 1,024-token sequences, its model with 2 of its 30 layers on that row (decoder).
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
from nemo_rz.parallel.context import ZigzagShard, cp_token_logprobs, reduce_gradients, ring_attention  # noqa: E402

SHAPES = {
    "tiny": dict(cp=dict(heads=4, kv_heads=2, dim=16, lengths=[12 + (7 * i) % 17 for i in range(64)]),
                 decoder=dict(preset="tiny", layers=2)),
    "realistic": dict(cp=dict(heads=9, kv_heads=3, dim=64, lengths=[1024, 1024]),
                      decoder=dict(preset="smollm2-135m", layers=2)),
}
PARTS = ("cp", "decoder")


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
    def cache(x):
        return torch.stack([torch.nn.functional.pad(x[a:b], (0, 0, 0, 0, 0, length - (b - a))).transpose(0, 1)
                            for a, b in zip(cu, cu[1:])])
    ops.attention(q, cache(k), cache(v), seq, pos, scale).sum().backward()


def _model(preset, layers):
    s = dict(shapes.PRESETS[preset], layers=layers)
    torch.manual_seed(0)
    cfg = DecoderConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
                        num_layers=s["layers"], num_heads=s["heads"], num_kv_heads=s["kv_heads"], head_dim=s["head_dim"],
                        tie_word_embeddings=s["tie"], rope_theta=s["rope_theta"], qk_norm=s["family"] == "qwen3")
    return Decoder(cfg)


def _decoder_model(shape):
    d, lengths = SHAPES[shape]["decoder"], SHAPES[shape]["cp"]["lengths"]
    model = _model(d["preset"], d["layers"])
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    return model, ids, _cu(lengths)


def _decoder_step(model, ids, cu, group=None):
    model.zero_grad(set_to_none=True)
    lp, _ = cp_token_logprobs(model, ids, cu, group)
    (-lp.sum()).backward()
    reduce_gradients(model, group)


def _dense_step(model, ids, cu):
    """Decoder.token_logprobs forward + backward of the row's sequences padded into one [B, T] batch."""
    model.zero_grad(set_to_none=True)
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    batch = torch.nn.utils.rnn.pad_sequence([ids[a:b] for a, b in zip(cu, cu[1:])], batch_first=True)
    (-model.token_logprobs(batch, torch.tensor(lengths)).sum()).backward()


def _worker(rank, world, port, shape, parts, repeat, out_dir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        c, out = SHAPES[shape]["cp"], {}
        if "cp" in parts:
            shard = ZigzagShard(_cu(c["lengths"]), world, rank)
            local = [x[shard.index] for x in _cp_inputs(c)]
            out["cp"] = _timed(lambda: _cp_step(local, shard, c["dim"] ** -0.5), repeat, dist.barrier)
        if "decoder" in parts:
            model, ids, cu = _decoder_model(shape)
            out["decoder"] = _timed(lambda: _decoder_step(model, ids, cu), repeat, dist.barrier)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def _one_process(shape, parts, repeat) -> dict:
    """{part: {run: (wall, cpu)}} of the one-process runs."""
    c, rows = SHAPES[shape]["cp"], {}
    if "cp" in parts:
        inputs, scale = _cp_inputs(c), c["dim"] ** -0.5
        one = ZigzagShard(_cu(c["lengths"]), 1, 0)
        rows["cp"] = {"ring_attention, 1 process": _timed(lambda: _cp_step(inputs, one, scale), repeat),
                      "ops.attention + library backward, 1 process": _timed(lambda: _ops_step(inputs, c["lengths"], scale), repeat)}
    if "decoder" in parts:
        model, ids, cu = _decoder_model(shape)
        rows["decoder"] = {"cp_token_logprobs, 1 process": _timed(lambda: _decoder_step(model, ids, cu), repeat),
                           "Decoder.token_logprobs (padded batch), 1 process": _timed(lambda: _dense_step(model, ids, cu), repeat)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.repeat < 1:
        sys.exit(f"--repeat {args.repeat}: need at least 1 timed step")
    parts = [part for part in PARTS if part in args.parts]
    torch.set_num_threads(1)
    rows = _one_process(args.shape, parts, args.repeat)
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_worker, args=(2, port, args.shape, parts, args.repeat, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    for part in parts:
        rows[part]["2 ranks over gloo (slower rank)"] = tuple(
            max(r[part][i] for r in ranks) for i in range(2))
    c, d = SHAPES[args.shape]["cp"], SHAPES[args.shape]["decoder"]
    print(f"# {datetime.date.today()} shape={args.shape} cp={c['heads']}/{c['kv_heads']} heads, head_dim {c['dim']}, "
          f"{len(c['lengths'])} sequences, {sum(c['lengths'])} tokens; decoder={d['preset']} x {d['layers']} layers on "
          f"that row; 1 torch thread per process; load average at the end {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    print("| part | run | fwd+bwd wall s | vs 1 process | CPU s |")
    print("|---|---|---|---|---|")
    for part in parts:
        base = next(iter(rows[part].values()))
        for name, (wall, cpu) in rows[part].items():
            print(f"| {part} | {name} | {wall:.3f} | {wall / base[0]:.2f}x | {cpu:.3f} |")


if __name__ == "__main__":
    main()
