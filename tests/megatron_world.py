"""What the Megatron tests share: a torch.distributed world of this one process (and Megatron's groups for it) for
their single-process checks, a Megatron policy holding a model's weights, and the ranks a test launches
(launch.start) with what rank 0 saved."""
import contextlib
import sys
from pathlib import Path

import torch

from nemo_rz import ops
from nemo_rz.runtime.megatron import distributed, launch
from nemo_rz.runtime.megatron.layout import Layout
from nemo_rz.runtime.megatron.model import MegatronPolicy

TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def world_of_one():
    distributed.init(Layout())
    try:
        yield
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def launched(script: str, out: Path, world: int = 2):
    """Run tests/`script` as `world` ranks with `out` as its argument; what rank 0 saved there."""
    code = launch.start([sys.executable, str(TESTS / script), str(out)], world)
    assert code == 0, f"{script} over {world} ranks exited with code {code}"
    return torch.load(out)


def policy(model, mode: str) -> MegatronPolicy:
    """A Megatron policy of `model`'s config in kernel set `mode`, holding `model`'s weights."""
    with ops.use_kernels(mode):
        p = MegatronPolicy(model.config)
    p.load_state_dict(model.state_dict())
    return p
