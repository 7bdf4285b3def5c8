"""Ray back-end: rollout actors on a Ray cluster (a local one when none is running); weights via the object store.

Same contract as the local back-end: each published version is put in the object store once and handed to
the actor with the job that needs it; a failed actor is replaced (a bounded number of times, see
restarts.py) and its unfinished jobs are sent again.

A cluster this back-end starts requires a random per-run token (Ray token authentication): Ray binds most of
its sockets on all interfaces, and without the token anyone who reaches them could run code in it. The token
travels only in the environment of the processes Ray starts, never in a file.
"""
from __future__ import annotations

import logging
import os
import secrets

from nemo_rz.runtime.jobs import Job, Result, decode_completions
from nemo_rz.runtime.restarts import RestartBudget, one_line


class _Actor:
    def __init__(self, worker_kwargs: dict, incarnation: int, crash_at_batch: int):
        from nemo_rz.runtime.worker import RolloutWorker

        self.worker = RolloutWorker(**worker_kwargs)
        self.incarnation, self.crash_at_batch = incarnation, crash_at_batch

    def run(self, job: Job, weights: dict):
        self.worker.load(job.version, weights)
        out = self.worker.run(job)
        if self.incarnation == 0 and job.batch == self.crash_at_batch:
            os._exit(17)  # fault injection for tests
        return out


class RayBackend:
    def __init__(self, worker_kwargs: dict, num_workers: int, ring_slots: int, crash_at_batch: int = -1,
                 budget: RestartBudget | None = None):
        import ray

        self.ray = ray
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if not address:  # a new local cluster; joining one takes that cluster's own token from the environment
                require_token()
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     num_cpus=None if address else max(num_workers, 1))
        self.remote_cls = ray.remote(num_cpus=1, max_restarts=0)(_Actor)
        self.worker_kwargs, self.crash_at_batch, self.ring_slots = worker_kwargs, crash_at_batch, ring_slots
        self.incarnations = [0] * num_workers
        self.actors = [self._spawn(i) for i in range(num_workers)]
        self.refs: dict[int, object] = {}
        self.futures: dict[object, tuple[int, Job]] = {}
        self.budget = budget or RestartBudget()

    def _spawn(self, i: int):
        return self.remote_cls.remote(self.worker_kwargs, self.incarnations[i], self.crash_at_batch)

    def publish(self, version: int, state_dict) -> None:
        self.refs[version] = self.ray.put({k: v.clone() for k, v in state_dict.items()})
        for old in [v for v in self.refs if v <= version - self.ring_slots]:
            del self.refs[old]

    def _send(self, i: int, job: Job) -> None:
        self.futures[self.actors[i].run.remote(job, self.refs[job.version])] = (i, job)

    def submit(self, job: Job) -> None:
        load = [0] * len(self.actors)
        for i, _ in self.futures.values():
            load[i] += 1
        self._send(min(range(len(self.actors)), key=lambda i: load[i]), job)

    def poll(self, timeout: float) -> list[Result]:
        ready, _ = self.ray.wait(list(self.futures), num_returns=1, timeout=timeout)
        out = []
        for fut in ready:
            if fut not in self.futures:
                continue
            i, job = self.futures.pop(fut)
            try:
                rows, seconds, spec = self.ray.get(fut)
            except (self.ray.exceptions.RayActorError, self.ray.exceptions.RayTaskError) as e:
                self._restart(i, job, one_line(e))
                continue
            out.append(Result(job.batch, job.version, i, decode_completions(rows), seconds, spec))
        return out

    @property
    def restarts(self) -> int:
        return self.budget.restarts

    def _restart(self, i: int, failed: Job, error: str) -> None:
        self.budget.spend(i, error)
        self.ray.kill(self.actors[i])  # a task error leaves the actor alive: replace it all the same
        self.incarnations[i] += 1
        self.actors[i] = self._spawn(i)
        lost = [failed] + [job for f, (w, job) in list(self.futures.items()) if w == i and self.futures.pop(f)]
        for job in sorted(lost, key=lambda j: j.batch):
            self._send(i, job)

    def close(self) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.futures.clear()


_TOKEN = secrets.token_hex(32)  # one per process: Ray's client caches the first token it reads


def require_token() -> None:
    """Token authentication, with a random per-run token unless the user gave one, for the cluster ray.init is
    about to start. With RAY_AUTH_MODE unset, ray.init turns token mode on for a new local cluster (also in a
    process that imported ray earlier) and, finding RAY_AUTH_TOKEN, writes no token file."""
    os.environ.pop("RAY_AUTH_MODE", None)  # "disabled" included: this back-end never starts an open cluster
    os.environ.setdefault("RAY_AUTH_TOKEN", _TOKEN)
    # Ray would announce the mode with a hint to opt out of it: not advice to give here.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
