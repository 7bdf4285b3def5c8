"""Bad input an operator or an attacker can give the train CLI: every case is one line on stderr, exit code 2, no
traceback, before any process starts or anything is written; and what must keep working does (plain ${key}
references in a --config file, environment lookups the user allows, a BOM, duplicated rows).

The machine is pinned (2 cores, 8 GiB available) so that the size limits read the same everywhere."""
import json
import multiprocessing
import os
import subprocess

import pytest
from omegaconf import OmegaConf

from nemo_rz import config, schema, train

GIB = 1 << 30
ROWS = [json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) for i in range(20)]
DEEP_ROW = '{"prompt": "1=", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG_NUMBER_ROW = '{"prompt": "1=", "answer": ' + "7" * 5000 + "}"
BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]" for p, n in zip("abcdef", "bcdefg")]) + "\n"


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    monkeypatch.setattr(schema, "usable_cpus", lambda: 2)
    monkeypatch.setattr(schema, "available_memory", lambda: 8 * GIB)
    monkeypatch.delenv(config.ALLOW_ENV, raising=False)
    monkeypatch.setenv("NEMO_RZ_TEST_SECRET", "hunter2")

    def no_process(*args, **kwargs):
        raise AssertionError("a process was started for bad input")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(multiprocessing.Process, "start", no_process)


def _saved_run(tmp_path, edit=None):
    """A run directory as train leaves it, config.yaml only (these refusals come before any checkpoint)."""
    run = tmp_path / "saved"
    run.mkdir()
    text = OmegaConf.to_yaml(config.load(None, [f"run_dir={run}"]))
    (run / config.RUN_CONFIG).write_text(edit(text) if edit else text)
    return run


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def _fifo(tmp_path, name="pipe"):
    path = tmp_path / name
    os.mkfifo(path)
    return path


def _jsonl(tmp_path, lines, name="d.jsonl"):
    return _write(tmp_path, name, "\n".join(lines) + "\n")


