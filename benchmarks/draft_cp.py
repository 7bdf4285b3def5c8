"""A draft's training step (training-time test, distilled loss, forward + backward) three ways: DraftHead.training_loss
on a dense [B, T] batch (its rows through ring and branch attention on one rank: ops.attention's consistent core,
like every draft attention since the draft's dense softmax went), cp_draft_loss on the same sequences packed in one
row on one process, and cp_draft_loss over 2 gloo ranks (wall of the slower rank, reduce_gradients included).
SmolLM2-135M's shape (hidden 576, 9/3 heads, head_dim 64, vocab 49152), a 1-layer draft over 8,192 tokens, 3
steps; random weights and features (the target only lends its embedding and head). 1 torch thread per process;
median wall and process CPU seconds over --repeat steps after a warm-up step.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/draft_cp.py --batch 16 --length 110
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel_overhead import _model, _timed  # noqa: E402

from nemo_rz import ops  # noqa: E402
from nemo_rz.models.draft import DraftHead  # noqa: E402
from nemo_rz.parallel.context import ZigzagShard, cp_draft_loss, reduce_gradients  # noqa: E402

STEPS, VOCAB = 3, 8192


def _setup(batch: int, length: int):
    """Target, draft, and the batch's ids, aux features and final hidden states, [B, T] and flattened."""
    target = _model("smollm2-135m", 3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, target.config.vocab_size, (batch, length), generator=g)
    h = target.config.hidden_size
    aux, final = torch.randn(batch * length, 3 * h, generator=g), torch.randn(batch * length, h, generator=g)
    torch.manual_seed(0)
    draft = DraftHead(target.config, (0, 1, 2), 1, VOCAB)
    draft.choose_vocab(ids)
    return target, draft, ids, aux, final


def _dense_step(target, draft, ids, aux, final):
    draft.zero_grad(set_to_none=True)
    loss, _ = draft.training_loss(target, aux, ids, torch.ones(ids.shape[0], ids.shape[1] - 1), STEPS, final=final)
    loss.backward()


def _cp_step(target, draft, ids, aux, final, group=None):
    draft.zero_grad(set_to_none=True)
    b, length = ids.shape
    cu = list(range(0, b * length + 1, length))
    shard = ZigzagShard(cu, dist.get_world_size() if dist.is_initialized() else 1, dist.get_rank() if dist.is_initialized() else 0)
    part, _, _ = cp_draft_loss(draft, target, aux[shard.index], final[shard.index], ids.reshape(-1),
                               torch.ones(b * length, dtype=torch.bool), cu, STEPS, group=group)
    part.backward()
    reduce_gradients(draft, group)


def _worker(rank, world, port, batch, length, repeat, out_dir):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        inputs = _setup(batch, length)
        with ops.use_kernels("consistent"):
            result = _timed(lambda: _cp_step(*inputs), repeat, dist.barrier)
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=110)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if args.repeat < 1 or args.batch < 1 or args.length < STEPS + 2:
        sys.exit(f"--repeat {args.repeat}, --batch {args.batch}, --length {args.length}: need at least 1 timed step, "
                 f"1 sequence and {STEPS + 2} tokens")
    torch.set_num_threads(1)
    inputs = _setup(args.batch, args.length)
    with ops.use_kernels("consistent"):
        rows = {"DraftHead.training_loss, dense batch, 1 process": _timed(lambda: _dense_step(*inputs), args.repeat),
                "cp_draft_loss, packed row, 1 process": _timed(lambda: _cp_step(*inputs), args.repeat)}
    with tempfile.TemporaryDirectory() as out, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        mp.spawn(_worker, args=(2, port, args.batch, args.length, args.repeat, out), nprocs=2, join=True)
        ranks = [json.loads(Path(out, f"{r}.json").read_text()) for r in range(2)]
    rows["cp_draft_loss, 2 ranks over gloo (slower rank)"] = tuple(max(r[i] for r in ranks) for i in range(2))
    print(f"# {datetime.date.today()} draft training step, SmolLM2-135M shape, batch {args.batch} x {args.length} tokens, "
          f"{STEPS} steps, draft vocabulary {VOCAB}; 1 torch thread per process; load average at the end "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| run | fwd+bwd wall s | vs dense | CPU s |")
    print("|---|---|---|---|")
    base = next(iter(rows.values()))[0]
    for name, (wall, cpu) in rows.items():
        print(f"| {name} | {wall:.3f} | {wall / base:.2f}x | {cpu:.3f} |")


if __name__ == "__main__":
    main()
