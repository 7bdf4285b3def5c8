"""Multi-process launch of the Megatron learner from the train CLI, torchrun-style, on one machine.

`python -m nemo_rz.train runtime.learner=megatron megatron.tp=2` starts tp x pp x dp copies of the same command
(this process only watches them). Rank 0 runs the trainer; the other ranks serve its learner calls
(MegatronLearner.follow). The rendezvous is a FileStore in a private temporary directory, and gloo uses
the loopback interface: nothing listens on a network interface. A rank that dies (a signal, an exception: its
last stderr line is quoted) or hangs (no heartbeat for megatron.heartbeat_s seconds: stopped, or its interpreter
stuck; a slow step still beats: nemo_rz.runtime.heartbeat) stops the job: the watcher kills a hung rank, lets
rank 0 close its rollout workers, terminates the other ranks, kills any process they left, and prints one line,
exit code 1 (checkpoints are written atomically, so the last one is intact). A stop (Ctrl-C, SIGTERM) is passed
on to rank 0; no rank outlives the watcher.

More ranks than cores (4 ranks on 2 cores) run, with one line saying so: each rank then has
runtime.learner_threads = 1 thread and they take turns (schema refuses more threads, or more than
MAX_RANKS_PER_CORE ranks per core).
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nemo_rz import schema
from nemo_rz.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated
from nemo_rz.runtime import heartbeat
from nemo_rz.runtime.megatron import distributed
from nemo_rz.runtime.megatron.distributed import ENV_STORE, LOOPBACK_ENV

EXIT_RANK_DIED = 1
PEER_DIED = signal.SIGUSR1  # the launcher to rank 0: another rank died, stop (quietly: the launcher reports it)
RANK0_STOP_S = 60.0  # rank 0's time to stop its rollout workers after a stop signal, before it is killed
_RANK_ENV = "RANK"
_PR_SET_PDEATHSIG = 1
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")


def world_size(cfg) -> int:
    m = cfg.megatron
    return int(m.tp) * int(m.pp) * int(m.cp) * int(m.dp)


def this_rank() -> int | None:
    """This process's rank when a launcher started it, else None."""
    rank = os.environ.get(_RANK_ENV)
    return int(rank) if rank is not None and os.environ.get(ENV_STORE) else None


def start(command: list[str], world: int, run_dir: str | None = None, poll_s: float = 0.2,
          heartbeat_s: float | None = None) -> int:
    """Run `command` as ranks 0..world-1 and wait; rank 0's exit code, or EXIT_RANK_DIED (one line on stderr)
    when another rank ends before it, or when a rank beats no heartbeat for `heartbeat_s` seconds (None: not
    watched; the first beat may take restarts.STARTUP_S). Ctrl-C or SIGTERM here (Terminated, see train.main) is
    passed on to rank 0, which stops its rollout workers and says so in one line; then the other ranks are
    stopped. The ranks die with this process, even one killed with SIGKILL (PR_SET_PDEATHSIG), and no rendezvous
    folder is left behind. More ranks than cores is said in one line (schema refuses absurd counts)."""
    cpus = schema.usable_cpus()
    if world > cpus:
        print(f"note: the {world} learner ranks share the {cpus} CPU core(s) this process may use, 1 thread each "
              "(slower than a core each; the same bits)", file=sys.stderr)
    private = tempfile.mkdtemp(prefix="nemo_rz_ranks_")  # mode 0700: the rendezvous and the ranks' error logs
    ranks, logs, beats = [], [], []
    try:
        for rank in range(world):
            env = dict(os.environ, **LOOPBACK_ENV, **{_RANK_ENV: str(rank), "WORLD_SIZE": str(world),
                                                      ENV_STORE: os.path.join(private, "store")})
            if heartbeat_s is not None:
                beats.append(heartbeat.Pipe())
                env.update(beats[-1].child_env)
            log = None if rank == 0 else open(os.path.join(private, f"rank{rank}.err"), "w")
            logs.append(log)
            out = None if rank == 0 else subprocess.DEVNULL
            try:
                ranks.append(subprocess.Popen(command, env=env, stdout=out, stderr=log, preexec_fn=_die_with_parent(os.getpid()),
                                              pass_fds=beats[-1].child_fds if beats else ()))
            finally:
                if beats:
                    beats[-1].close_child_end()
        watch = heartbeat.Watch(beats, heartbeat_s) if heartbeat_s is not None else None
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
                    _stop_job(ranks)
                    return _report(f"rank {rank} of {world} ended with {_describe(p.returncode)}{_last_line(logs[rank])}",
                                   run_dir)
            silent = watch.silent() if watch is not None else None
            if silent is not None:
                rank, seconds = silent
                state = _state(ranks[rank].pid)
                _stop_job(ranks, hung=rank)
                return _report(f"rank {rank} of {world} stopped responding: no heartbeat for {seconds:.0f} s "
                               f"(megatron.heartbeat_s = {heartbeat_s:g}; its process was {state})", run_dir)
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
        for b in beats:
            b.close()
        shutil.rmtree(private, ignore_errors=True)


