"""Local back-end: rollout worker processes on this machine, weights in shared memory.

Each worker has its own job queue, so the learner always knows which jobs a worker holds. A worker that
dies is restarted (a bounded number of times, see restarts.py) and its unfinished jobs are sent again; a
job's result arrives whole or not at all, so nothing is lost. A worker that dies just after sending a result
has that job done twice: the trainer refuses the second copy as a duplicate. Workers exit with the trainer,
even one killed with SIGKILL.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time

import torch.multiprocessing as mp

from nemo_rz.runtime.jobs import Job, Result, decode_completions
from nemo_rz.runtime.restarts import RestartBudget, one_line
from nemo_rz.runtime.weights import SharedWeightRing


def _exit_with_parent() -> None:
    """daemon=True stops workers only when the trainer exits cleanly: also watch its liveness directly."""
    sentinel = multiprocessing.parent_process().sentinel
    threading.Thread(target=lambda: (multiprocessing.connection.wait([sentinel]), os._exit(1)), daemon=True).start()


def _worker_main(worker_id, incarnation, worker_kwargs, ring, jobs, results, crash_at_batch):
    _exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it stops the workers
    try:
        from nemo_rz.runtime.worker import RolloutWorker

        worker = RolloutWorker(**worker_kwargs)
        while True:
            job = jobs.get()
            if job is None:
                return
            worker.load(job.version, ring.read(job.version))
            rows, seconds, spec = worker.run(job)
            if incarnation == 0 and job.batch == crash_at_batch:
                os._exit(17)  # fault injection for tests: die holding a finished, unsent result
            results.put(("result", worker_id, (job.batch, job.version, rows, seconds, spec)))
    except Exception as e:  # reported to the trainer in one line, which restarts the worker or stops the run
        results.put(("error", worker_id, one_line(e)))
        results.close()
        results.join_thread()
        os._exit(1)


class LocalBackend:
    def __init__(self, worker_kwargs: dict, initial_weights: dict, num_workers: int, ring_slots: int, crash_at_batch: int = -1,
                 budget: RestartBudget | None = None):
        self.ctx = mp.get_context("spawn")
        self.ring = SharedWeightRing(initial_weights, ring_slots)
        self.results = self.ctx.Queue()
        self.worker_kwargs, self.crash_at_batch = worker_kwargs, crash_at_batch
        self.procs, self.queues, self.incarnations = [], [], []
        self.inflight: list[dict[int, Job]] = []
        self.budget = budget or RestartBudget()
        self.errors: dict[int, str] = {}  # a worker's last reported error, until its death is noticed
        self._next = 0
        for i in range(num_workers):
            self.queues.append(self.ctx.Queue())
            self.inflight.append({})
            self.incarnations.append(0)
            self.procs.append(self._spawn(i))

    def _spawn(self, i: int):
        p = self.ctx.Process(
            target=_worker_main,
            args=(i, self.incarnations[i], self.worker_kwargs, self.ring, self.queues[i], self.results, self.crash_at_batch),
            daemon=True,
        )
        p.start()
        return p

    def publish(self, version: int, state_dict) -> None:
        self.ring.publish(version, state_dict)

    def submit(self, job: Job) -> None:
        i = min(range(len(self.procs)), key=lambda w: (len(self.inflight[w]), (w - self._next) % len(self.procs)))
        self._next = (i + 1) % len(self.procs)
        self.inflight[i][job.batch] = job
        self.queues[i].put(job)

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    def _restart_dead(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                continue
            self.budget.spend(i, self.errors.pop(i, None) or f"the worker process died (exit code {p.exitcode})")
            self.incarnations[i] += 1
            self.queues[i] = self.ctx.Queue()  # the old queue may hold jobs the dead worker never read
            self.procs[i] = self._spawn(i)
            for job in sorted(self.inflight[i].values(), key=lambda j: j.batch):
                self.queues[i].put(job)

    def poll(self, timeout: float) -> list[Result]:
        out, deadline = [], time.monotonic() + timeout
        while not out:
            try:
                kind, worker, payload = self.results.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                self._restart_dead()
                if time.monotonic() >= deadline:
                    return out
                continue
            if kind == "error":
                self.errors[worker] = payload
                continue
            batch, version, rows, seconds, spec = payload
            self.inflight[worker].pop(batch, None)  # absent: a re-sent job's second result (the trainer refuses it)
            out.append(Result(batch, version, worker, decode_completions(rows), seconds, spec))
        return out

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
