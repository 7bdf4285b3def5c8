"""Security: no file in a run directory can run code, hang a resume or roll it back, the package never
unpickles, and the Ray cluster a run starts refuses clients without its per-run token."""
import ast
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from test_faults import TINY

from nemo_rz import config, train
from nemo_rz.runtime import checkpoint, runlock
from nemo_rz.runtime.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent


class Payload:
    """Unpickling this runs code: it writes the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


def test_a_pickle_planted_in_a_checkpoint_never_runs(tmp_path, capsys):
    run, marker = tmp_path / "run", tmp_path / "marker"
    assert train.main(TINY + [f"run_dir={run}", "algo.updates=2", "checkpoint.every=1"]) == 0
    latest = run / "checkpoints" / "step_000002"
    for name in ("state.pt", "optimizer.pt"):  # the attacker rewrites the manifest too, so checksums match
        torch.save({"version": 2, "payload": Payload(marker)}, latest / name)
    manifest = json.loads((latest / checkpoint.MANIFEST).read_text())
    manifest["sha256"].update({n: checkpoint._sha256(latest / n) for n in ("state.pt", "optimizer.pt")})
    manifest["bytes"].update({n: (latest / n).stat().st_size for n in ("state.pt", "optimizer.pt")})
    (latest / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    planted = (latest / "state.pt").read_bytes()
    capsys.readouterr()
    assert train.main([f"resume={run}", "algo.updates=3"]) == 0
    out = capsys.readouterr().out
    assert not marker.exists()
    assert "step_000002: refused to load" in out and "falling back" in out and "step_000001" in out
    (tmp_path / "planted.pt").write_bytes(planted)  # the resumed run has since replaced step_000002
    torch.load(tmp_path / "planted.pt", weights_only=False)  # negative control: the payload is live when unpickled
    assert marker.read_text() == "pwned"


@pytest.mark.slow
def test_planted_symlinks_and_fifos_neither_hang_nor_roll_back_a_resume(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    assert train.main(TINY + [f"run_dir={run}", "algo.updates=3", "checkpoint.every=1", "checkpoint.keep=3"]) == 0
    runlock.unlock(run)  # the resume below is another process
    shutil.copytree(run, other)
    ckpts = run / "checkpoints"
    (ckpts / "step_000003" / "state.pt").unlink()
    (ckpts / "step_000003" / "state.pt").symlink_to("/dev/zero")  # would never end
    (ckpts / "step_000002" / "model.safetensors").unlink()
    os.mkfifo(ckpts / "step_000002" / "model.safetensors")  # would block the open forever
    (ckpts / "step_000099").symlink_to(other / "checkpoints" / "step_000001")  # another run's, at another update
    proc = subprocess.run([sys.executable, "-m", "nemo_rz.train", f"resume={run}", "algo.updates=4"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3 and "step_000099 is a symlink" in warnings[0], warnings
    assert "state.pt is a symlink (to /dev/zero)" in warnings[1] and "model.safetensors is a FIFO" in warnings[2]
    assert f"resumed from {ckpts / 'step_000001'} at update 1" in proc.stdout and "Traceback" not in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003", "step_000004", "step_000099"]
    for name in ("step_000002", "step_000003", "step_000004"):  # redone, rotation counted only good checkpoints
        checkpoint.verify(ckpts / name)
    assert os.path.islink(ckpts / "step_000099") and sorted(p.name for p in (other / "checkpoints").iterdir()) == [
        "step_000001", "step_000002", "step_000003"]


# -- the package never unpickles -------------------------------------------------------------------------

PICKLERS = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def unsafe_loads(source: str, filename: str = "<source>") -> list[str]:
    """Calls that can run code from a file: pickle-family loads, torch.load without weights_only=True, numpy
    loads with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.ImportFrom) and node.module in PICKLERS and any(a.name.startswith("load") or a.name == "Unpickler"
                                                                                for a in node.names):
            found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
        name, kw = node.func.attr, {k.arg: k.value for k in node.keywords}
        def const(key):
            return isinstance(kw.get(key), ast.Constant) and kw[key].value is True

        if owner in PICKLERS and (name.startswith("load") or name == "Unpickler"):
            found.append(f"{filename}:{node.lineno}: {owner}.{name}")
        elif owner == "torch" and name == "load" and not const("weights_only"):
            found.append(f"{filename}:{node.lineno}: torch.load without weights_only=True")
        elif owner in ("np", "numpy") and name == "load" and "allow_pickle" in kw and not (
                isinstance(kw["allow_pickle"], ast.Constant) and kw["allow_pickle"].value is False):
            found.append(f"{filename}:{node.lineno}: numpy load with allow_pickle")
    return found


def test_the_package_never_unpickles():
    files = sorted((ROOT / "nemo_rz").rglob("*.py"))
    assert len(files) > 30
    found = [hit for f in files for hit in unsafe_loads(f.read_text(), str(f.relative_to(ROOT)))]
    assert found == []


def test_the_unpickling_scan_finds_each_unsafe_form():  # negative control of the scan above
    bad = """
import pickle, torch, numpy as np
from pickle import loads
pickle.load(open("f", "rb"))
torch.load("x.pt")
torch.load("x.pt", weights_only=False)
np.load("x.npy", allow_pickle=True)
torch.load("ok.pt", weights_only=True)
np.load("ok.npy")
"""
    assert [hit.split(": ", 1)[0] for hit in unsafe_loads(bad)] == [f"<source>:{n}" for n in (3, 4, 5, 6, 7)]


# -- the Ray cluster ----------------------------------------------------------------------------------------

CLIENT = "import ray; ray.init(address={address!r}, log_to_driver=False); print('CONNECTED', flush=True)"


def _client(address: str, env: dict) -> str:
    """'refused' or 'connected': the first verdict a Ray client prints (a refused one retries: stop it there)."""
    env = dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")  # keep 127.0.0.1 (Ray would dial this host's network address)
    proc = subprocess.Popen([sys.executable, "-c", CLIENT.format(address=address)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = threading.Timer(120, proc.kill)  # a client that never prints a verdict fails the test, not hangs it
    deadline.start()
    try:
        for line in proc.stdout:
            if "CONNECTED" in line:
                return "connected"
            if "Authentication token is missing or incorrect" in line:
                return "refused"
        return f"exited {proc.wait()}"
    finally:
        deadline.cancel()
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_ray_cluster_refuses_clients_without_the_run_token(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    ray.shutdown()  # start a cluster of this test's own
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the old advice: must not open the cluster
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    verdicts = {}

    def while_training(record):
        if verdicts:
            return
        address = ray.get_runtime_context().gcs_address
        plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        verdicts["no token"] = _client(address, plain)
        verdicts["wrong token"] = _client(address, dict(plain, RAY_AUTH_TOKEN="0" * 64))
        verdicts["run token"] = _client(address, dict(os.environ))  # negative control: the run's own token works

    try:
        cfg = config.load(None, TINY + [f"run_dir={tmp_path / 'run'}", "algo.updates=2", "runtime.backend=ray", "checkpoint.every=0"])
        summary = Trainer(cfg, tmp_path / "run", log=lambda *_: None).run(while_training)
    finally:
        ray.shutdown()
    assert verdicts == {"no token": "refused", "wrong token": "refused", "run token": "connected"}
    assert summary["produced"] == summary["trained"] == 2 * 16
    assert list(home.iterdir()) == []  # no token file (or anything else) in the home folder
