"""Probe results on disk (ops/probe_cache.py, ops/verified.py): a later process reuses them, a changed machine key
probes again, damaged, planted or poisoned files never crash a run nor slip a wrong route in, and concurrent
writers keep every entry."""
import json
import multiprocessing
import os
import subprocess
import sys
import time

import pytest
import torch
from conftest import mkl_avx512_path

from nemo_rz.ops import probe_cache, verified

FEATURES = 64


def odd_single_row(x):
    """A row-wise map whose single-row calls take another path (as a matrix-vector product does)."""
    return torch.exp(x) + (1e-3 if x.shape[0] == 1 else 0.0)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory and a fresh process's view: nothing probed, nothing read, nothing warned."""
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NEMO_RZ_PROBE_CACHE", raising=False)
    monkeypatch.setattr(verified, "_ENABLED", True)
    monkeypatch.setattr(verified, "_RESULTS", {})
    monkeypatch.setattr(probe_cache, "_files", {})
    monkeypatch.setattr(probe_cache, "_warned", False)
    return tmp_path


class Probes:
    """Counts the probes run (verified._route calls) as the cache is used."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = verified._route

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(verified, "_route", counted)


def new_process(monkeypatch):
    """What a new process starts with: no results in memory (the files on disk stay)."""
    monkeypatch.setattr(verified, "_RESULTS", {})
    monkeypatch.setattr(probe_cache, "_files", {})


def route(fn=odd_single_row, name="odd_single_row"):
    return verified.rowwise_route(name, fn, FEATURES, torch.float32, "cpu")


def cache_file(directory):
    files = sorted(directory.glob("probes-*.json"))
    assert len(files) == 1, files
    return files[0]


def entries(directory) -> dict:
    return json.loads(cache_file(directory).read_text())["entries"]


def test_round_trip(cache, monkeypatch):
    probes = Probes(monkeypatch)
    first = route()
    assert first == verified.Route(first.chunk, 2) and probes.count == 1
    assert entries(cache) == {probe_cache.entry_name(("odd_single_row", FEATURES, torch.float32, "cpu")): [first.chunk, 2]}
    new_process(monkeypatch)
    assert route() == first and probes.count == 1  # read back and checked, not probed
    assert verified.matmul_route(64, 48, torch.float32, "cpu") == verified.matmul_route(64, 48, torch.float32, "cpu")
    assert verified.bmm_verified(64, 32, torch.float32, "cpu") in (True, False)
    new_process(monkeypatch)
    assert len(entries(cache)) == 3 and probes.count == 2
    verified.matmul_route(64, 48, torch.float32, "cpu")
    assert probes.count == 2


def test_a_new_process_does_not_probe_again(cache):
    """End to end: a second interpreter reads what the first one wrote instead of probing."""
    code = ("import torch; from nemo_rz.ops import verified as v; calls = []; real = v._route\n"
            "v._route = lambda *a, **k: calls.append(1) or real(*a, **k)\n"
            "print(v.matmul_route(96, 80, torch.float32, 'cpu'), len(calls))")
    env = {**os.environ, "NEMO_RZ_CACHE_DIR": str(cache)}
    outs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
            for _ in range(2)]
    assert outs[0].split()[-1] == "1" and outs[1].split()[-1] == "0", outs
    assert outs[0].rsplit(maxsplit=1)[0] == outs[1].rsplit(maxsplit=1)[0]


@pytest.mark.parametrize("change", ["torch version", "cpu flags", "probe version", "ops sources", "blas path variable"])
def test_a_changed_machine_key_probes_again(cache, monkeypatch, change):
    probes = Probes(monkeypatch)
    route()
    new_process(monkeypatch)
    route()
    assert probes.count == 1
    new_process(monkeypatch)
    if change == "torch version":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + ".other")
    elif change == "cpu flags":
        real = probe_cache.cpu_description()
        monkeypatch.setattr(probe_cache, "cpu_description", lambda: {**real, "flags": real.get("flags", "") + " newflag"})
    elif change == "probe version":
        monkeypatch.setattr(verified, "PROBE_VERSION", verified.PROBE_VERSION + 1)
    elif change == "ops sources":
        monkeypatch.setattr(probe_cache, "ops_sources_digest", lambda: "edited")
    else:
        monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    route()
    assert probes.count == 2
    assert len(list(cache.glob("probes-*.json"))) == 2  # the old key's file is left for processes that still match it


def test_the_cache_can_be_turned_off(cache, monkeypatch):
    probes = Probes(monkeypatch)
    monkeypatch.setenv("NEMO_RZ_PROBE_CACHE", "0")
    route()
    new_process(monkeypatch)
    route()
    assert probes.count == 2 and list(cache.iterdir()) == []


def test_a_result_without_a_check_is_not_kept(cache, monkeypatch):
    """verified() keeps on disk only what it can check on load (not, say, a GPU probe: the key describes no GPU)."""
    calls = []
    assert verified.verified("unchecked", (1,), lambda: calls.append(1) or True) is True
    new_process(monkeypatch)
    assert verified.verified("unchecked", (1,), lambda: calls.append(1) or True) is True
    assert len(calls) == 2 and list(cache.iterdir()) == []
    assert verified._on_cpu("cuda:0", lambda value: True) is None


@pytest.mark.parametrize("damage", [b"{not json", b"\xff\xfe\x00", b'{"machine": {"format": 1}, "entries": {}}', b"[]", b""])
def test_a_corrupt_file_is_ignored_and_rewritten(cache, monkeypatch, capfd, damage):
    first = route()
    path = cache_file(cache)
    path.write_bytes(damage)
    new_process(monkeypatch)
    probes = Probes(monkeypatch)
    assert route() == first and probes.count == 1
    warnings = [line for line in capfd.readouterr().err.splitlines() if "probe cache" in line]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    assert len(entries(cache)) == 1  # rewritten whole
    new_process(monkeypatch)
    assert route() == first and probes.count == 1


def test_a_symlinked_cache_file_is_refused(cache, monkeypatch, capfd, tmp_path_factory):
    """A cache file planted as a symlink is never read through (its target here claims a wrong route), and the link
    itself (not its target) is replaced when the entry is written."""
    first = route()
    path = cache_file(cache)
    planted = tmp_path_factory.mktemp("elsewhere") / "planted.json"
    content = json.loads(path.read_text())
    content["entries"] = {k: [first.chunk, 1] for k in content["entries"]}
    planted.write_text(json.dumps(content))
    path.unlink()
    path.symlink_to(planted)
    new_process(monkeypatch)
    monkeypatch.setattr(verified, "route_holds", lambda *a, **k: True)  # only the refusal stands in the way
    probes = Probes(monkeypatch)
    assert route() == first and probes.count == 1
    assert "symlink" in capfd.readouterr().err
    assert not path.is_symlink() and json.loads(planted.read_text()) == content


def test_a_fifo_in_place_of_the_file_does_not_hang(cache, monkeypatch):
    route()
    path = cache_file(cache)
    path.unlink()
    os.mkfifo(path)
    new_process(monkeypatch)
    probes = Probes(monkeypatch)
    route()
    assert probes.count == 1 and path.is_file()


def poison(directory, value):
    path = cache_file(directory)
    content = json.loads(path.read_text())
    content["entries"] = {k: value for k in content["entries"]}
    path.write_text(json.dumps(content))


def _bits_differ(r) -> bool:
    """Whether a row gets other bits alone (padded to r.min_rows) than in a call with other rows, on route r."""
    x = torch.randn(40, FEATURES, generator=torch.Generator().manual_seed(0))
    return not torch.equal(verified.by_rows(odd_single_row, x[:1], r), verified.by_rows(odd_single_row, x, r)[:1])


def test_a_poisoned_route_is_caught_by_the_spot_check(cache, monkeypatch, capfd):
    """A route written by hand that lets single rows through (min_rows 1) is caught on load and probed again.
    Negative control: with the check disabled the poisoned route is used, and a row's bits then depend on the
    row count."""
    first = route()
    assert not _bits_differ(first)
    poison(cache, [first.chunk, 1])
    new_process(monkeypatch)
    probes = Probes(monkeypatch)
    assert route() == first and probes.count == 1
    assert "fails its check" in capfd.readouterr().err
    assert list(entries(cache).values()) == [[first.chunk, 2]]  # rewritten

    poison(cache, [first.chunk, 1])
    new_process(monkeypatch)
    monkeypatch.setattr(verified, "route_holds", lambda *a, **k: True)
    used = route()
    assert used == verified.Route(first.chunk, 1) and probes.count == 1 and _bits_differ(used)


@pytest.mark.parametrize("value", [[8192, 1], [0, 1], [64, 9], [64.0, 2], ["64", 2], True, 7, {"chunk": 64}, [64]])
def test_a_route_the_probe_cannot_give_is_refused(cache, monkeypatch, value):
    """A chunk the probe never tries, a min_rows out of range, or not a route at all: probed again."""
    first = route(torch.exp, "exp64")
    poison(cache, value)
    new_process(monkeypatch)
    probes = Probes(monkeypatch)
    assert route(torch.exp, "exp64") == first and probes.count == 1


@pytest.mark.skipif(not mkl_avx512_path(),
                    reason="the matrix-vector path of MKL on AVX-512 CPUs (Intel's: MKL takes its AVX2 path on AMD CPUs)")
def test_a_poisoned_gemm_route_is_caught(cache, monkeypatch):
    """On the real library: a GEMM route claiming single rows (MKL's matrix-vector path gives them other bits)."""
    first = verified.matmul_route(576, 1536, torch.float32, "cpu")
    assert first.min_rows == 2
    poison(cache, [first.chunk, 1])
    new_process(monkeypatch)
    assert verified.matmul_route(576, 1536, torch.float32, "cpu") == first
    x = torch.randn(2, 576)
    w = verified._varied(576, 1536, 576 ** -0.5, torch.float32, "cpu")
    assert not torch.equal(torch.mm(x[:1], w), torch.mm(x, w)[:1])  # what the check saw


def _writer(barrier, directory, index, per_writer, unlocked):
    os.environ["NEMO_RZ_CACHE_DIR"] = directory
    if unlocked:
        import contextlib
        probe_cache._locked = lambda path: contextlib.nullcontext()
    real_read = probe_cache._read

    def slow_read(path, machine):  # widen the window between reading the file and replacing it
        found = real_read(path, machine)
        time.sleep(0.2)
        return found

    probe_cache._read = slow_read
    barrier.wait()
    for j in range(per_writer):
        probe_cache.store(("test", index, j), [64, 1], {"test": "machine"})


def _run_writers(directory, unlocked: bool, writers=4, per_writer=2) -> int:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(writers)
    procs = [ctx.Process(target=_writer, args=(barrier, str(directory), i, per_writer, unlocked)) for i in range(writers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * writers
    content = json.loads(next(directory.glob("probes-*.json")).read_text())
    assert content["machine"] == {"test": "machine"}
    return len(content["entries"])


def test_concurrent_writers_keep_every_entry(tmp_path):
    """Four processes write two entries each at once: all eight are there. Negative control: without the lock
    (read, merge, replace), writers that read the same file replace each other's entries."""
    (tmp_path / "locked").mkdir()
    (tmp_path / "unlocked").mkdir()
    assert _run_writers(tmp_path / "locked", unlocked=False) == 8
    assert _run_writers(tmp_path / "unlocked", unlocked=True) < 8
    assert not [p.name for p in (tmp_path / "locked").iterdir() if not p.name.startswith("probes-")]  # no temp files left


def test_an_unwritable_directory_warns_once_and_runs_on(cache, monkeypatch, capfd):
    blocker = cache / "file"
    blocker.write_text("")
    monkeypatch.setenv("NEMO_RZ_CACHE_DIR", str(blocker / "sub"))  # a directory that cannot be made
    probes = Probes(monkeypatch)
    first = route()
    route(torch.exp, "exp64")
    assert first is not None and probes.count == 2
    warnings = [line for line in capfd.readouterr().err.splitlines() if "probe cache" in line]
    assert len(warnings) == 1 and "cannot write" in warnings[0]


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("NEMO_RZ_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert probe_cache.cache_dir() == tmp_path / "nemo_rz"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert probe_cache.cache_dir() == tmp_path / ".cache" / "nemo_rz"


def test_the_suite_keeps_the_cache_out_of_home():
    assert os.environ.get("NEMO_RZ_CACHE_DIR") and not os.environ["NEMO_RZ_CACHE_DIR"].startswith(os.path.expanduser("~"))
