"""Multi-process launch of the Megatron learner from the train CLI, torchrun-style, on one machine.

`python -m nemo_rz.train runtime.learner=megatron megatron.tp=2` starts tp x pp x dp copies of the same command
(this process only watches them). Rank 0 runs the trainer; the other ranks serve its learner calls
(MegatronLearner.follow). The rendezvous is a FileStore in a private temporary directory, and gloo uses
the loopback interface: nothing listens on a network interface. A rank that dies stops the job: the watcher
terminates the other ranks and prints one line (checkpoints are written atomically, so the last one is intact).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.distributed import ENV_STORE, LOOPBACK_ENV

EXIT_RANK_DIED = 1
_RANK_ENV = "RANK"


def world_size(cfg) -> int:
    m = cfg.megatron
    return int(m.tp) * int(m.pp) * int(m.dp)


def this_rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    rank = os.environ.get(_RANK_ENV)
    return int(rank) if rank is not None and os.environ.get(ENV_STORE) else None


def start(command: list[str], world: int, run_dir: str | None = None, poll_s: float = 0.2) -> int:
    """Run `command` as ranks 0..world-1 and wait; rank 0's exit code, or EXIT_RANK_DIED (one line on stderr)
    when another rank ends before it."""
    private = tempfile.mkdtemp(prefix="nemo_rz_ranks_")  # mode 0700: the rendezvous and the ranks' error logs
    ranks, logs = [], []
    for rank in range(world):
        env = dict(os.environ, **LOOPBACK_ENV, **{_RANK_ENV: str(rank), "WORLD_SIZE": str(world),
                                                  ENV_STORE: os.path.join(private, "store")})
        log = None if rank == 0 else open(os.path.join(private, f"rank{rank}.err"), "w")
        logs.append(log)
        out = None if rank == 0 else subprocess.DEVNULL
        ranks.append(subprocess.Popen(command, env=env, stdout=out, stderr=log))
    try:
        while True:
            code = ranks[0].poll()
            if code is not None:  # rank 0 is done: the others were released, or are stopped now
                _stop(ranks[1:], grace_s=10.0)
                return code
            for rank, p in enumerate(ranks[1:], start=1):
                if p.poll() not in (None, 0):  # 0: released by rank 0, which ends next
                    try:  # rank 0 ending (its sockets closing) ends the others too: that is not a death
                        code = ranks[0].wait(timeout=5.0)
                        _stop(ranks[1:], grace_s=10.0)
                        return code
                    except subprocess.TimeoutExpired:
                        pass
                    _stop(ranks, grace_s=15.0)
                    where = f"resume with resume={run_dir}" if run_dir else "resume from the run directory"
                    print(f"error: rank {rank} of {world} ended with {_describe(p.returncode)}{_last_line(logs[rank])}; "
                          f"stopped the job (the last checkpoint is intact: {where})", file=sys.stderr)
                    return EXIT_RANK_DIED
            time.sleep(poll_s)
    except KeyboardInterrupt:
        _stop(ranks, grace_s=5.0, sig=signal.SIGINT)
        raise
    finally:
        for log in logs:
            if log is not None:
                log.close()
        shutil.rmtree(private, ignore_errors=True)


def _describe(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _last_line(log) -> str:
    if log is None:
        return ""
    lines = [line for line in Path(log.name).read_text(errors="replace").splitlines() if line.strip()]
    return f" ({lines[-1].strip()})" if lines else ""


def _stop(procs, grace_s: float, sig=signal.SIGTERM) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def lead() -> None:
    """Rank 0: when the launcher stops it (another rank died), unwind like an interrupt, so that the trainer
    closes its rollout workers on the way out; the launcher reports the death."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(EXIT_RANK_DIED))


def follow(cfg) -> None:
    """A rank other than 0: the trainer's settings that shape the learner's arithmetic, then serve rank 0."""
    import torch

    from nemo_rz import ops
    from nemo_rz.runtime.megatron.learner import MegatronLearner

    torch.set_num_threads(cfg.runtime.learner_threads)
    ops.set_mode(cfg.kernels)
    distributed.init(cfg.megatron.tp, cfg.megatron.pp, cfg.megatron.dp, cfg.seed)
    MegatronLearner.follow()
