"""The config schema: it covers conf/default.yaml exactly, the defaults pass it, its fixed value sets match the
code's own, values are normalised, and the resume policy (refuse or honour every change) holds."""
import pytest
from omegaconf import OmegaConf

from nemo_rz import config, schema
from nemo_rz.errors import ConfigError


def _leaves(cfg, prefix=""):
    out = []
    for k, v in cfg.items_ex(resolve=False):
        path = f"{prefix}{k}"
        if OmegaConf.is_dict(v) and path not in config.OPEN_KEYS:
            out += _leaves(v, path + ".")
        else:
            out.append(path)
    return out


def test_schema_declares_every_default_key_and_nothing_else():
    default = OmegaConf.load(config.DEFAULT)
    assert sorted(_leaves(default)) == sorted(schema.SCHEMA)


def test_defaults_pass_and_values_are_normalised():
    cfg = config.load(None, ["algo.lr=1", "algo.grad_clip=null", "run_dir=2024"])
    assert cfg.algo.lr == 1.0 and isinstance(cfg.algo.lr, float)
    assert cfg.algo.grad_clip is None and cfg.run_dir == "2024"
    cfg = config.load(None, ["algo.max_lag=${algo.prompts_per_update}"])  # interpolations come out resolved
    assert cfg.algo.max_lag == cfg.algo.prompts_per_update and "${" not in OmegaConf.to_yaml(cfg)


def test_written_out_value_sets_match_the_code():
    from nemo_rz import ops
    from nemo_rz.algorithms import CORRECTIONS
    from nemo_rz.models.config import DTYPES
    from nemo_rz.runtime.learner import LOSSES

    def choices(key):
        return tuple(schema.SCHEMA[key]._choices())

    assert choices("kernels") == choices("runtime.rollout_kernels") == tuple(ops.KERNELS)
    assert choices("algo.loss") == LOSSES
    assert choices("algo.correction") == tuple(CORRECTIONS)
    assert choices("runtime.rollout_dtype") == tuple(DTYPES)


@pytest.mark.parametrize("key, good, bad", [
    ("algo.max_lag", [0, 64], [-1, 65, 2.5, "abc", True]),
    ("algo.group_size", [2], [1, 0]),
    ("algo.lr", [1e-9, 3, 1e6], [0, -1e-3, float("nan"), float("inf"), "abc"]),
    ("algo.grad_clip", [0.5, None], [0, -1]),
    ("task.chat_template", ["auto", True, False], ["yes please", 1]),
    ("runtime.rollout_kernels", [None, "fast"], ["slow"]),
])
def test_ranges(key, good, bad):
    spec = schema.SCHEMA[key]
    assert all(spec.accepts(v) for v in good)
    assert not any(spec.accepts(v) for v in bad)


