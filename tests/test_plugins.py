"""Corrections, losses, tasks and verifiers plug in by name through the entry-point group nemo_rz.plugins.

End to end: a tiny third-party package (a correction and a verifier) is installed into a fresh virtual
environment that reuses this checkout's nemo_rz, and `python -m nemo_rz.train` uses both by name; the same
command before the package is installed is the negative control (one line, exit code 2). The registry's own
errors are checked against distributions written into a folder put on sys.path (importlib.metadata finds them
there as it finds installed ones).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import venv_over_this

from nemo_rz import plugins, schema
from nemo_rz.algorithms import CORRECTIONS, Correction, importance_weights, reinforce_zero_loss
from nemo_rz.config import load
from nemo_rz.errors import ConfigError
from nemo_rz.tasks import TASKS, make_task
from nemo_rz.tasks.verifiers import VERIFIERS, check_answer

# A correction that halves rho (so its effect is visible in the loss) and a verifier that checks the last
# character; both write a marker line when they run, so the test sees the plugin's own code was used.
PLUGIN = '''
import os
import torch
from nemo_rz.algorithms import Correction


def _mark(what):
    with open(os.environ["TINY_PLUGIN_MARKS"], "a") as f:
        f.write(what + "\\n")


def _halved(lp_learner, lp_rollout, valid, scale):
    _mark(f"correction:{scale}")
    return scale * torch.exp(lp_learner - lp_rollout), None


HALVED = Correction(_halved, {"scale": 0.5}, lambda p: None if p["scale"] > 0 else "scale must be > 0")


def last_char(text, answer):
    _mark("verifier")
    return 1.0 if text.strip()[-1:] == answer.strip()[-1:] else 0.0
'''
PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "tiny-rz-plugin"
version = "0.1"

[tool.setuptools]
py-modules = ["tiny_rz_plugin"]

[project.entry-points."nemo_rz.plugins"]
"correction.halved" = "tiny_rz_plugin:HALVED"
"verifier.last_char" = "tiny_rz_plugin:last_char"
'''
TINY = ["warmup.steps=0", "algo.updates=2", "algo.prompts_per_update=2", "algo.group_size=2", "eval.n=2",
        "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
        "metrics.decomposition_every=0", "checkpoint.every=0", "run_dir=run"]


def _train(python: Path, cwd: Path, marks: Path, data: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TINY_PLUGIN_MARKS": str(marks)}
    args = ["task.name=jsonl", f"task.options.path={data}", "task.options.verifier=last_char",
            "algo.correction=halved", "algo.correction_params.scale=0.25", *TINY]
    return subprocess.run([str(python), "-m", "nemo_rz.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_a_third_party_correction_and_verifier_train_by_name(tmp_path):
    pkg = tmp_path / "tiny-rz-plugin"
    pkg.mkdir()
    (pkg / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "tiny_rz_plugin.py").write_text(PLUGIN)
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(5) for b in range(4)))
    python = venv_over_this(tmp_path / "venv", with_checkout=True)
    marks = tmp_path / "marks.txt"

    # Negative control: without the package the name is unknown, said in one line before any work.
    before = _train(python, tmp_path, marks, data)
    assert before.returncode == 2, before.stderr[-2000:]
    assert before.stderr.strip().count("\n") == 0 and "algo.correction = 'halved': expected one of none" in before.stderr
    assert not marks.exists() and not (tmp_path / "run" / "summary.json").exists()

    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                    "--no-build-isolation", "-q", str(pkg)], check=True, capture_output=True, text=True)
    after = _train(python, tmp_path, marks, data)
    assert after.returncode == 0, after.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["updates"] == 2
    ran = set(marks.read_text().split())
    assert ran == {"correction:0.25", "verifier"}  # algo.correction_params reached the plugin


@pytest.fixture
def site(tmp_path, monkeypatch):
    """write(dist, entry_points, module source...): a distribution importlib.metadata finds on sys.path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.refresh()

    def write(dist: str, entry_points: dict[str, str], **modules: str) -> None:
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{plugins.GROUP}]\n{lines}")
        for name, source in modules.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        plugins.refresh()

    yield write
    plugins.refresh()
    for name in [m for m in sys.modules if m.startswith("rz_test_")]:
        del sys.modules[name]


DOUBLE = """
import torch
from nemo_rz.algorithms import Correction
DOUBLE = Correction(lambda lp_l, lp_r, valid, k: (k * torch.exp(lp_l - lp_r), None), {"k": 2.0})
NOT_A_CORRECTION = lambda lp_l, lp_r, valid: (torch.ones_like(lp_l), None)
NAN = Correction(lambda lp_l, lp_r, valid: (torch.full_like(lp_l, float("nan")), None))
"""