def _stop_job(ranks, hung: int | None = None) -> None:
    """After a failure: the hung rank killed at once (a stopped process takes only SIGKILL), rank 0 told to unwind
    quietly (it closes its rollout workers; the launcher's line is the report), the others stopped; then
    whatever process the ranks started and left behind."""
    family = _descendants([p.pid for p in ranks])
    if hung is not None:
        ranks[hung].kill()
        ranks[hung].wait()
    _signal(ranks[:1], PEER_DIED)
    _signal(ranks[1:], signal.SIGTERM)
    _wait(ranks, grace_s=15.0)
    _kill_left(family, grace_s=5.0)


def _report(what: str, run_dir: str | None) -> int:
    where = f"resume with resume={run_dir}" if run_dir else "resume from the run directory"
    print(f"error: {what}; stopped the job (the last checkpoint is intact: {where})", file=sys.stderr)
    return EXIT_RANK_DIED


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


def _state(pid: int) -> str:
    """The process state /proc gives (Linux), in words."""
    try:
        code = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    return {"T": "stopped", "t": "stopped (traced)", "D": "waiting on I/O", "S": "sleeping", "R": "running",
            "Z": "a zombie"}.get(code, f"in state {code}")


def _descendants(pids: list[int]) -> set[int]:
    """Every process below `pids` (from /proc; empty elsewhere): taken before a failure is handled, since an
    orphan's parent is no longer its rank."""
    parents = {}
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return set()
    for entry in entries:
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    found, todo = set(), list(pids)
    while todo:
        parent = todo.pop()
        for child, p in parents.items():
            if p == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found - set(pids)


def _kill_left(pids: set[int], grace_s: float) -> None:
    """SIGKILL whichever of `pids` (the ranks' own children: rollout workers) is still alive after grace_s."""
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = {p for p in pids if _state(p) not in ("gone", "a zombie")}
        time.sleep(0.1)
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def _last_line(log) -> str:
    if log is None:
        return ""
    lines = [line for line in Path(log.name).read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        return ""
    # torch prefixes a rank's traceback lines with "[rankN]: "; the launcher's line names the rank already
    return f" ({_RANK_PREFIX.sub('', lines[-1].strip())})"


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
    heartbeat.beat()
    signal.signal(PEER_DIED, lambda *_: sys.exit(EXIT_RANK_DIED))


def follow(cfg) -> None:
    """A rank other than 0: the trainer's settings that shape the learner's arithmetic, then serve rank 0. It holds
    nothing to save and waits inside gloo calls, where a Python signal handler would never run: SIGTERM ends it."""
    import torch

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    heartbeat.beat()

    from nemo_rz import ops
    from nemo_rz.runtime.megatron.layout import Layout
    from nemo_rz.runtime.megatron.learner import MegatronLearner

    torch.set_num_threads(cfg.runtime.learner_threads)
    ops.set_kernels(cfg.kernels)
    distributed.init(Layout.from_section(schema.typed(cfg).megatron), cfg.seed)
    MegatronLearner.follow()