# id -> (tmp_path -> arguments, the text the one line must hold)
CASES = {
    # -- secrets through a config: a file may not read the environment; a run's config.yaml holds no interpolation
    "--config reads the environment": (
        lambda t: ["--config", str(_write(t, "c.yaml", "task:\n  system_prompt: ${oc.env:NEMO_RZ_TEST_SECRET}\n"))],
        "task.system_prompt = '${oc.env:NEMO_RZ_TEST_SECRET}' reads the environment; a config file may only refer "
        "to its own keys"),
    "--config names the switch": (
        lambda t: ["--config", str(_write(t, "c.yaml", "run_dir: /tmp/${oc.env:NEMO_RZ_TEST_SECRET}\n"))],
        f"or set {config.ALLOW_ENV}=1 to allow it"),
    "--config hides oc.env in oc.decode": (
        lambda t: ["--config", str(_write(t, "c.yaml", 'algo:\n  lr: ${oc.decode:"${oc.env:NEMO_RZ_TEST_SECRET}"}\n'))],
        "algo.lr = '${oc.decode:\"${oc.env:NEMO_RZ_TEST_SECRET}\"}' reads the environment"),
    "--config computes a resolver name": (
        lambda t: ["--config", str(_write(t, "c.yaml", "task:\n  options:\n    r: oc.env\n    p: ${${task.options.r}:HOME}\n"))],
        "calls the resolver ${...}, which may read outside the config"),
    "--config an unknown resolver": (
        lambda t: ["--config", str(_write(t, "c.yaml", "task:\n  system_prompt: ${my.lookup:1}\n"))],
        "calls the resolver my.lookup, which may read outside the config"),
    "--config preset on resume reads the environment": (
        lambda t: ["--config", str(_write(t, "c.yaml", "algo:\n  updates: ${oc.env:NEMO_RZ_TEST_SECRET}\n")),
                   f"resume={_saved_run(t)}"],
        "algo.updates = '${oc.env:NEMO_RZ_TEST_SECRET}' reads the environment"),
    "run config.yaml holds an interpolation": (
        lambda t: [f"resume={_saved_run(t, lambda s: s.replace('system_prompt: null', 'system_prompt: ${oc.env:HOME}'))}"],
        "saved/config.yaml: task.system_prompt = '${oc.env:HOME}' is an interpolation, but a run's config.yaml is "
        "written with every value resolved (it was edited)"),
    "run config.yaml holds a reference": (
        lambda t: [f"resume={_saved_run(t, lambda s: s.replace('updates: 1600', 'updates: ${seed}'))}"],
        "algo.updates = '${seed}' is an interpolation"),
    # -- YAML that is not a config
    "--config alias bomb": (lambda t: ["--config", str(_write(t, "bomb.yaml", BOMB))],
                            "bomb.yaml: expands to more than 10000 values (YAML aliases"),
    "run config.yaml alias bomb": (
        lambda t: [f"resume={_saved_run(t, lambda s: s + BOMB)}"], "config.yaml: expands to more than 10000 values"),
    "--config nested 100000 deep": (lambda t: ["--config", str(_write(t, "deep.yaml", "a: " + "[" * 100_000))],
                                    "deep.yaml: nested too deeply to read"),
    "--config nested 40 deep": (lambda t: ["--config", str(_write(t, "deep.yaml", "a: " + "[" * 40 + "]" * 40 + "\n"))],
                                "deep.yaml: nested deeper than 32 levels"),
    "--config syntax error": (lambda t: ["--config", str(_write(t, "syn.yaml", "algo:\n  lr: 1\n bad: [\n"))],
                              "syn.yaml: not valid YAML (while parsing a block mapping, expected <block end>, but found "
                              "'<block mapping start>' at line 3, column 2); fix the file"),
    "--config control character": (lambda t: ["--config", str(_write(t, "ctl.yaml", "seed: 1\nalgo:\n  lr: \x01\n"))],
                                   "ctl.yaml: not valid YAML (character U+0001 is not allowed, at line 3, column 7); "
                                   "fix the file"),
    "--config duplicate key": (lambda t: ["--config", str(_write(t, "dup.yaml", "algo:\n  lr: 1\nalgo:\n  lr: 2\n"))],
                               "dup.yaml: not valid YAML (while constructing a mapping, found duplicate key algo at line 3, column 1)"),
    "--config /dev/zero": (lambda t: ["--config", "/dev/zero"],
                           "--config /dev/zero: cannot read it (a device, not a regular file)"),
    "--config FIFO": (lambda t: ["--config", str(_fifo(t))], "pipe: cannot read it (a FIFO, not a regular file)"),
    "--config too large": (lambda t: ["--config", str(_write(t, "big.yaml", "#" * (config.MAX_CONFIG_BYTES + 1)))],
                           f"big.yaml: {config.MAX_CONFIG_BYTES + 1} bytes, more than the {config.MAX_CONFIG_BYTES}"),
    # -- sizes, against the model, the other settings and the machine (2 cores, 8 GiB), before any process
    "64 rollout workers": (lambda t: ["runtime.rollout_workers=64"],
                           "runtime.rollout_workers = 64: more than the 2 CPU core(s) this process may use"),
    "64 worker threads": (lambda t: ["runtime.worker_threads=64"], "runtime.worker_threads = 64: more threads than the 2"),
    "64 learner threads": (lambda t: ["runtime.learner_threads=64"], "runtime.learner_threads = 64"),
    "tp 64": (lambda t: ["runtime.learner=megatron", "megatron.tp=64"],
              "megatron.tp = 64: each rank holds 1/tp of the attention heads and MLP features, so tp must divide "
              "model.num_heads = 4, model.num_kv_heads = 2, model.intermediate_size = 192; choose one of 1, 2"),
    "tp x dp far over the cores": (lambda t: ["runtime.learner=megatron", "megatron.tp=2", "megatron.dp=8"],
                                   "megatron.dp = 8: megatron.tp x pp x cp x dp = 2 x 1 x 1 x 8 = 16 learner processes "
                                   "on the 2 CPU core(s) this process may use, more than 4 per core; at most 8 in all"),
    "ranks x learner threads over the cores": (
        lambda t: ["runtime.learner=megatron", "megatron.tp=2", "runtime.learner_threads=2"],
        "runtime.learner_threads = 2: megatron.tp x pp x cp x dp = 2 x 1 x 1 x 1 = 2 learner processes of 2 threads "
        "each need 4 cores, more than the 2 CPU core(s) this process may use; at most 1 with this layout"),
    "grad shares": (lambda t: ["runtime.learner=megatron", "megatron.dp=2", "megatron.grad_shares=3"],
                    "megatron.grad_shares = 3: not a multiple of megatron.dp = 2"),
    "a million prompts": (lambda t: ["algo.prompts_per_update=1000000"],
                          "algo.prompts_per_update = 1000000: the run needs at least 131.4 GiB of memory"),
    "huge groups": (lambda t: ["algo.group_size=100000"], "algo.group_size = 100000: the run needs at least"),
    "warm-up batch 1e8": (lambda t: ["warmup.batch_size=100000000"],
                          "warmup.batch_size = 100000000: the run needs at least 1962.5 GiB of memory"),
    "huge model": (lambda t: ["model.hidden_size=100000"], "model.hidden_size = 100000: the run needs at least"),
    "head_dim 1": (lambda t: ["model.num_heads=64"], "model.num_heads = 64: head_dim = hidden_size // num_heads = 64 // "
                                                    "64 = 1, but RoPE needs an even head_dim >= 2; at most 32 heads"),
    "experts per token": (lambda t: ["model.num_experts=2", "model.num_experts_per_tok=3"],
                          "model.num_experts_per_tok = 3: more than model.num_experts = 2"),
    "a million draft layers": (lambda t: ["draft.mode=cotrain", "draft.num_layers=1000000"],
                               "draft.num_layers = 1000000: the run needs at least"),
    "draft layer outside the model": (lambda t: ["draft.mode=cotrain", "draft.aux_layers=[0,5]"],
                                      "draft.aux_layers = [0, 5]: layer 5 is outside the model's 2 layers"),
    "no room for a prompt": (lambda t: ["algo.max_new_tokens=64"],
                             "algo.max_new_tokens = 64: leaves no room for a prompt in the model's 64 positions"),
    "reverse of 100000 digits": (lambda t: ["task.name=reverse", "task.options.max_len=100000"],
                                 "task.options.max_len = 100000: expected an integer in 1..512"),
    # -- task options, typed per task (its signature and @limits)
    "heldout_fraction abc": (lambda t: ["task.name=jsonl", "task.options.heldout_fraction=abc"],
                             "task.options.heldout_fraction = 'abc': expected a finite number (task jsonl)"),
    "n_train abc": (lambda t: ["task.options.n_train=abc"], "task.options.n_train = 'abc': expected an integer in"),
    "seed a list": (lambda t: ["task.options.seed=[1,2]"], "task.options.seed = [1, 2]: expected an integer >= 0"),
    "require_eos maybe": (lambda t: ["task.name=jsonl", "task.options.require_eos=maybe"],
                          "task.options.require_eos = 'maybe': expected true or false (task jsonl)"),
    "n_heldout 0": (lambda t: ["task.options.n_heldout=0"],
                    "task.options.n_heldout = 0: expected an integer in 1..1000000, or null for min(500, a fifth of the "
                    "problems) (eval measures pass@1 on the held-out problems, so hold out at least 1)"),
    "unknown option": (lambda t: ["task.options.n_test=3"],
                       "task 'add2': unknown option(s) n_test in task.options: valid are seed, n_train, n_heldout"),
    "min_len over max_len": (lambda t: ["task.name=reverse", "task.options.min_len=6"],
                             "task.options.min_len = 6 is more than task.options.max_len = 5"),
    # -- data files
    "path /dev/zero": (lambda t: ["task.name=jsonl", "task.options.path=/dev/zero"],
                       "task.options.path /dev/zero: cannot read it (a device, not a regular file)"),
    "path a FIFO": (lambda t: ["task.name=jsonl", f"task.options.path={_fifo(t)}"], "cannot read it (a FIFO, not a"),
    "heldout_path a FIFO": (lambda t: ["task.name=jsonl", f"task.options.path={_jsonl(t, ROWS)}",
                                       f"task.options.heldout_path={_fifo(t)}"],
                            "task.options.heldout_path "),
    "row nested 100000 deep": (
        lambda t: ["task.name=jsonl", f"task.options.path={_jsonl(t, ROWS + [DEEP_ROW])}"],
        "d.jsonl:21: nested too deeply to read"),
    "answer of 5000 digits": (
        lambda t: ["task.name=jsonl", f"task.options.path={_jsonl(t, ROWS + [LONG_NUMBER_ROW])}"],
        "d.jsonl:21: a number of 5000 digits, more than the 4000 that are read as a number; write it as a string"),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_is_one_line_exit_2_before_any_work(tmp_path, capsys, case):
    make_args, message = CASES[case]
    args = make_args(tmp_path)
    saved = tmp_path / "saved" / config.RUN_CONFIG
    before = saved.read_bytes() if saved.exists() else None
    if not any(a.startswith(("run_dir=", "resume=")) for a in args):
        args.append(f"run_dir={tmp_path / 'fresh'}")
    rc = train.main(args + ["progress=false", "metrics.tensorboard=false"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err
    assert "hunter2" not in out + err  # the secret is never shown
    assert not (tmp_path / "fresh" / "metrics.jsonl").exists()
    if before is not None:
        assert saved.read_bytes() == before  # a refused resume changes nothing
    if not case.startswith(("row", "answer")):  # the rows are read when the task is built
        assert not (tmp_path / "fresh" / config.RUN_CONFIG).exists()


# -- what keeps working ----------------------------------------------------------------------------------------------

def test_a_config_file_may_refer_to_its_own_keys(tmp_path):
    layer = _write(tmp_path, "c.yaml", "algo:\n  prompts_per_update: 4\n  max_lag: ${algo.prompts_per_update}\n"
                                       "eval:\n  n: ${oc.select:algo.prompts_per_update}\n")
    cfg = config.load(str(layer), [])
    assert cfg.algo.max_lag == 4 and cfg.eval.n == 4


def test_environment_lookups_when_the_user_allows_them(tmp_path, monkeypatch):
    layer = _write(tmp_path, "c.yaml", "task:\n  system_prompt: ${oc.env:NEMO_RZ_TEST_SECRET}\n")
    monkeypatch.setenv(config.ALLOW_ENV, "1")
    assert config.load(str(layer), []).task.system_prompt == "hunter2"
    monkeypatch.delenv(config.ALLOW_ENV)
    # typed on the command line, it is the user's own choice
    assert config.load(None, ["task.system_prompt=${oc.env:NEMO_RZ_TEST_SECRET}"]).task.system_prompt == "hunter2"
    # an escaped \${...} is text, not a lookup
    layer.write_text("task:\n  system_prompt: 'use \\${oc.env:X} here'\n")
    assert config.load(str(layer), []).task.system_prompt == "use ${oc.env:X} here"


def test_a_small_alias_is_still_fine(tmp_path):
    layer = _write(tmp_path, "c.yaml", "algo:\n  prompts_per_update: &n 4\neval:\n  n: *n\n")
    assert config.load(str(layer), []).eval.n == 4


def test_resume_is_not_held_to_the_old_machine(tmp_path, monkeypatch):
    """A run saved with 2 workers resumes on a 1-core machine once the workers are lowered (the saved config itself
    is not checked against this machine)."""
    monkeypatch.setattr(schema, "usable_cpus", lambda: 2)
    run = _saved_run(tmp_path, lambda s: s.replace("rollout_workers: 1", "rollout_workers: 2"))
    monkeypatch.setattr(schema, "usable_cpus", lambda: 1)
    with pytest.raises(ValueError, match="runtime.rollout_workers = 2: more than the 1 CPU core"):
        config.load(None, [f"resume={run}"])
    assert config.load(None, [f"resume={run}", "runtime.rollout_workers=1"]).runtime.rollout_workers == 1


def test_memory_bound_blames_what_was_raised(tmp_path):
    plain = OmegaConf.to_container(config.load(None, []))
    need = schema.memory_need(plain, schema.model_shape(plain))
    assert sum(need.values()) < 64 << 20  # the default job: a few MiB by this bound
    for key, value in [("algo.prompts_per_update", 1_000_000), ("model.num_layers", 100_000)]:
        with pytest.raises(ValueError, match=rf"{key} = {value}: the run needs at least .* lower it to at most \d+"):
            config.load(None, [f"{key}={value}"])


def test_sizes_of_a_checkpoint_come_from_its_config_json(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "vocab_size": 100, "max_position_embeddings": 32}))
    hf = [f"model.hf_path={ckpt}"]
    with pytest.raises(ValueError, match=r"megatron.tp = 2: .* must divide .*ckpt/config.json's num_heads = 6, "
                                         r".*num_kv_heads = 3.*choose one of 1, 3"):
        config.load(None, hf + ["runtime.learner=megatron", "megatron.tp=2"])
    with pytest.raises(ValueError, match=r"algo.max_new_tokens = 32: .* 32 positions \(max_position_embeddings of "):
        config.load(None, hf + ["algo.max_new_tokens=32"])
    assert config.load(None, hf + ["algo.max_new_tokens=8"]).model.hf_path == str(ckpt)
