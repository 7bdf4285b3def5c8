"""Local back-end: rollout worker processes on this machine, weights in shared memory.

Each worker has its own job queue, so the learner always knows which jobs a worker holds. A worker that
dies is restarted and its unfinished jobs are sent again; a job's result arrives whole or not at all, so
nothing is lost or delivered twice.
"""
from __future__ import annotations

import os
import queue
import time

import torch.multiprocessing as mp

from nemo_rz.runtime.jobs import Job, Result, decode_completions
from nemo_rz.runtime.weights import SharedWeightRing


def _worker_main(worker_id, incarnation, worker_kwargs, ring, jobs, results, crash_at_batch):
    from nemo_rz.runtime.worker import RolloutWorker

    worker = RolloutWorker(**worker_kwargs)
    while True:
        job = jobs.get()
        if job is None:
            return
        worker.load(job.version, ring.read(job.version))
        rows, seconds = worker.run(job)
        if incarnation == 0 and job.batch == crash_at_batch:
            os._exit(17)  # fault injection for tests: die holding a finished, unsent result
        results.put((job.batch, job.version, worker_id, rows, seconds))


class LocalBackend:
    def __init__(self, worker_kwargs: dict, initial_weights: dict, num_workers: int, ring_slots: int, crash_at_batch: int = -1):
        self.ctx = mp.get_context("spawn")
        self.ring = SharedWeightRing(initial_weights, ring_slots)
        self.results = self.ctx.Queue()
        self.worker_kwargs, self.crash_at_batch = worker_kwargs, crash_at_batch
        self.procs, self.queues, self.incarnations = [], [], []
        self.inflight: list[dict[int, Job]] = []
        self.restarts = 0
        self.duplicates = 0  # results of re-sent jobs whose first result had arrived after all
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

    def _restart_dead(self) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                continue
            self.restarts += 1
            self.incarnations[i] += 1
            self.queues[i] = self.ctx.Queue()  # the old queue may hold jobs the dead worker never read
            self.procs[i] = self._spawn(i)
            for job in sorted(self.inflight[i].values(), key=lambda j: j.batch):
                self.queues[i].put(job)

    def poll(self, timeout: float) -> list[Result]:
        out, deadline = [], time.monotonic() + timeout
        while not out:
            try:
                batch, version, worker, rows, seconds = self.results.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                self._restart_dead()
                if time.monotonic() >= deadline:
                    return out
                continue
            if self.inflight[worker].pop(batch, None) is None:
                self.duplicates += 1  # a worker died after sending; its re-sent job came back twice
                continue
            out.append(Result(batch, version, worker, decode_completions(rows), seconds))
        return out

    def close(self) -> None:
        for q in self.queues:
            q.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
