"""Every way a user can make `train` or `check_mismatch` fail is one line on stderr, exit code 2, no traceback,
and nothing already written is changed. Ctrl-C is one line and exit code 130."""
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nemo_rz import train
from nemo_rz.tools import check_mismatch

TINY = [
    "task.name=add1", "warmup.steps=10", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=8", "eval.every=0",
    "model.hidden_size=32", "model.intermediate_size=64", "progress=false", "metrics.tensorboard=false",
    "metrics.decomposition_every=0", "checkpoint.every=2",
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished two-update run, and files the table's cases point at."""
    base = tmp_path_factory.mktemp("cli")
    assert train.main(TINY + [f"run_dir={base / 'run'}", "algo.updates=2"]) == 0
    files = {
        "scalar.yaml": "5\n", "list.yaml": "- 1\n", "broken.yaml": "algo: {lr: [\n", "interp.yaml": "algo:\n  lr: ${nope}\n",
        "unknown.yaml": "algo:\n  max_lga: 3\n", "shape.yaml": "model:\n  num_layers: 3\n", "latin1.yaml": b"seed: \xe9\n",
        "a_file": "", "env.yaml": "run_dir: /tmp/${oc.env:HOME}\n", "dup.yaml": "seed: 1\nseed: 2\n",
        "bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{n}: &{n} [{', '.join(['*' + p] * 10)}]\n" for p, n in zip("abcde", "bcdef")),
    }
    for name, text in files.items():
        (base / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    bad = base / "bad_run"  # a run whose config.yaml was damaged
    bad.mkdir()
    (bad / "config.yaml").write_text("seed: [0\n")
    edited = base / "edited_run"  # a run whose config.yaml was edited to read the environment
    shutil.copytree(base / "run", edited)
    text = (edited / "config.yaml").read_text()
    (edited / "config.yaml").write_text(text.replace("system_prompt: null", "system_prompt: ${oc.env:HOME}"))
    return base


CASES = {
    # types and ranges, before any work
    "max_lag not a number": (["algo.max_lag=abc"], "algo.max_lag = 'abc': expected an integer in 0..64"),
    "lr not a number": (["algo.lr=abc"], "algo.lr = 'abc': expected a finite number > 0"),
    "max_lag negative": (["algo.max_lag=-1"], "algo.max_lag = -1: expected an integer in 0..64"),
    "max_lag too large": (["algo.max_lag=65"], "algo.max_lag = 65: expected an integer in 0..64"),
    "updates negative": (["algo.updates=-5"], "algo.updates = -5: expected an integer >= 1"),
    "group of one": (["algo.group_size=1"], "algo.group_size = 1: expected an integer >= 2"),
    "gradient ascent": (["algo.grad_clip=-1"], "algo.grad_clip = -1: expected a finite number > 0, or null"),
    "temperature zero": (["algo.temperature=0"], "algo.temperature = 0: expected a finite number > 0"),
    "temperature negative": (["algo.temperature=-1"], "algo.temperature = -1"),
    "no prompts": (["algo.prompts_per_update=0"], "algo.prompts_per_update = 0: expected an integer >= 1"),
    "float16 rollouts": (["runtime.rollout_dtype=float16"], "runtime.rollout_dtype = 'float16': expected one of float32, bfloat16"),
    "lr nan": (["algo.lr=nan"], "algo.lr = 'nan'"),
    "lr inf": (["algo.lr=.inf"], "algo.lr = inf"),
    "seed negative": (["seed=-1"], "seed = -1: expected an integer in 0..99999999"),
    "keep none": (["checkpoint.keep=0"], "checkpoint.keep = 0"),
    "bool": (["progress=2"], "progress = 2: expected true or false"),
    "kernels": (["kernels=fastest"], "kernels = 'fastest': expected one of consistent, fast"),
    "rollout kernels": (["runtime.rollout_kernels=slow"], "runtime.rollout_kernels = 'slow': expected one of consistent, fast, or null"),
    "backend": (["runtime.backend=slurm"], "runtime.backend = 'slurm': expected one of local, ray"),
    "generation backend": (["generation.backend=sglang"], "generation.backend = 'sglang'"),
    "loss": (["algo.loss=dpo"], "algo.loss = 'dpo': expected one of reinforce_zero, ppo_clip"),
    "correction": (["algo.correction=clip"], "algo.correction = 'clip': expected one of none, unclipped"),
    "task": (["task.name=add9"], "task.name = 'add9': expected one of add1"),
    "chat template": (["task.chat_template=maybe"], "task.chat_template = 'maybe': expected one of auto, true, false"),
    # keys and overrides
    "unknown key": (["algo.max_lga=3"], "unknown config key 'algo.max_lga' in the command line; did you mean algo.max_lag?"),
    "section as a value": (["algo=5"], "config key 'algo' in the command line is a section"),
    "no equals sign": (["algo.max_lag"], "override 'algo.max_lag': write key=value"),
    "bad interpolation": (["algo.lr=${nope}"], "config key algo.lr: cannot resolve its value"),
    "unknown flag": (["--bogus"], "unrecognized arguments: --bogus"),
    # --config files
    "config missing": (["--config", "{base}/missing.yaml"], "missing.yaml: cannot read it (No such file or directory)"),
    "config is a folder": (["--config", "{base}"], "cannot read it (Is a directory)"),
    "config scalar": (["--config", "{base}/scalar.yaml"], "expected a mapping of keys like conf/default.yaml, found a int"),
    "config list": (["--config", "{base}/list.yaml"], "found a list"),
    "config not yaml": (["--config", "{base}/broken.yaml"], "broken.yaml: not valid YAML"),
    "config not utf-8": (["--config", "{base}/latin1.yaml"], "latin1.yaml: cannot read it (not a UTF-8 text file)"),
    "config interpolation": (["--config", "{base}/interp.yaml"], "config key algo.lr: cannot resolve its value"),
    "config unknown key": (["--config", "{base}/unknown.yaml"], "unknown config key 'algo.max_lga' in {base}/unknown.yaml"),
    "config reads the environment": (["--config", "{base}/env.yaml"], "run_dir = '/tmp/${oc.env:HOME}' reads the environment; "
                                     "a config file may only refer to its own keys"),
    "config duplicate key": (["--config", "{base}/dup.yaml"],
                             "dup.yaml: not valid YAML (while constructing a mapping, found duplicate key seed at line 2"),
    "config alias bomb": (["--config", "{base}/bomb.yaml"], "bomb.yaml: expands to more than 10000 values"),
    "config a device": (["--config", "/dev/zero"], "--config /dev/zero: cannot read it (a device, not a regular file)"),
    "task option mistyped": (["task.options.n_train=abc"], "task.options.n_train = 'abc': expected an integer"),
    "no held-out problems": (["task.options.n_heldout=0"], "task.options.n_heldout = 0: expected an integer in 1.."),
    "tp beyond the heads": (["runtime.learner=megatron", "megatron.tp=64"], "megatron.tp = 64: each rank holds 1/tp"),
    # run directories
    "run_dir under a file": (["run_dir={base}/a_file/run"], "run_dir {base}/a_file/run: cannot create it (Not a directory)"),
    "run_dir holds a run": (["run_dir={base}/run"], "run_dir {base}/run already holds a run; pass resume="),
    "resume nothing": (["resume={base}/nowhere"], "config.yaml not found"),
    "resume corrupt config": (["resume={base}/bad_run"], "bad_run/config.yaml: not valid YAML"),
    "resume edited config": (["resume={base}/edited_run"], "edited_run/config.yaml: task.system_prompt = '${oc.env:HOME}' "
                             "is an interpolation"),
    "resume new shape": (["resume={base}/run", "model.hidden_size=128"], "model.hidden_size was 32, now 128; a resumed run keeps it"),
    "resume new task": (["resume={base}/run", "task.name=add2"], "task.name was add1, now add2"),
    "resume new seed": (["resume={base}/run", "seed=3"], "seed was 0, now 3"),
    "resume new max_lag": (["resume={base}/run", "algo.max_lag=3"], "algo.max_lag was 2, now 3"),
    "resume --config": (["--config", "{base}/shape.yaml", "resume={base}/run"], "model.num_layers was 2, now 3"),
    "resume elsewhere": (["resume={base}/run", "run_dir={base}/other"], "continues that run in place: drop run_dir="),
}


@pytest.mark.parametrize("args, message", list(CASES.values()), ids=list(CASES))
def test_bad_input_is_one_line_and_exit_code_2(run, capsys, args, message):
    before = (run / "run" / "config.yaml").read_bytes()
    def fill(s):
        return s.replace("{base}", str(run))

    args = [fill(a) for a in args]
    if not any(a.startswith(("run_dir=", "resume=")) for a in args):
        args.append(f"run_dir={run / 'fresh'}")
    assert train.main(args) == 2
    out, err = capsys.readouterr()
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert fill(message) in err
    assert "resume:" not in out  # nothing was honoured
    assert (run / "run" / "config.yaml").read_bytes() == before  # a refused resume changes nothing
    assert not (run / "fresh" / "config.yaml").exists()


@pytest.mark.parametrize("args, message", [
    (["algo.correction=tis", "algo.correction_params.C=-1"], "algo.correction_params: bad parameter for correction 'tis': C must be > 0"),
    (["algo.correction_params.D=1"], "algo.correction_params: unknown parameter(s) D"),
    (["model.num_kv_heads=3"], "num_heads=4 is not a multiple of num_kv_heads=3"),
])
def test_checks_that_need_the_model_or_the_correction_still_come_before_the_warm_up(tmp_path, capsys, args, message):
    assert train.main(TINY + args + [f"run_dir={tmp_path / 'r'}"]) == 2
    out, err = capsys.readouterr()
    assert "warm-up:" not in out and err.count("\n") == 1 and message in err, err


def test_a_resume_that_fails_after_the_config_checks_leaves_config_yaml_alone(run, capsys):
    damaged = run / "damaged"
    shutil.copytree(run / "run", damaged)
    for ckpt in (damaged / "checkpoints").glob("step_*"):
        (ckpt / "model.safetensors").write_bytes(b"not a checkpoint")
    before = (damaged / "config.yaml").read_bytes()
    assert train.main([f"resume={damaged}", "algo.updates=5"]) == 2
    out, err = capsys.readouterr()
    assert "resume: algo.updates 2 -> 5" in out and err.count("\n") == 1 and "none of its" in err
    assert (damaged / "config.yaml").read_bytes() == before  # written only once the checkpoint is restored


@pytest.mark.parametrize("code, where", [(errno.ENOSPC, "checkpoint"), (errno.EROFS, "mkdir"), (errno.EACCES, "config")])
def test_os_errors_are_one_line(tmp_path, capsys, monkeypatch, code, where):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(tmp_path / "r" / where))

    if where == "checkpoint":
        from nemo_rz.runtime import checkpoint
        monkeypatch.setattr(checkpoint, "save", fail)
    elif where == "mkdir":
        monkeypatch.setattr(Path, "mkdir", fail)
    else:
        monkeypatch.setattr(train.atomic, "write_text", fail)
    assert train.main(TINY + [f"run_dir={tmp_path / 'r'}", "algo.updates=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert os.strerror(code) in err
    hint = {"checkpoint": f"free some space, then resume with resume={tmp_path / 'r'}", "mkdir": "choose another run_dir",
            "config": "choose a writable run_dir"}[where]
    assert hint in err


def test_ctrl_c_is_one_line_and_the_run_resumes(tmp_path):
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "nemo_rz.train", *TINY, f"run_dir={run_dir}", "algo.updates=100000"]
    # A terminal's job gets SIGINT at its default even where this process ignores it (a background job's shell
    # sets SIG_IGN, which exec keeps and Python then honours: no KeyboardInterrupt at all).
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.stat().st_size) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole process group
        out, err = proc.communicate(timeout=120)
    finally:  # a run of 100000 updates left behind would load the machine for the rest of the suite
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err
    assert err == f"interrupted; resume with resume={run_dir}\n"
    assert train.main([f"resume={run_dir}", "algo.updates=4"]) == 0


def test_check_mismatch_bad_arguments_are_one_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for args, message in [
        (["--temperature", "-1"], "--temperature -1.0: must be a finite number >= 0"),
        (["--temperature", "nan"], "--temperature nan"),
        (["--max-new-tokens", "0"], "--max-new-tokens 0: must be >= 1"),
        (["--batch-sizes", "0"], "every batch size must be >= 1"),
        (["--out", str(tmp_path / "a_file" / "x.json")], f"cannot write there (no folder {tmp_path / 'a_file'})"),
        (["--out", str(tmp_path)], "cannot write there (it is a directory)"),
        (["--temperature", "abc"], "invalid float value: 'abc'"),
    ]:
        with pytest.raises(SystemExit) as e:
            check_mismatch.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1 and message in err, (args, err)
