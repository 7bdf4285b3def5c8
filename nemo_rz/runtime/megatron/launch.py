"""Multi-process launch of the Megatron learner from the train CLI, torchrun-style, on one machine.

`python -m nemo_rz.train runtime.learner=megatron megatron.tp=2` starts tp x pp x dp copies of the same command
(this process only watches them). Rank 0 runs the trainer; the other ranks serve its learner calls
(MegatronLearner.follow). The rendezvous is a FileStore in a private temporary directory, and gloo uses
the loopback interface: nothing listens on a network interface. A rank that dies stops the job: the watcher
terminates the other ranks and prints one line (checkpoints are written atomically, so the last one is intact).
A stop (Ctrl-C, SIGTERM) is passed on to rank 0; no rank outlives the watcher.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nemo_rz.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.distributed import ENV_STORE, LOOPBACK_ENV

EXIT_RANK_DIED = 1
PEER_DIED = signal.SIGUSR1  # the launcher to rank 0: another rank died, stop (quietly: the launcher reports it)
RANK0_STOP_S = 60.0  # rank 0's time to stop its rollout workers after a stop signal, before it is killed
_RANK_ENV = "RANK"
_PR_SET_PDEATHSIG = 1


def world_size(cfg) -> int:
    m = cfg.megatron
    return int(m.tp) * int(m.pp) * int(m.cp) * int(m.dp)


def this_rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    rank = os.environ.get(_RANK_ENV)
    return int(rank) if rank is not None and os.environ.get(ENV_STORE) else None


def start(command: list[str], world: int, run_dir: str | None = None, poll_s: float = 0.2) -> int:
    """Run `command` as ranks 0..world-1 and wait; rank 0's exit code, or EXIT_RANK_DIED (one line on stderr)
    when another rank ends before it. Ctrl-C or SIGTERM here (Terminated, see train.main) is passed on to rank 0,
    which stops its rollout workers and says so in one line; then the other ranks are stopped. The ranks die with
    this process, even one killed with SIGKILL (PR_SET_PDEATHSIG), and no rendezvous folder is left behind."""
    private = tempfile.mkdtemp(prefix="nemo_rz_ranks_")  # mode 0700: the rendezvous and the ranks' error logs
    ranks, logs = [], []
    try:
        for rank in range(world):
            env = dict(os.environ, **LOOPBACK_ENV, **{_RANK_ENV: str(rank), "WORLD_SIZE": str(world),
                                                      ENV_STORE: os.path.join(private, "store")})
            log = None if rank == 0 else open(os.path.join(private, f"rank{rank}.err"), "w")
            logs.append(log)
            out = None if rank == 0 else subprocess.DEVNULL
            ranks.append(subprocess.Popen(command, env=env, stdout=out, stderr=log, preexec_fn=_die_with_parent(os.getpid())))
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
                    _signal(ranks[:1], PEER_DIED)  # rank 0 unwinds quietly: the line below is the report
                    _signal(ranks[1:], signal.SIGTERM)
                    _wait(ranks, grace_s=15.0)
                    where = f"resume with resume={run_dir}" if run_dir else "resume from the run directory"
                    print(f"error: rank {rank} of {world} ended with {_describe(p.returncode)}{_last_line(logs[rank])}; "
                          f"stopped the job (the last checkpoint is intact: {where})", file=sys.stderr)
                    return EXIT_RANK_DIED
            time.sleep(poll_s)
    except KeyboardInterrupt as e:
        terminated = isinstance(e, Terminated)
        _stop(ranks[:1], grace_s=RANK0_STOP_S, sig=signal.SIGTERM if terminated else signal.SIGINT)
        _stop(ranks[1:], grace_s=10.0)  # released by rank 0's exit, or stopped here
        code = ranks[0].returncode if ranks else None
        if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
            return code  # rank 0 said so, with its resume hint
        word, code = ("terminated", EXIT_TERMINATED) if terminated else ("interrupted", EXIT_INTERRUPTED)
        print(f"{word}; resume with resume={run_dir}" if run_dir else word, file=sys.stderr)
        return code
    finally:
        _stop(ranks, grace_s=5.0)  # none is left when this process ends, whatever ended it
        for log in logs:
            if log is not None:
                log.close()
        shutil.rmtree(private, ignore_errors=True)


def _die_with_parent(parent: int):
    """A preexec_fn: the rank gets SIGTERM when the launcher dies (rank 0 then unwinds as on a stop; the others
    die), and exits at once if the launcher is already gone."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # resolved before the fork

    def preexec():
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:
            os._exit(1)

    return preexec


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
    _signal(procs, sig)
    _wait(procs, grace_s)


def _signal(procs, sig) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def _wait(procs, grace_s: float) -> None:
    """Wait up to grace_s for all of them, then kill the ones left."""
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def lead() -> None:
    """Rank 0: when the launcher stops it because another rank died (PEER_DIED), unwind like an interrupt, so that
    the trainer closes its rollout workers on the way out, and quietly: the launcher reports the death. SIGTERM is
    a stop of the whole job (train.main's handler: one line, exit 143)."""
    signal.signal(PEER_DIED, lambda *_: sys.exit(EXIT_RANK_DIED))


def follow(cfg) -> None:
    """A rank other than 0: the trainer's settings that shape the learner's arithmetic, then serve rank 0. It holds
    nothing to save and waits inside gloo calls, where a Python signal handler would never run: SIGTERM ends it."""
    import torch

    signal.signal(signal.SIGTERM, signal.SIG_DFL)

    from nemo_rz import ops, schema
    from nemo_rz.runtime.megatron.layout import Layout
    from nemo_rz.runtime.megatron.learner import MegatronLearner

    torch.set_num_threads(cfg.runtime.learner_threads)
    ops.set_kernels(cfg.kernels)
    distributed.init(Layout.from_section(schema.typed(cfg).megatron), cfg.seed)
    MegatronLearner.follow()
