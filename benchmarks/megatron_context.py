"""Step time of the Megatron learner with context parallelism: megatron.cp=2 (2 ranks) against cp=1 (1 process).

A step is MegatronLearner.rl_step on one RL batch (forward, loss, backward with the ranks' gradients added in
the fixed tree, Adam, rank 0's Decoder mirror following), every process on 1 torch thread. Rounds alternate one
cp=1 launch and one cp=2 launch (launch.start, the train CLI's launcher), each timing --repeat steps after one
warm-up step; the report gives each round's median wall seconds per step and the paired ratio cp2/cp1, and
each launch's process CPU seconds per step (rank 0's; on a shared machine the wall ratio is the one to read
against the load, the CPU time shows how the work splits).

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/megatron_context.py --shape default --rounds 3

With --draft, both learners co-train a draft (the default job's draft: 1 layer, 3 training-time-test steps, EAGLE-3's
aux layers, distilled) in every step: at cp=1 on the dense batch (DraftHead.training_loss), at cp=2 on each rank's
own tokens through the ring and rank-local branch attention (DraftTrainer.context_step); the step then includes the
draft's forward, backward, tree reduce and Adam.

    python benchmarks/megatron_context.py --shape default --rounds 3 --draft

Shapes: default = the default job's model (hidden 64, 2 layers, 4/2 heads, head_dim 16, a 48-token vocabulary)
and its learner batch (32 prompts x 4 samples, sequences of 12-28 tokens: one key block each, so the ring only
deals sequences round the ranks); long = the same model on 8 sequences of 256-512 tokens (max_position 512),
where each sequence's attention crosses the ranks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {"default": dict(batch=128, lengths=(12, 28), max_pos=64), "long": dict(batch=8, lengths=(256, 512), max_pos=512)}


def _setup(shape: str):
    from nemo_rz.algorithms.advantages import group_advantages
    from nemo_rz.generation.packing import Packed
    from nemo_rz.models import Decoder, DecoderConfig

    s = SHAPES[shape]
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=48, hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                                  num_kv_heads=2, qk_norm=True, max_position_embeddings=s["max_pos"]))
    g = torch.Generator().manual_seed(1)
    lo, hi = s["lengths"]
    lengths = torch.randint(lo, hi + 1, (s["batch"],), generator=g)
    length = int(lengths.max())
    ids = torch.randint(0, 48, (s["batch"], length), generator=g)
    t = torch.arange(length - 1)[None, :]
    mask = ((t >= lo // 2) & (t < lengths[:, None] - 1)).float()
    rollout = -torch.rand(s["batch"], length - 1, generator=g) * mask
    rewards = (torch.rand(s["batch"], generator=g) < 0.5).float()
    return model, Packed(ids, lengths, rollout, mask), group_advantages(rewards, 4)


def _draft(model):
    """The default job's co-trained draft (conf/default.yaml's draft section), distilled from the learner's forward."""
    from nemo_rz.algorithms.draft import DraftTrainer
    from nemo_rz.models.draft import DraftHead

    torch.manual_seed(1)
    return DraftTrainer(DraftHead(model.config, None, 1, 8192), "cotrain", 1e-3, 1.0, steps=3, k=4, grad_clip=1.0)


def _rank(cp: int, shape: str, repeat: int, out: str, draft: bool = False) -> None:
    """One launch: every rank builds its part of the learner; rank 0 times the steps."""
    from nemo_rz import ops
    from nemo_rz.runtime.megatron import distributed
    from nemo_rz.runtime.megatron.layout import Layout
    from nemo_rz.runtime.megatron.learner import MegatronLearner

    torch.set_num_threads(1)
    ops.set_kernels("consistent")
    layout = Layout(cp=cp)
    distributed.init(layout)
    if torch.distributed.get_rank():
        MegatronLearner.follow()
        return
    model, batch, adv = _setup(shape)
    lrn = MegatronLearner(model, layout, 1e-4, 1.0, 1.0, "reinforce_zero", "unclipped", {})
    if draft:
        lrn.add_aux_loss(_draft(model))
    wall, cpu = [], []
    for i in range(repeat + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        lrn.rl_step(batch, adv)
        if i:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    lrn.stop()
    Path(out).write_text(json.dumps(dict(wall=statistics.median(wall), cpu=statistics.median(cpu))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="default")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--draft", action="store_true", help="co-train the default job's draft in every step")
    p.add_argument("--rank", nargs=2, metavar=("CP", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return _rank(int(args.rank[0]), args.shape, args.repeat, args.rank[1], args.draft)
    from nemo_rz.runtime.megatron import launch

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            row = {}
            for cp in (1, 2):
                out = Path(tmp) / f"r{r}_cp{cp}.json"
                code = launch.start([sys.executable, __file__, "--shape", args.shape, "--repeat", str(args.repeat),
                                     *(["--draft"] if args.draft else []), "--rank", str(cp), str(out)], cp)
                if code:
                    raise SystemExit(f"the cp={cp} launch ended with exit code {code}")
                row[f"cp{cp}"] = json.loads(out.read_text())
            row["wall_ratio_cp2_over_cp1"] = row["cp2"]["wall"] / row["cp1"]["wall"]
            rounds.append(row)
            print(json.dumps(row), flush=True)
    ratios = [r["wall_ratio_cp2_over_cp1"] for r in rounds]
    print(json.dumps(dict(date=datetime.date.today().isoformat(), shape=args.shape, repeat=args.repeat, draft=args.draft,
                          load_average=os.getloadavg()[0],
                          median_wall_ratio_cp2_over_cp1=statistics.median(ratios), rounds=rounds)))


if __name__ == "__main__":
    main()
