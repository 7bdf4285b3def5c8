"""The layout matrix's one launch of 4 ranks (tests/test_megatron_layouts.py, started by launch.start): for each
layout of LAYOUTS in turn, Megatron's groups re-initialised for it (distributed.init), then one RL update of a
fresh learner in consistent kernels, twice (run to run), and once in fast kernels (Megatron's stock modules: the
negative control); a layout a learner refuses in one line (every rank refuses it in the constructor) is recorded
as that line. Rank 0 saves what each update gave (logprobs, metrics, whole gradients and weights in Hugging
Face names) and the seconds it took to argv[1]; argv[2:], if given, names the layouts to run."""
import sys
import time

import torch
from conftest import tiny_model
from megatron_moe_ranks import moe_model
from megatron_ranks import VOCAB, rl_batch

from nemo_rz import ops
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.layout import Layout, layouts_of
from nemo_rz.runtime.megatron.learner import MegatronLearner

WORLD = 4
LAYERS = 4  # splits into 2 pipeline stages
# Every layout of 4 ranks with each axis in {1, 2} that the Megatron learner drives (distributed.NOT_YET lists the
# others): the dense ones on a dense model, those with ep = 2 on a mixture of experts; grad_shares = dp, the
# one-process reference's too.
_driven = tuple(distributed.NOT_YET)
LAYOUTS = {**{name: (layout, "dense") for name, layout in layouts_of(WORLD, ("tp", "pp", "cp", "dp"), refused=_driven).items()},
           **{f"moe_{name}": (layout, "moe") for name, layout in
              layouts_of(WORLD, ("tp", "pp", "cp", "ep", "dp"), refused=_driven).items() if layout.ep > 1}}
RUNS = ("consistent", "consistent_again", "fast")


def model(family: str = "dense"):
    if family == "moe":
        return moe_model(num_layers=LAYERS)
    return tiny_model(0, vocab_size=VOCAB, num_layers=LAYERS)


def learner(mirror, layout: Layout) -> MegatronLearner:
    return MegatronLearner(mirror, layout, 1e-3, 1.0, 1.0, "reinforce_zero", "unclipped", {})


def update(layout: Layout, family: str) -> dict | None:
    """One RL update of a fresh learner on every rank (the others follow rank 0); rank 0 returns what it saw, or
    the one line every rank's learner refused the layout with (a kernel set it has no path for)."""
    if torch.distributed.get_rank():
        try:
            MegatronLearner.follow()
        except ValueError:  # refused in the constructor, as on rank 0
            pass
        return None
    start = time.perf_counter()
    try:
        lrn = learner(model(family), layout)
    except ValueError as e:
        return dict(refused=str(e))
    metrics, lp = lrn.rl_step(*rl_batch())
    step_s = time.perf_counter() - start
    out = dict(metrics=metrics, lp=lp, grads=lrn.gradients(), weights=lrn.state_dict_copy(), seconds=step_s)
    lrn.stop()
    return out


def main(out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    got = {}
    for name in names or LAYOUTS:
        layout, family = LAYOUTS[name]
        distributed.init(layout)
        for run in RUNS:
            with ops.use_kernels("fast" if run == "fast" else "consistent"):
                got[f"{name}/{run}"] = update(layout, family)
            if torch.distributed.get_rank() == 0:  # where a slow run is (a busy machine)
                with open(f"{out}.progress", "a") as f:
                    f.write(f"{name}/{run} {time.strftime('%H:%M:%S')}\n")
    if torch.distributed.get_rank() == 0:
        torch.save(got, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