def _typed_keys(c, prefix=""):
    import dataclasses

    out = []
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        out += _typed_keys(value, f"{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


def test_typed_sections_are_the_schema_keys_and_a_misspelt_one_raises():
    import dataclasses

    cfg = config.load(None, ["draft.aux_layers=[0,1]", "algo.correction_params={a: 1}", "algo.lr=1"])
    c = schema.typed(cfg)
    assert sorted(_typed_keys(c)) == sorted(schema.SCHEMA)
    assert all(getattr(getattr(c, k.split(".")[0]), k.split(".")[1]) == OmegaConf.select(cfg, k)
               for k in schema.SCHEMA if "." in k and schema.SCHEMA[k].kind not in ("ints", "mapping"))
    assert c.draft.aux_layers == (0, 1) and c.algo.correction_params == {"a": 1} and type(c.algo.lr) is float
    assert schema.AlgoSection.__dataclass_fields__["grad_clip"].type == float | None  # Key.optional
    assert schema.typed(OmegaConf.create(OmegaConf.to_yaml(c))) == c  # written out and read back: the same
    with pytest.raises(AttributeError, match="max_lga"):  # negative control: the DictConfig would answer None
        c.algo.max_lga
    assert OmegaConf.select(cfg, "algo.max_lga") is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.algo.lr = 2.0


def test_typed_refuses_a_missing_or_bad_key_in_one_line():
    plain = schema.resolved(config.load(None, []))
    del plain["algo"]["max_lag"]
    with pytest.raises(ConfigError, match=r"^config key algo.max_lag is missing; add it \(see conf/default.yaml\)$"):
        schema.typed(plain)
    plain["algo"]["max_lag"] = -1
    with pytest.raises(ConfigError, match=r"^algo.max_lag = -1: expected an integer in 0..64"):
        schema.typed(plain)


def _saved_run(tmp_path, *overrides):
    """A run directory as nemo_rz.train leaves it (config only: these checks come before any checkpoint)."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = config.load(None, [f"run_dir={run}", *overrides])
    (run / config.RUN_CONFIG).write_text(OmegaConf.to_yaml(cfg))
    return run


@pytest.mark.parametrize("change", ["model.hidden_size=128", "task.name=add3", "seed=1", "algo.max_lag=3",
                                    "algo.group_size=4", "algo.temperature=0.5", "warmup.steps=1"])
def test_resume_refuses_what_the_checkpoint_fixes(tmp_path, change):
    run = _saved_run(tmp_path)
    with pytest.raises(ConfigError, match=f"{change.split('=')[0]} was .* now "):
        config.load(None, [f"resume={run}", change])


def test_resume_honours_and_reports_the_rest_including_a_config_file(tmp_path):
    run = _saved_run(tmp_path, "algo.updates=4")
    layer = tmp_path / "more.yaml"
    layer.write_text("algo:\n  updates: 8\n  lr: 0.0001\n")
    notes = []
    cfg = config.load(str(layer), [f"resume={run}", "eval.every=2"], log=notes.append)
    assert (cfg.algo.updates, cfg.algo.lr, cfg.eval.every, cfg.resume, cfg.run_dir) == (8, 1e-4, 2, str(run), str(run))
    assert notes == ["resume: algo.updates 4 -> 8", "resume: algo.lr 0.0003 -> 0.0001", "resume: eval.every 200 -> 2"]
    layer.write_text("model:\n  num_layers: 3\n")  # a --config file is not ignored on resume: refused here
    with pytest.raises(ConfigError, match="model.num_layers was 2, now 3"):
        config.load(str(layer), [f"resume={run}"])


def test_a_literal_dollar_brace_survives_the_run_config(tmp_path):
    """An escaped \\${...} is text: it stays text in the resolved config, in the run's config.yaml and on resume
    (which refuses a real interpolation there)."""
    run = _saved_run(tmp_path, r"task.system_prompt=use \${oc.env:HOME} and a\\\${x}")
    cfg = config.load(None, [f"resume={run}"])
    assert cfg.task.system_prompt == r"use ${oc.env:HOME} and a\${x}"
    (run / config.RUN_CONFIG).write_text((run / config.RUN_CONFIG).read_text().replace("max_lag: 2", "max_lag: ${seed}"))
    with pytest.raises(ConfigError, match=r"algo.max_lag = '\$\{seed\}' is an interpolation"):
        config.load(None, [f"resume={run}"])


def test_task_options_are_checked_and_typed_with_the_config(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    jsonl = ["task.name=jsonl", f"task.options.path={data}"]
    cfg = config.load(None, jsonl + [f"task.options.heldout_path={data}", "task.options.heldout_fraction=1"])
    assert cfg.task.options.heldout_fraction == 1.0 and isinstance(cfg.task.options.heldout_fraction, float)
    with pytest.raises(ConfigError, match="task.options.require_eos = 'maybe': expected true or false"):
        config.load(None, jsonl + ["task.options.require_eos=maybe"])
    with pytest.raises(ConfigError, match=r"heldout_fraction must be in \(0, 1\) \(or give heldout_path\), got 1.0"):
        config.load(None, jsonl + ["task.options.heldout_fraction=1"])  # checked together, with the config
    with pytest.raises(ConfigError, match="task.options.heldout_path /dev/zero: cannot read it"):
        config.load(None, jsonl + ["task.options.heldout_path=/dev/zero"])


def test_size_checks_read_the_machine(monkeypatch):
    monkeypatch.setattr(schema, "usable_cpus", lambda: 4)
    assert config.load(None, ["runtime.rollout_workers=4"]).runtime.rollout_workers == 4
    with pytest.raises(ConfigError, match="runtime.rollout_workers = 5: more than the 4 CPU core"):
        config.load(None, ["runtime.rollout_workers=5"])
    monkeypatch.setattr(schema, "available_memory", lambda: None)  # unknown: no memory bound
    assert config.load(None, ["algo.prompts_per_update=1000000"]).algo.prompts_per_update == 1_000_000


def test_available_memory_and_cpus_are_sane():
    assert schema.usable_cpus() >= 1
    avail = schema.available_memory()
    assert avail is None or avail > 0
