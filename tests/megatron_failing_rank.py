"""The train CLI over 2 Megatron ranks (launch.start, as `python -m nemo_rz.train` runs it) where rank 1 raises at
its third RL update, after the first checkpoints: tests/test_megatron_failures.py. Usage: FILE key=value ..."""
import sys

from nemo_rz import train
from nemo_rz.runtime.megatron import launch

FAULT = "RuntimeError: injected fault on rank 1"


def _raise_at_third_update():
    from nemo_rz.runtime.megatron.learner import MegatronLearner

    real, calls = MegatronLearner.rl_step, []

    def rl_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError(FAULT.split(": ", 1)[1])
        return real(self, *args, **kwargs)

    MegatronLearner.rl_step = rl_step


if __name__ == "__main__":
    argv = sys.argv[1:]
    rank = launch.this_rank()
    if rank is None:
        run_dir = next(a.split("=", 1)[1] for a in argv if a.startswith("run_dir="))
        sys.exit(launch.start([sys.executable, __file__, *argv], 2, run_dir, heartbeat_s=60.0))
    if rank == 1:
        _raise_at_third_update()
    sys.exit(train.main(argv))
