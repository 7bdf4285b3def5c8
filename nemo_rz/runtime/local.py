"""Local back-end: rollout worker processes on this machine, weights in shared memory.

Each worker has its own job queue, so the learner always knows which jobs a worker holds, and its own result
pipe, so that a worker killed while sending can spoil (or block) only its own. A worker that dies is restarted (a
bounded number of times, see restarts.py) and its unfinished jobs are sent again; a job's result arrives whole
or not at all, so nothing is lost. A worker that dies just after sending a result has that job done twice: the
trainer refuses the second copy as a duplicate. A worker that is alive but makes no progress (stopped, stuck
holding the GIL) stops beating its heartbeat: after `heartbeat_s` seconds without one it is killed, said so
in one line, and restarted the same way. Workers exit with the trainer, even one killed with SIGKILL.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time

import torch.multiprocessing as mp

from nemo_rz.runtime.jobs import Job, Result, decode_completions
from nemo_rz.runtime.restarts import HEARTBEAT_S, STARTUP_S, RestartBudget, check_heartbeat, one_line
from nemo_rz.runtime.weights import SharedWeightRing, WeightsBundle

_PR_SET_PDEATHSIG = 1


def _exit_with_parent() -> None:
    """daemon=True stops workers only when the trainer exits cleanly: also watch its liveness directly, and have
    the kernel kill this process when the trainer dies (it works on a stopped process too)."""
    sentinel = multiprocessing.parent_process().sentinel
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    threading.Thread(target=lambda: (multiprocessing.connection.wait([sentinel]), os._exit(1)), daemon=True).start()


def _heartbeat(beat, every_s: float) -> None:
    """Count up while this process runs: a thread of its own, so that a long job is no silence."""

    def beat_on():
        while True:
            beat.value += 1
            time.sleep(every_s)

    threading.Thread(target=beat_on, daemon=True).start()


class _Outbox:
    """Results go out from a thread of their own, so that the worker starts its next job while the trainer is
    busy; flush() waits until all are sent."""

    def __init__(self, conn):
        self.conn, self.pending = conn, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._send, daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.pending.put(message)

    def _send(self) -> None:
        while (message := self.pending.get()) is not None:
            self.conn.send(message)

    def flush(self) -> None:
        self.pending.put(None)
        self.thread.join()


def _worker_main(worker_id, incarnation, worker_kwargs, ring, jobs, results, crash_at_batch, beat, beat_every_s):
    _heartbeat(beat, beat_every_s)
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    outbox = _Outbox(results)
    try:
        from nemo_rz.runtime.worker import RolloutWorker

        worker = RolloutWorker(**worker_kwargs)
        while True:
            job = jobs.get()
            if job is None:
                outbox.flush()
                return
            worker.load(job.version, ring.read(job.version))
            rows, seconds, spec = worker.run(job)
            if incarnation == 0 and job.batch == crash_at_batch:
                os._exit(17)  # fault injection for tests: die holding a finished, unsent result
            outbox.put(("result", worker_id, (job.batch, job.version, rows, seconds, spec)))
    except Exception as e:  # reported to the trainer in one line, which restarts the worker or stops the run
        outbox.put(("error", worker_id, one_line(e)))
        outbox.flush()
        os._exit(1)


class LocalBackend:
    def __init__(self, worker_kwargs: dict, initial_weights: dict, num_workers: int, ring_slots: int, crash_at_batch: int = -1,
                 budget: RestartBudget | None = None, heartbeat_s: float = HEARTBEAT_S, warn=None):
        self.ctx = mp.get_context("spawn")
        self.heartbeat_s = check_heartbeat(heartbeat_s)
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        # a LoRA policy's base is held once and never sent again: a version ships its adapters
        self.ring = SharedWeightRing(initial_weights, ring_slots, WeightsBundle.from_flat(initial_weights, -1).static_names())
        self.worker_kwargs, self.crash_at_batch = worker_kwargs, crash_at_batch
        n = num_workers
        self.procs, self.queues, self.results, self.beats, self.seen = [None] * n, [None] * n, [None] * n, [None] * n, [None] * n
        self.inflight: list[dict[int, Job]] = [{} for _ in range(n)]
        self.incarnations = [0] * n
        self.budget = budget or RestartBudget()
        self.errors: dict[int, str] = {}  # a worker's last reported error, until its death is noticed
        self._next = 0
        for i in range(n):
            self._spawn(i)

    def _spawn(self, i: int) -> None:
        """Start worker i with a new job queue (the old one may hold jobs it never read), a new result pipe and
        heartbeat, and send it the jobs it holds."""
        if self.queues[i] is not None:  # a dead worker's queue: nothing more goes into it, and exit never waits on it
            self.queues[i].cancel_join_thread()
            self.queues[i].close()
        self.queues[i] = self.ctx.Queue()
        self.results[i], send = self.ctx.Pipe(duplex=False)
        self.beats[i] = self.ctx.RawValue(ctypes.c_uint64, 0)
        self.seen[i] = (0, time.monotonic())  # (heartbeat count, when it was first seen)
        p = self.ctx.Process(
            target=_worker_main,
            args=(i, self.incarnations[i], self.worker_kwargs, self.ring, self.queues[i], send, self.crash_at_batch,
                  self.beats[i], min(1.0, self.heartbeat_s / 4)),
            daemon=True,
        )
        p.start()
        send.close()  # the worker holds the only sending end: its exit is an end of file here, never a half message
        self.procs[i] = p
        for job in sorted(self.inflight[i].values(), key=lambda j: j.batch):
            self.queues[i].put(job)

    def publish(self, version: int, state_dict) -> int:
        """Put version `version` in the ring; returns the bytes it shipped."""
        return self.ring.publish(version, state_dict)

    def submit(self, job: Job) -> None:
        i = min(range(len(self.procs)), key=lambda w: (len(self.inflight[w]), (w - self._next) % len(self.procs)))
        self._next = (i + 1) % len(self.procs)
        self.inflight[i][job.batch] = job
        self.queues[i].put(job)

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    def _silent_for(self, i: int, now: float) -> float | None:
        """Seconds worker i has gone without a heartbeat, once that is past its bound (a starting worker, which
        has not beaten yet, gets STARTUP_S: Python and torch must load first); else None."""
        count, since = self.seen[i]
        beat = self.beats[i].value
        if beat != count:
            self.seen[i] = (beat, now)
            return None
        bound = self.heartbeat_s if beat else max(self.heartbeat_s, STARTUP_S)
        return now - since if now - since > bound else None

    def _restart_failed(self, out: list[Result]) -> None:
        """Replace the workers that died or went silent, under the restart budget."""
        now = time.monotonic()
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                self._drain(i, out)  # what it sent before dying: results, or its error
                self.budget.spend(i, self.errors.pop(i, None) or f"the worker process died (exit code {p.exitcode})")
            elif (silent := self._silent_for(i, now)) is not None:
                p.kill()  # SIGKILL: it also ends a stopped process
                p.join()
                self._drain(i, out)
                error = f"rollout worker {i} (pid {p.pid}) sent no heartbeat for {silent:.0f}s (bound {self.heartbeat_s:g}s)"
                self.budget.spend(i, error)
                self.warn(f"warning: {error}: killed it; restarting it with its {len(self.inflight[i])} unfinished job(s)")
            else:
                continue
            self.incarnations[i] += 1
            self._spawn(i)

    def _drain(self, i: int, out: list[Result]) -> None:
        """The whole messages left in dead worker i's pipe (a message cut short by its death is dropped)."""
        conn = self.results[i]
        try:
            while not conn.closed and conn.poll():
                self._take(conn.recv(), out)
        except (EOFError, OSError):
            pass
        conn.close()

    def _take(self, message, out: list[Result]) -> None:
        kind, worker, payload = message
        if kind == "error":
            self.errors[worker] = payload
            return
        batch, version, rows, seconds, spec = payload
        self.inflight[worker].pop(batch, None)  # absent: a re-sent job's second result (the trainer refuses it)
        out.append(Result(batch, version, worker, decode_completions(rows), seconds, spec))

    def poll(self, timeout: float) -> list[Result]:
        out, deadline = [], time.monotonic() + timeout
        while not out:
            self._restart_failed(out)
            live = [conn for conn in self.results if not conn.closed]
            wait_s = min(0.5, max(deadline - time.monotonic(), 0.01))
            for conn in multiprocessing.connection.wait(live, timeout=wait_s):
                try:
                    self._take(conn.recv(), out)
                except (EOFError, OSError):  # the worker ended (what it sent whole was read): _restart_failed replaces it
                    conn.close()
            if not out and time.monotonic() >= deadline:
                break
        return out

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # SIGKILL: a busy or stopped worker has nothing to save
                p.join()
        for q in self.queues:
            q.cancel_join_thread()  # a killed worker left its jobs unread: exiting must not wait to send them