def _batch():
    torch.manual_seed(0)
    lp_l, lp_r = -torch.rand(2, 5), -torch.rand(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    return lp_l, lp_r, mask


def test_builtins_are_registered_entry_points_in_their_shown_order():
    assert tuple(CORRECTIONS) == ("none", "unclipped", "tis", "token_mask", "seq_gate", "seq_gate_kl", "cis")
    assert plugins.names("loss") == ("reinforce_zero", "ppo_clip")
    assert {"add1", "reverse", "jsonl"} <= set(TASKS) and set(VERIFIERS) == {"exact", "numeric", "digits", "boxed", "math"}
    assert {ep.dist.name for kind in plugins.KINDS for eps in plugins._entry_points()[kind].values() for ep in eps} == {"nemo-rz"}


def test_a_registered_correction_is_used_by_name(site):
    site("rz-test-a", {"correction.double": "rz_test_a:DOUBLE"}, rz_test_a=DOUBLE)
    assert "double" in CORRECTIONS and schema.validate(load(None, ["algo.correction=double"])).algo.correction == "double"
    lp_l, lp_r, mask = _batch()
    w, rejected = importance_weights(lp_l, lp_r, mask, "double", k=3.0)
    ref, _ = importance_weights(lp_l, lp_r, mask, "unclipped")
    assert torch.equal(w, 3.0 * ref) and not rejected.any()
    assert torch.equal(w[0, 3:], torch.zeros(2))  # padding stays 0 whatever the plugin returned there
    loss, m = reinforce_zero_loss(lp_l, lp_r, torch.tensor([1.0, -1.0]), mask, "double")
    assert m["weight_max"] == pytest.approx(2.0 * ref.max().item())
    with pytest.raises(ValueError, match="unknown parameter.*C for correction 'double': valid parameters are k"):
        importance_weights(lp_l, lp_r, mask, "double", C=1.0)


def test_plugin_outputs_are_checked(site):
    site("rz-test-a", {"correction.nan": "rz_test_a:NAN", "correction.bare": "rz_test_a:NOT_A_CORRECTION",
                       "loss.notfn": "rz_test_a:DOUBLE"}, rz_test_a=DOUBLE)
    lp_l, lp_r, mask = _batch()
    with pytest.raises(ValueError, match="correction 'nan' gave 8 valid token.s. a non-finite weight"):
        importance_weights(lp_l, lp_r, mask, "nan")
    with pytest.raises(plugins.PluginError, match="correction 'bare' is a function, not a nemo_rz.algorithms.Correction"):
        importance_weights(lp_l, lp_r, mask, "bare")
    with pytest.raises(plugins.PluginError, match=r"loss 'notfn' \(entry point loss.notfn = rz_test_a:DOUBLE of "
                                                  r"rz-test-a\) is a Correction, not a callable"):
        plugins.load("loss", "notfn")


def test_unknown_name_says_did_you_mean_and_lists_the_names(site):
    with pytest.raises(plugins.PluginError, match=r"^unknown correction 'unclipd' \(did you mean unclipped\?\): "
                                                  r"use one of none, unclipped, tis"):
        plugins.load("correction", "unclipd")
    with pytest.raises(ConfigError, match=r"^algo.loss = 'reinforce_zer': expected one of reinforce_zero, ppo_clip "
                                          r"\(plugins add more: docs/plugins.md\) \(did you mean reinforce_zero\?\)$"):
        schema.validate(load(None, ["algo.loss=reinforce_zer"]))
    with pytest.raises(ValueError, match="unknown task 'ad1' .did you mean add1.."):
        make_task("ad1")
    site("rz-test-a", {"task.ad1": "nemo_rz.tasks:add1"})  # control: the same name, once registered, is accepted
    assert make_task("ad1", n_train=4, n_heldout=2).split("train")


def test_two_packages_registering_one_name_is_an_error(site):
    site("rz-test-a", {"correction.twin": "rz_test_a:DOUBLE", "correction.solo": "rz_test_a:DOUBLE"}, rz_test_a=DOUBLE)
    site("rz-test-b", {"correction.twin": "rz_test_a:DOUBLE"})
    with pytest.raises(plugins.PluginError, match=r"^correction 'twin' is registered by both rz-test-a "
                                                  r"\(rz_test_a:DOUBLE\) and rz-test-b \(rz_test_a:DOUBLE\); uninstall one"):
        plugins.load("correction", "twin")
    assert isinstance(plugins.load("correction", "solo"), Correction)  # the rest of each package still loads
    site("rz-test-c", {"verifier.exact": "rz_test_a:DOUBLE"})  # a plugin cannot take over a built-in's name either
    with pytest.raises(plugins.PluginError, match="verifier 'exact' is registered by both nemo-rz .* and rz-test-c"):
        check_answer("exact", "4")


def test_a_plugin_that_fails_to_import_names_its_entry_point_and_distribution(site):
    site("rz-test-broken", {"verifier.broken": "rz_test_broken:check"}, rz_test_broken="import not_a_module_anywhere\n")
    with pytest.raises(plugins.PluginError, match=r"^verifier 'broken' \(entry point verifier.broken = rz_test_broken:check "
                                                  r"of rz-test-broken\) failed to load: ModuleNotFoundError: No module "
                                                  r"named 'not_a_module_anywhere'$"):
        check_answer("broken", "4")
    assert VERIFIERS["exact"]("4", "4") == 1.0  # the others are unaffected


def test_bad_entry_point_names_and_missing_builtins_are_one_line(site, monkeypatch):
    site("rz-test-a", {"verifiers.x": "rz_test_a:DOUBLE"}, rz_test_a=DOUBLE)
    with pytest.raises(plugins.PluginError, match=r"entry point 'verifiers.x' of rz-test-a in group nemo_rz.plugins: "
                                                  r"name it <kind>.<name> with kind one of correction, loss, task, verifier"):
        plugins.names("verifier")
    real = plugins.metadata.entry_points
    monkeypatch.setattr(plugins.metadata, "entry_points",  # an install that lost nemo-rz's own metadata
                        lambda group: [ep for ep in real(group=group) if ep.dist.name not in ("nemo-rz", "rz-test-a")])
    plugins.refresh()
    with pytest.raises(plugins.PluginError, match="no built-in plugins found: nemo-rz's entry points .* reinstall it"):
        plugins.names("correction")
