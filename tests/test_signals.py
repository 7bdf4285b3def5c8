"""SIGTERM, what schedulers send to stop a job, is a clean stop on every back-end: one line, exit code 143, the last
checkpoint kept (and `resume=` continues from it), TensorBoard flushed, and no process or private folder left
behind: no rollout worker, no Ray process, no Megatron rank, no rendezvous folder. The Ray cluster a run starts
listens on the loopback address only and keeps its session folder in a private (0700) folder."""
import ipaddress
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rz import train
from nemo_rz.errors import EXIT_TERMINATED
from nemo_rz.runtime import checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY = [
    "task.name=add1", "warmup.steps=10", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=8", "eval.every=0",
    "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
    "metrics.decomposition_every=0", "checkpoint.every=2", "algo.updates=100000",
]


def _parents() -> dict[int, int]:
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return found


def _descendants(pid: int) -> set[int]:
    parents, found, todo = _parents(), set(), [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _survivors(pids, wait_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _listening(pids) -> list[tuple[int, str]]:
    """(pid, address) of every TCP socket the processes listen on (/proc/net/tcp and tcp6, matched by inode)."""
    inodes = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes[link[8:-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                found.append((inodes[cols[9]], _address(cols[1].rsplit(":", 1)[0])))
    return found


def _address(hex_ip: str) -> str:
    """An address as /proc/net/tcp* writes it: 32-bit words in host (little-endian) byte order."""
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw))


def _loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_the_address_helpers_read_proc_net_tcp():  # negative control of the loopback check below
    assert _address("0100007F") == "127.0.0.1" and _loopback("127.0.0.1")
    assert _address("00000000000000000000000001000000") == "::1" and _loopback("::1")
    mapped = _address("0000000000000000FFFF00000100007F")
    assert ipaddress.ip_address(mapped) == ipaddress.ip_address("::ffff:127.0.0.1") and _loopback(mapped)
    assert not _loopback(_address("00000000")) and not _loopback(_address("020011AC"))  # 0.0.0.0, 172.17.0.2
    assert not _loopback(_address("00000000000000000000000000000000"))  # ::


def _start(run_dir: Path, *overrides) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "nemo_rz.train", *TINY, f"run_dir={run_dir}", *overrides]
    # a session of its own: a test that fails can still stop everything it started (and a SIGTERM sent to the
    # trainer alone is what a scheduler sends)
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _until_checkpoint(proc: subprocess.Popen, run_dir: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while checkpoint.latest(run_dir / "checkpoints") is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_all(proc, set())
            _, err = proc.communicate()
            pytest.fail(f"no checkpoint (exit code {proc.returncode}): {err[-2000:]}")
        time.sleep(0.2)


def _kill_all(proc: subprocess.Popen, pids) -> None:
    for pid in set(pids) | _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def _terminate(proc: subprocess.Popen, pids, group: bool = False) -> tuple[str, str, list[int]]:
    """SIGTERM the trainer (or its whole process group), wait for it; its output and the processes that outlived it."""
    try:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        survivors = _survivors(pids)
    finally:
        _kill_all(proc, pids)  # whatever the outcome, nothing of this test outlives it
        if proc.poll() is None:
            proc.communicate()
    return out, err, survivors


@pytest.mark.parametrize("group", [False, True], ids=["trainer", "process-group"])
def test_sigterm_on_the_local_backend_is_one_line_exit_143_and_the_run_resumes(tmp_path, group):
    run_dir = tmp_path / "r"
    proc = _start(run_dir, "runtime.rollout_workers=2", "metrics.tensorboard=true")
    _until_checkpoint(proc, run_dir)
    pids = _descendants(proc.pid)
    workers = [p for p in pids if any("multiprocessing" in a for a in _cmdline(p))]
    assert len(workers) >= 2, [(p, _cmdline(p)) for p in pids]  # the 2 rollout workers (and the resource tracker)
    _, err, survivors = _terminate(proc, pids, group)
    assert proc.returncode == EXIT_TERMINATED, err
    assert err == f"terminated; resume with resume={run_dir}\n"
    assert survivors == []
    assert checkpoint.load_latest(run_dir / "checkpoints") is not None  # the last checkpoint is intact
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert events and b"reward" in events[0].read_bytes()  # TensorBoard was flushed and closed
    assert train.main([f"resume={run_dir}", "algo.updates=4", "metrics.tensorboard=false"]) == 0


def _ray_temp_dirs(pids) -> set[Path]:
    """The folders the Ray processes keep their session_* folder in (from their command lines)."""
    found = set()
    for pid in pids:
        for arg in _cmdline(pid):
            m = re.search(r"(/[^=\s]*?)/session_[\w.-]+", arg)
            if m:
                found.add(Path(m.group(1)))
    return found


@pytest.mark.slow
def test_sigterm_on_the_ray_backend_stops_the_private_loopback_cluster(tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "r"
    proc = _start(run_dir, "runtime.backend=ray")
    _until_checkpoint(proc, run_dir)
    pids = _descendants(proc.pid) | {proc.pid}
    names = {Path(_cmdline(p)[0]).name for p in pids if _cmdline(p)}
    try:
        assert {"gcs_server", "raylet"} <= names, names
        listening = _listening(pids)  # the driver, GCS, raylet, agents, the actor, the autoscaler monitor
        assert listening and all(_loopback(a) for _, a in listening), [(p, a, _cmdline(p)[:1]) for p, a in listening]
        temp_dirs = _ray_temp_dirs(pids)
        assert len(temp_dirs) == 1, temp_dirs
        temp = temp_dirs.pop().parent  # Ray's temp folder (made 0777 by Ray) lies in a private folder of the run
        assert stat.S_IMODE(temp.stat().st_mode) == 0o700 and temp.stat().st_uid == os.getuid()
        for folder in temp.parents:  # nothing on the way there that another user could replace
            mode = folder.stat().st_mode
            assert not mode & stat.S_IWOTH or mode & stat.S_ISVTX, folder
    except BaseException:
        _kill_all(proc, pids)
        raise
    _stopped_cleanly(proc, pids, run_dir)  # no rank, no rollout worker, no actor left
    assert not temp.exists()
    assert checkpoint.load_latest(run_dir / "checkpoints") is not None



def _stopped_cleanly(proc, pids, run_dir) -> None:
    """SIGTERM the trainer: exit 143, the one resume line, and no process of the run left."""
    _, err, survivors = _terminate(proc, pids)
    assert proc.returncode == EXIT_TERMINATED, err
    assert err == f"terminated; resume with resume={run_dir}\n", err
    assert survivors == [], [(p, _cmdline(p)[:3]) for p in survivors]

@pytest.mark.slow
def test_sigterm_on_the_megatron_launcher_stops_every_rank(tmp_path):
    pytest.importorskip("megatron.core")
    run_dir = tmp_path / "r"
    proc = _start(run_dir, "runtime.learner=megatron", "megatron.tp=2")
    _until_checkpoint(proc, run_dir)
    pids = _descendants(proc.pid)
    stores = set()
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        stores |= {Path(e.split(b"=", 1)[1].decode()).parent for e in env if e.startswith(b"NEMO_RZ_DIST_STORE=")}
    try:
        assert len(stores) == 1 and all(s.is_dir() for s in stores), stores  # the rendezvous folder, while it runs
        assert sum(1 for p in pids if "nemo_rz.train" in _cmdline(p)) == 2  # rank 0 and rank 1
    except BaseException:
        _kill_all(proc, pids)
        raise
    _stopped_cleanly(proc, pids, run_dir)  # no rank, no rollout worker, no actor left
    assert not any(s.exists() for s in stores)
    assert checkpoint.load_latest(run_dir / "checkpoints") is not None
