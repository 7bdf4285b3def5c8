"""Ray back-end: rollout actors on a Ray cluster (a local one when none is running); weights via the object store.

Same contract as the local back-end: each published version is put in the object store once and handed to
the actor with the job that needs it. A LoRA policy's base (the bundle's `static_names`, the same in every
version) is put once, at the first version; each actor (incarnation) fetches it once, at its first job, and
every version carries the adapters alone (`publish` returns the bytes it put, as the local ring's does). A failed
actor is replaced (a bounded number of times, see restarts.py) and its unfinished jobs are sent again. An actor
that stops answering its heartbeat (a ping served by a thread of its own, beside the job) for `heartbeat_s`
seconds is hung: it is killed, said so in one line, and replaced the same way.

A cluster this back-end starts is private to the run: every process of it binds the loopback address only,
its session folder lies in a 0700 folder of its own (removed at close), and it requires a random per-run token
(Ray token authentication), which travels only in the environment of the processes Ray starts, never in a
file. It is shut down at close. A multi-node cluster is one the user starts (`ray start`, with token auth and a
firewall), joined through RAY_ADDRESS.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time

from nemo_rz.errors import Terminated
from nemo_rz.runtime.jobs import Job, Result, decode_completions
from nemo_rz.runtime.restarts import HEARTBEAT_S, STARTUP_S, RestartBudget, check_heartbeat, one_line
from nemo_rz.runtime.weights import WeightsBundle

_HEARTBEAT_GROUP = "heartbeat"


class _Actor:
    def __init__(self, worker_kwargs: dict, incarnation: int, crash_at_batch: int):
        from nemo_rz.runtime.worker import RolloutWorker

        self.worker = RolloutWorker(**worker_kwargs)
        self.incarnation, self.crash_at_batch = incarnation, crash_at_batch
        self.static = None

    def run(self, job: Job, weights: dict, static: list):
        """`static`: [the object ref of the tensors every version shares (a LoRA base)], boxed so that Ray does not
        fetch it with every job: this incarnation fetches it once, at its first job."""
        if self.static is None:
            import ray

            self.static = ray.get(static[0])
        self.worker.load(job.version, {**self.static, **weights})
        out = self.worker.run(job)
        if self.incarnation == 0 and job.batch == self.crash_at_batch:
            os._exit(17)  # fault injection for tests
        return out

    def ping(self) -> int:
        """The heartbeat: answered in its own concurrency group, while a job runs."""
        return os.getpid()


class RayBackend:
    def __init__(self, worker_kwargs: dict, num_workers: int, ring_slots: int, crash_at_batch: int = -1,
                 budget: RestartBudget | None = None, heartbeat_s: float = HEARTBEAT_S, warn=None):
        import ray

        self.ray = ray
        self.heartbeat_s = check_heartbeat(heartbeat_s)
        self.warn = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        self.temp_dir = None  # the private folder of a cluster this back-end started
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            if address:  # joining a cluster takes that cluster's own token from the environment
                with _keep_sigterm_handler():
                    ray.init(address=address, include_dashboard=False, log_to_driver=False)
            else:
                self.temp_dir = _start_private_cluster(ray, max(num_workers, 1))
        self.remote_cls = ray.remote(num_cpus=1, max_restarts=0, concurrency_groups={_HEARTBEAT_GROUP: 1})(_Actor)
        self.worker_kwargs, self.crash_at_batch, self.ring_slots = worker_kwargs, crash_at_batch, ring_slots
        self.incarnations = [0] * num_workers
        self.actors, self.beats = [None] * num_workers, [None] * num_workers
        self.pings: dict[object, int] = {}  # an unanswered ping -> its actor
        for i in range(num_workers):
            self._spawn(i)
        self.refs: dict[int, object] = {}
        self.static_ref, self.static_names, self.static_bytes = None, frozenset(), 0  # set by the first publish
        self.shipped: dict[int, int] = {}  # version -> the bytes its publish put in the object store
        self.futures: dict[object, tuple[int, Job]] = {}
        self.budget = budget or RestartBudget()

    def _spawn(self, i: int) -> None:
        self.actors[i] = self.remote_cls.remote(self.worker_kwargs, self.incarnations[i], self.crash_at_batch)
        self.beats[i] = [None, time.monotonic(), False]  # [unanswered ping, when it (or the actor) was sent, answered once]

    def publish(self, version: int, state_dict) -> int:
        """Put version `version` in the object store; returns the bytes it put (the static tensors: once)."""
        if self.static_ref is None:
            self.static_names = frozenset(WeightsBundle.from_flat(state_dict, version).static_names())
            static = {k: v.detach().clone() for k, v in state_dict.items() if k in self.static_names}
            self.static_ref = self.ray.put(static)
            self.static_bytes = sum(v.numel() * v.element_size() for v in static.values())
        changing = {k: v.detach().clone() for k, v in state_dict.items() if k not in self.static_names}
        self.refs[version] = self.ray.put(changing)
        self.shipped[version] = sum(v.numel() * v.element_size() for v in changing.values())
        for old in [v for v in self.refs if v <= version - self.ring_slots]:
            del self.refs[old]
        return self.shipped[version]

    def _send(self, i: int, job: Job) -> None:
        self.futures[self.actors[i].run.remote(job, self.refs[job.version], [self.static_ref])] = (i, job)

    def submit(self, job: Job) -> None:
        load = [0] * len(self.actors)
        for i, _ in self.futures.values():
            load[i] += 1
        self._send(min(range(len(self.actors)), key=lambda i: load[i]), job)

    def _heartbeat(self) -> None:
        """Ping every actor about once a second; replace one whose ping went unanswered past its bound (answers
        that came while the trainer was busy are taken first)."""
        if self.pings:
            for ping in self.ray.wait(list(self.pings), num_returns=len(self.pings), timeout=0)[0]:
                self._answered(ping)
        now = time.monotonic()
        for i, beat in enumerate(self.beats):
            ping, since, answered = beat
            if ping is None:
                if now - since >= min(1.0, self.heartbeat_s / 4):
                    ping = self.actors[i].ping.options(concurrency_group=_HEARTBEAT_GROUP).remote()
                    self.pings[ping] = i
                    beat[0] = ping
                    if answered:
                        beat[1] = now
                continue
            bound = self.heartbeat_s if answered else max(self.heartbeat_s, STARTUP_S)
            if now - since > bound:
                error = f"rollout actor {i} sent no heartbeat for {now - since:.0f}s (bound {self.heartbeat_s:g}s)"
                jobs = sum(1 for w, _ in self.futures.values() if w == i)
                self._restart(i, None, error)
                self.warn(f"warning: {error}: killed it; restarting it with its {jobs} unfinished job(s)")

    def _answered(self, ping) -> None:
        i = self.pings.pop(ping)
        beat = self.beats[i]
        if beat[0] != ping:
            return  # the ping of an actor replaced since
        try:
            self.ray.get(ping)
        except self.ray.exceptions.RayError:
            return  # the actor died: its jobs fail too, and that restarts it
        beat[:] = [None, time.monotonic(), True]

    def poll(self, timeout: float) -> list[Result]:
        self._heartbeat()
        waiting = list(self.futures) + list(self.pings)
        ready, _ = self.ray.wait(waiting, num_returns=1, timeout=min(timeout, 1.0)) if waiting else ([], [])
        out = []
        for fut in ready:
            if fut in self.pings:
                self._answered(fut)
                continue
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

    def _restart(self, i: int, failed: Job | None, error: str) -> None:
        self.ray.kill(self.actors[i])  # a task error leaves the actor alive, a hung one may never return: replace it
        self.budget.spend(i, error)
        self.incarnations[i] += 1
        self._spawn(i)
        lost = [failed] if failed is not None else []
        lost += [job for f, (w, job) in list(self.futures.items()) if w == i and self.futures.pop(f)]
        for job in sorted(lost, key=lambda j: j.batch):
            self._send(i, job)

    def close(self) -> None:
        try:
            for a in self.actors:
                self.ray.kill(a)
            self.futures.clear()
            self.pings.clear()
        finally:
            if self.temp_dir is not None:  # the cluster is this run's: stop it and remove its folder
                self.ray.shutdown()
                shutil.rmtree(self.temp_dir, ignore_errors=True)
                self.temp_dir = None


def _start_private_cluster(ray, num_cpus: int) -> str:
    """A local cluster on the loopback address, token auth on, its folders inside a new 0700 folder (returned): Ray
    makes its temp and session folders world-writable (0777), so they must lie where no one else can reach."""
    require_token()
    temp_dir = tempfile.mkdtemp(prefix="nemo_rz_ray_")  # mode 0700; short: Ray's socket paths lie under it
    try:
        with _keep_sigterm_handler(), _loopback_only():
            ray.init(include_dashboard=False, log_to_driver=False, num_cpus=num_cpus, _node_ip_address="127.0.0.1",
                     _temp_dir=os.path.join(temp_dir, "ray"), logging_level=logging.WARNING)  # no start-up banner
    except BaseException:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    return temp_dir


@contextlib.contextmanager
def _loopback_only():
    """ray.init turns a loopback _node_ip_address into this machine's network address (so that other nodes could
    reach it) unless Ray clusters are off, as on macOS and Windows: turn them off while it starts. The processes
    it starts are given the node's address explicitly."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@contextlib.contextmanager
def _keep_sigterm_handler():
    """ray.init replaces the driver's SIGTERM handler with one that calls sys.exit: put train.main's back (a SIGTERM
    then unwinds as Terminated), and take a SIGTERM during the start-up itself as Terminated too."""
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGTERM) if main else None
    try:
        yield
    except SystemExit as e:
        if e.code == signal.SIGTERM:
            raise Terminated() from None
        raise
    finally:
        if main and saved is not None:
            signal.signal(signal.SIGTERM, saved)


_TOKEN = secrets.token_hex(32)  # one per process: Ray's client caches the first token it reads


def require_token() -> None:
    """Token authentication, with a random per-run token unless the user gave one, for the cluster ray.init is
    about to start. With RAY_AUTH_MODE unset, ray.init turns token mode on for a new local cluster (also in a
    process that imported ray earlier) and, finding RAY_AUTH_TOKEN, writes no token file."""
    os.environ.pop("RAY_AUTH_MODE", None)  # "disabled" included: this back-end never starts an open cluster
    os.environ.setdefault("RAY_AUTH_TOKEN", _TOKEN)
    # Ray would announce the mode with a hint to opt out of it: not advice to give here.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
