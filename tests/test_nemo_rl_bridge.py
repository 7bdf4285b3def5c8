"""nemo-rz's consistent layer spec inside a GPTModel built the way Megatron-Bridge's providers (and so NeMo RL's
Megatron policy) build it (nemo_rz/runtime/megatron/bridge.py).

Megatron-Bridge itself is used where it imports. Its 0.3.x wheels (the ones PyPI offers for Python 3.11) require
megatron-core >=0.15,<0.17 (0.16.1 here fits) but also transformers<5 and transformer-engine (CUDA), and the
package imports transformer_engine at import (megatron/bridge/peft/lora_layers.py), so on a CPU machine with
transformers 5 it does not import; the test against it then skips with that reason, and the others build the
provider's shape themselves: a TransformerConfig with GPTModelProvider's own fields (examples/nemo_rl/
check_megatron.py's ProviderShape, field names as megatron/bridge/models/gpt_provider.py 0.3.1 spells them),
filled from a Hugging Face config by the Bridge's CONFIG_MAPPING and its Llama / Qwen2 / Qwen3 bridges' settings,
and a GPTModel built with the arguments GPTModelProvider.provide passes. Then the kit's Megatron side: the keys of
megatron_consistent.yaml and the driver's check (the string resolved, what the spec cannot run refused).
"""
import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from conftest import tiny_model  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from megatron_world import launched, world_of_one  # noqa: E402
from nemo_rl_head_ranks import HEAD_VOCAB, head_model  # noqa: E402

from nemo_rz.models.decoder import Tokens, prepared  # noqa: E402
from nemo_rz.models.hf import save_hf  # noqa: E402
from nemo_rz.models.hf_config import config_from_hf  # noqa: E402
from nemo_rz.runtime.megatron import bridge, layers, spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / "examples" / "nemo_rl"
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct" / "config.json"


def _script(path: Path):
    spec_ = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec_)
    sys.modules[path.stem] = module  # the script's dataclass looks its module up
    spec_.loader.exec_module(module)
    return module


# the provider's shape, GPTModelProvider.provide's GPTModel and NeMo RL's two forward layouts
check = _script(KIT / "check_megatron.py")
driver = _script(KIT / "run_grpo_reinforce_zero.py")
provider_from_hf, build, dense, packed = check.provider_from_hf, check.build, check.dense, check.packed


@pytest.fixture(scope="module", autouse=True)
def one_process():
    with world_of_one():
        yield


def hf_config(model) -> dict:
    """The Hugging Face config of a tiny Decoder (Llama without qk-norm, Qwen3 with it)."""
    cfg = model.config
    return {"model_type": "qwen3" if cfg.qk_norm else "llama", "num_hidden_layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
            "rms_norm_eps": cfg.rms_norm_eps, "tie_word_embeddings": cfg.tie_word_embeddings,
            "attention_bias": cfg.attention_bias, "mlp_bias": False, "rope_theta": cfg.rope_theta, "dtype": cfg.dtype}


def batch(vocab: int):
    g = torch.Generator().manual_seed(5)
    lengths = torch.tensor([13, 6, 11])
    return torch.randint(0, vocab, (3, 13), generator=g), lengths


def valid(lengths, width):
    return torch.arange(width)[None, :] < (lengths[:, None] - 1)


def test_provider_fields_map_to_the_checkpoints_decoder_config():
    """The real SmolLM2 checkpoint's config through the Bridge's mapping gives the DecoderConfig nemo-rz's loader
    (and so its vLLM model) reads from that config."""
    if not SMOLLM2.is_file():
        pytest.skip(f"{SMOLLM2} is not here (the converted checkpoint is gitignored)")
    hf = json.loads(SMOLLM2.read_text())
    assert bridge.decoder_config(provider_from_hf(hf)) == config_from_hf(hf)
    assert bridge.decoder_config(provider_from_hf(hf, qk_layernorm=True)) != config_from_hf(hf)  # the map is read


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_gptmodel_from_the_spec_callable_equals_the_decoder_bit_for_bit(qk_norm):
    """Dense and thd-packed forwards of a GPTModel built from consistent_layer_spec(provider) (plus the output-layer
    hook) give the built-in Decoder's logprobs bit for bit. Negative controls: the stock local spec, and the packed
    row read as one sequence (the sequence boundaries ignored)."""
    model = tiny_model(3, vocab_size=61, qk_norm=qk_norm, num_layers=3, tie_word_embeddings=not qk_norm)
    config = provider_from_hf(hf_config(model))
    assert bridge.decoder_config(config) == model.config
    layer_spec = bridge.consistent_layer_spec(config)
    assert config.position_embedding_type == "none"  # RoPE moved into the core attention: the GPTModel adds none
    ids, lengths = batch(61)
    ok = valid(lengths, ids.shape[1] - 1)
    with torch.no_grad():
        want = model.token_logprobs(ids, lengths)
        gpt = build(config, layer_spec, model)
        bridge.consistent_output_layer([gpt])
        assert isinstance(gpt.output_layer, layers.ColumnLinear)
        assert torch.equal(dense(gpt, ids)[ok], want[ok])
        assert torch.equal(packed(gpt, ids, lengths)[ok], want[ok])
        assert torch.equal(packed(gpt, ids, lengths, multiple=1)[ok], want[ok])  # no padding between sequences
        merged = packed(gpt, ids, lengths, params=False)
        assert not torch.equal(merged[ok], want[ok])
        assert torch.equal(merged[0, :12], want[0, :12])  # the first sequence alone is unaffected

        # Megatron's local layers (their torch norm refuses the Llama provider's persist_layer_norm without Apex)
        local = dataclasses.replace(config, persist_layer_norm=False)  # (and RoPE through TokenParams, below)
        stock = build(local, spec.block_spec(model.config, fast=True), model)
        t = Tokens(torch.zeros(0, dtype=torch.long), torch.arange(13).repeat(3), torch.arange(3).repeat_interleave(13),
                   None, (3, 13))
        params = layers.TokenParams(tokens=prepared(model.config, t))  # the forward's tokens, for its RoPE
        mask = torch.ones(13, 13, dtype=torch.bool).triu(1)[None, None]
        lp = check.nemo_rz_logprobs(stock(ids, torch.arange(13).expand(3, 13), mask, packed_seq_params=params), ids)
        assert not torch.equal(lp[ok], want[ok])
        assert (lp[ok] - want[ok]).abs().max() < 1e-3  # the same model, other arithmetic


def test_the_spec_refuses_what_it_does_not_build_in_one_line():
    model = tiny_model(0, vocab_size=61)
    hf = hf_config(model)
    for overrides, words in [
        ({"position_embedding_type": "yarn"}, "position_embedding_type = 'yarn'"),
        ({"sequence_parallel": True, "tensor_model_parallel_size": 2}, "sequence_parallel"),
        ({"add_bias_linear": True}, "add_bias_linear"),
        ({"activation_func": F.gelu}, "activation_func"),
        ({"window_size": (4, 0)}, "window_size"),
        ({"vocab_size": None}, "vocab_size"),
    ]:
        with pytest.raises(ValueError) as e:
            bridge.consistent_layer_spec(provider_from_hf(hf, **overrides))
        assert words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="has no position_embedding_type"):  # a plain TransformerConfig lacks the provider's fields
        bridge.decoder_config(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4))
    with pytest.raises(ValueError, match="vp_stage"):
        bridge.consistent_layer_spec(provider_from_hf(hf), vp_stage=1)
    p = core_attention(model.config)
    with pytest.raises(ValueError, match="do not cover"):
        p.forward(*(torch.zeros(10, h, 16) for h in (4, 2, 2)), None,
                  packed_seq_params=PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 4, 8])))


def core_attention(cfg):
    """One layer's PackedCoreAttention, built as Megatron's SelfAttention builds its core attention."""
    from megatron.core.transformer.enums import AttnMaskType

    config = provider_from_hf(hf_config(tiny_model(0, vocab_size=61)))
    return bridge.PackedCoreAttention(config, 1, AttnMaskType.causal, "self", model_config=cfg, shared={})


def test_resolve_layer_spec_takes_the_config_string():
    assert bridge.resolve_layer_spec(bridge.SPEC_PATH) is bridge.consistent_layer_spec
    assert bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge.consistent_layer_spec") is bridge.consistent_layer_spec
    assert bridge.resolve_layer_spec(bridge.consistent_layer_spec) is bridge.consistent_layer_spec
    with pytest.raises(ValueError, match="cannot import"):
        bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge:no_such_spec")
    with pytest.raises(ValueError, match="spec\\(config\\)"):
        bridge.resolve_layer_spec("nemo_rz.runtime.megatron.bridge:_with_packed_attention")


def test_megatron_bridge_gpt_provider_builds_the_consistent_model():
    """Megatron-Bridge's own GPTModelProvider.provide with transformer_layer_spec = consistent_layer_spec."""
    try:
        from megatron.bridge.models.gpt_provider import GPTModelProvider
        from megatron.core.process_groups_config import ProcessGroupCollection
    except ImportError as e:
        import transformers

        pytest.skip(f"megatron-bridge does not import here ({e}); 0.3.x needs transformer-engine (CUDA) at import "
                    f"and transformers<5 (installed: {transformers.__version__})")
    model = tiny_model(3, vocab_size=61, qk_norm=True, num_layers=3)
    shape = dataclasses.asdict(provider_from_hf(hf_config(model)))
    fields = {f.name for f in dataclasses.fields(GPTModelProvider) if f.init}
    provider = GPTModelProvider(**{k: v for k, v in shape.items() if k in fields},
                                transformer_layer_spec=bridge.consistent_layer_spec)
    provider._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    gpt = check.load(provider.provide(pre_process=True, post_process=True), model)
    bridge.consistent_output_layer([gpt])
    ids, lengths = batch(61)
    ok = valid(lengths, ids.shape[1] - 1)
    with torch.no_grad():
        want = model.token_logprobs(ids, lengths)
        assert torch.equal(packed(gpt, ids, lengths)[ok], want[ok])


def test_check_script_counts_the_mismatch_of_each_stage(tmp_path):
    """examples/nemo_rl/check_megatron.py on a saved tiny Qwen3 checkpoint in bfloat16: with the output hook nothing
    differs; Megatron's own output layer (a bfloat16 GEMM) and NeMo RL's log-softmax on its logits are what the
    counter sees differ (its negative controls)."""
    model = tiny_model(4, vocab_size=4096, hidden_size=128, num_layers=2)  # a vocabulary where bf16 GEMMs differ
    path = save_hf(model, tmp_path / "qwen3")
    provider, _ = check.provider_for(path, "bfloat16")
    got = check.check(path, "bfloat16", provider, rows=8, length=48)
    assert got["consistent spec + output hook, dense"][0] == 0 and got["consistent spec + output hook, packed"][0] == 0
    assert got["consistent spec + output hook + the loss's VocabParallelLogprobs, packed"][0] == 0
    # Megatron's output layer is a negative control where this CPU's bfloat16 GEMM is not row-invariant (Intel
    # AVX-512 and AMD AVX2 machines). On AMD Zen 4 torch's bfloat16 GEMM is row-invariant and rounds like the
    # consistent route at all but ~2e-5 of the logits, so it may differ at no token. NeMo RL's log-softmax differs.
    stock_varies = not _stock_bf16_gemm_row_invariant(128, 4096)
    for what, must_differ in (("consistent spec, stock output layer, packed", stock_varies),
                              ("... + NeMo RL's log-softmax, packed", True)):
        diff, n, worst = got[what]
        assert (0 < diff or not must_differ) and diff <= n and worst < 0.1, (what, got[what])


def _stock_bf16_gemm_row_invariant(k: int, n: int, rows: int = 64) -> bool:
    """Whether torch's own bfloat16 x @ w.T [rows, k] x [k, n] gives each row the bits it has alone (this CPU's)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    full = F.linear(x, w)
    return all(torch.equal(F.linear(x[i : i + 1], w), full[i : i + 1]) for i in range(rows))


# ------------------------------------------------------------------ the kit: megatron_consistent.yaml and the driver
# nemo_rl/models/policy/__init__.py (PolicyConfig, MegatronConfig) and nemo_rl/utils/checkpoint.py
# (PretrainedCheckpointConfig), main of 2026-08-22: the keys megatron_consistent.yaml sets.
NEMO_RL_MAIN_KEYS = {
    "policy": {"dtensor_cfg", "megatron_cfg", "pretrained_checkpoint"},
    "policy.dtensor_cfg": {"enabled"},
    "policy.pretrained_checkpoint": {"format", "path"},
    "policy.megatron_cfg": {"enabled", "model_overrides", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                            "context_parallel_size", "sequence_parallel", "use_fused_linear_logprobs"},
}


def _keys(cfg: dict, path: str = "") -> set[str]:
    out = set()
    for key, value in cfg.items():
        full = f"{path}.{key}" if path else key
        out.add(full)
        if isinstance(value, dict) and full != "policy.megatron_cfg.model_overrides":  # provider fields, not NeMo RL's
            out |= _keys(value, full)
    return out


def test_megatron_override_sets_keys_nemo_rl_reads_on_top_of_the_reinforce_zero_override():
    import yaml

    cfg = yaml.safe_load((KIT / "megatron_consistent.yaml").read_text())
    assert cfg.pop("defaults") == "reinforce_zero.yaml"
    known = {f"{section}.{k}" for section, keys in NEMO_RL_MAIN_KEYS.items() for k in keys} | {"policy"}
    known |= {"reinforce_zero", "reinforce_zero.logprobs"}  # ours (the driver's; test_nemo_rl_kit.OUR_KEYS)
    assert cfg["reinforce_zero"]["logprobs"] == "consistent"
    assert _keys(cfg) <= known
    assert bridge.resolve_layer_spec(cfg["policy"]["megatron_cfg"]["model_overrides"]["transformer_layer_spec"]) \
        is bridge.consistent_layer_spec
    cfg["policy"]["megatron_cfg"]["sequence_paralel"] = False  # negative control: a misspelled key is found
    assert _keys(cfg) - known == {"policy.megatron_cfg.sequence_paralel"}


def megatron_policy(**meg) -> dict:
    cfg = {"enabled": True, "model_overrides": {"transformer_layer_spec": bridge.SPEC_PATH},
           "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
           "sequence_parallel": False}
    cfg.update(meg)
    return {"policy": {"megatron_cfg": cfg, "pretrained_checkpoint": {"format": "megatron_bridge", "path": "/ckpt"}}}


@pytest.fixture
def nemo_rl_main(tmp_path, monkeypatch):
    """A stand-in NeMo RL whose nemo_rl/models/megatron/setup.py reads model_overrides (main from 2026-08-11)."""
    def install(reads: bool):
        root = tmp_path / ("main" if reads else "v0.7")
        pkg = root / "nemo_rl" / "models" / "megatron"
        pkg.mkdir(parents=True)
        for d in (root / "nemo_rl", root / "nemo_rl" / "models", pkg):
            (d / "__init__.py").write_text("")
        (pkg / "setup.py").write_text("model_overrides = config['megatron_cfg'].get('model_overrides')\n" if reads
                                      else "# v0.7.0: no provider overrides\n")
        _forget_nemo_rl()
        monkeypatch.syspath_prepend(str(root))
    yield install
    _forget_nemo_rl()  # the stand-in imported here must not stay for other tests (nor a real one be cached)


def _forget_nemo_rl():
    for name in [m for m in sys.modules if m == "nemo_rl" or m.startswith("nemo_rl.")]:
        del sys.modules[name]


def test_driver_turns_the_spec_string_into_the_function(nemo_rl_main):
    nemo_rl_main(True)
    cfg = megatron_policy()
    driver.check_megatron(cfg)
    assert cfg["policy"]["megatron_cfg"]["model_overrides"]["transformer_layer_spec"] is bridge.consistent_layer_spec
    plain = {"policy": {"megatron_cfg": {"enabled": True}}}
    driver.check_megatron(plain)  # no layer spec named: nothing to do
    assert plain == {"policy": {"megatron_cfg": {"enabled": True}}}


@pytest.mark.parametrize("change, words", [
    ({"enabled": False}, "policy.megatron_cfg.enabled is false"),
    ({"tensor_model_parallel_size": 2}, "policy.megatron_cfg.tensor_model_parallel_size = 2"),
    ({"context_parallel_size": 2}, "policy.megatron_cfg.context_parallel_size = 2"),
    ({"sequence_parallel": True}, "policy.megatron_cfg.sequence_parallel = True"),
    ({"use_fused_linear_logprobs": True}, "use_fused_linear_logprobs = True"),
    ({"model_overrides": {"transformer_layer_spec": "nemo_rz.runtime.megatron.bridge:nope"}}, "cannot import"),
    ({"pretrained_checkpoint": None}, "policy.pretrained_checkpoint.format = None"),
    ({"reads": False}, "does not read policy.megatron_cfg.model_overrides"),
])
def test_driver_refuses_what_the_consistent_spec_cannot_run(nemo_rl_main, change, words):
    nemo_rl_main(change.pop("reads", True))
    cfg = megatron_policy(**{k: v for k, v in change.items() if k != "pretrained_checkpoint"})
    if "pretrained_checkpoint" in change:
        del cfg["policy"]["pretrained_checkpoint"]
    with pytest.raises(driver.KitError) as e:
        driver.check_megatron(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_the_module_registers_itself_with_megatron_bridges_target_allowlist(monkeypatch):
    """A stand-in for Megatron-Bridge's instantiate_utils (NeMo RL main's pinned commit): allow_in_checkpoints adds
    exactly this module's prefix; without the function (Megatron-Bridge 0.3.x, or none) it registers nothing."""
    import types

    got = []
    utils = types.ModuleType("megatron.bridge.utils.instantiate_utils")
    utils.register_allowed_target_prefix = got.append
    for name in ("megatron.bridge", "megatron.bridge.utils"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "megatron.bridge.utils.instantiate_utils", utils)
    assert bridge.allow_in_checkpoints() and got == ["nemo_rz.runtime.megatron.bridge"]
    target = f"{bridge.consistent_layer_spec.__module__}.{bridge.consistent_layer_spec.__qualname__}"
    assert target.startswith(got[0] + ".")  # what Megatron-Bridge saves for the field matches the prefix
    del utils.register_allowed_target_prefix
    assert not bridge.allow_in_checkpoints() and len(got) == 1


# ------------------------------------------------ the loss's logprobs: nemo-rz's output layer and log-softmax in NeMo RL
def test_loss_logprobs_from_the_models_logits_equal_the_decoders_bit_for_bit():
    """The GPTModel NeMo RL builds with the consistent spec and the output-layer hook, its logits handed to the loss as
    NeMo RL hands a LOGIT loss its input (prepare_loss_input: `logits=`; packed: each sequence's padded slice of the
    row): VocabParallelLogprobs gives the built-in Decoder's token_logprobs bit for bit, and the loss equals the
    loss on those logprobs. Negative control: NeMo RL's own log-softmax (from_parallel_logits_to_logprobs at TP=1)
    on the same logits differs (Megatron's output layer: test_check_script_counts_the_mismatch_of_each_stage)."""
    from nemo_rz.algorithms.nemo_rl import ReinforceZeroLossFn
    from nemo_rz.runtime.megatron.nemo_rl_policy import VocabParallelLogprobs

    model = head_model()
    config = provider_from_hf(hf_config(model))
    head = VocabParallelLogprobs(HEAD_VOCAB)
    ids, lengths = batch(HEAD_VOCAB)
    ok = valid(lengths, ids.shape[1] - 1)
    with torch.no_grad():
        want = model.token_logprobs(ids)
        gpt = build(config, bridge.consistent_layer_spec(config), model)
        mask = torch.ones(13, 13, dtype=torch.bool).triu(1)[None, None]
        bridge.consistent_output_layer([gpt])
        logits = gpt(ids, torch.arange(13).expand(3, 13), mask)
        assert torch.equal(head(logits, ids), want)
        assert not torch.equal(check.nemo_rl_logprobs(logits, ids), want)  # NeMo RL's log-softmax
        # sequence packing: the wrapper hands each sequence's padded slice, the data cut to its length
        got = torch.zeros_like(want)
        for i, n in enumerate(lengths.tolist()):
            padded = -(-n // 8) * 8
            row = torch.nn.functional.pad(ids[i, :n], (0, padded - n))[None]
            got[i, : n - 1] = head(gpt(row, torch.arange(padded)[None], mask[..., :padded, :padded]), ids[i:i + 1, :n])[0]
        assert torch.equal(got[ok], model.token_logprobs(ids, lengths)[ok])

    g = torch.Generator().manual_seed(8)
    data = {"input_ids": ids, "token_mask": torch.ones(3, 13), "sample_mask": torch.ones(3),
            "generation_logprobs": -torch.rand(3, 13, generator=g), "prev_logprobs": torch.zeros(3, 13),
            "advantages": torch.tensor([1.0, -0.5, 0.25])}
    loss_fn = ReinforceZeroLossFn(logprobs_from_logits=head)
    assert loss_fn.input_type.value == "logit"
    leaf = logits.detach().requires_grad_(True)
    loss, metrics = loss_fn(data=data, global_valid_seqs=torch.tensor(3), global_valid_toks=torch.tensor(36), logits=leaf)
    ref, ref_metrics = ReinforceZeroLossFn()(data=data, global_valid_seqs=torch.tensor(3), global_valid_toks=torch.tensor(36),
                                             next_token_logprobs=want)
    assert torch.equal(loss.detach(), ref) and metrics == ref_metrics
    loss.backward()
    assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all()) and bool(leaf.grad.abs().sum() > 0)
    with pytest.raises(ValueError, match="needs logits="):
        loss_fn(data=data, global_valid_seqs=3, global_valid_toks=36, next_token_logprobs=want)
    with pytest.raises(ValueError, match="ratio_source"):
        ReinforceZeroLossFn(logprobs_from_logits=head, ratio_source="prev")
    with pytest.raises(ValueError, match="fewer than vocab_size"):
        VocabParallelLogprobs(HEAD_VOCAB + 7)(logits, ids)


@pytest.mark.slow
def test_head_over_two_tensor_parallel_ranks_equals_one_process(tmp_path):
    """tests/nemo_rl_head_ranks.py over 2 ranks (gloo): the GPTModel's output layer at TP=2 (Megatron's
    ColumnParallelLinear replaced by the hook), its vocabulary shards through VocabParallelLogprobs: the Decoder's
    logprobs bit for bit on both ranks. Negative controls: NeMo RL's two-level distributed log-softmax (max and
    exp-sum all-reduced over the shards, from_parallel_logits_to_logprobs re-implemented from its source) and the
    ranks' shards gathered in the wrong order."""
    from nemo_rl_head_ranks import batch as head_batch

    model = head_model()
    ids = head_batch()
    got = launched("nemo_rl_head_ranks.py", tmp_path / "out.pt")
    with torch.no_grad():
        want = model.token_logprobs(ids)
    for rank in (0, 1):
        assert torch.equal(got["consistent"][rank], want)
        assert not torch.equal(got["nemo_rl"][rank], want)
        assert (got["nemo_rl"][rank] - want).abs().max() < 1e-3  # the same distribution, other rounding
        assert not torch.equal(got["swapped"][rank], want)
    assert got["hooked"] == [True, True]


SETUP_MAIN = "def setup_model_and_optimizer(policy_cfg, megatron_cfg, load_optimizer=True, get_embedding_ranks=None, " \
             "get_position_embedding_ranks=None, pre_load_checkpoint_hook=None, additional_pre_wrap_hooks=None, " \
             "load_weights=True):\n    return additional_pre_wrap_hooks\n"
SETUP_V06 = "def setup_model_and_optimizer(policy_cfg, megatron_cfg, load_optimizer=True, get_embedding_ranks=None, " \
            "get_position_embedding_ranks=None):\n    return None\n"


def _modules(setup_source: str, worker: bool):
    """Stand-ins for nemo_rl.models.megatron.setup (setup_model_and_optimizer with NeMo RL's signature: main of
    2026-08-22, or v0.6.0) and the Megatron policy worker module that imported the name."""
    import types

    setup = types.ModuleType("nemo_rl.models.megatron.setup")
    exec(setup_source, setup.__dict__)
    mods = {"nemo_rl.models.megatron.setup": setup}
    if worker:
        w = types.ModuleType("nemo_rl.models.policy.workers.megatron_policy_worker")
        w.setup_model_and_optimizer = setup.setup_model_and_optimizer
        mods[w.__name__] = w
    return mods


def test_install_output_layer_hooks_nemo_rls_megatron_setup():
    """install_output_layer adds consistent_output_layer to the pre-wrap hooks NeMo RL's setup_model_and_optimizer
    applies (the worker's call passes none; other hooks stay first), in the setup module and in the worker module's
    imported name, once however often it is installed. Negative control: NeMo RL v0.6's function, which takes no
    additional_pre_wrap_hooks, is refused in one line."""
    from nemo_rz.runtime.megatron import nemo_rl_policy

    mods = _modules(SETUP_MAIN, worker=True)
    assert nemo_rl_policy.install_output_layer(mods) and nemo_rl_policy.install_output_layer(mods)
    worker = mods[nemo_rl_policy.WORKER_MODULE]
    assert worker.setup_model_and_optimizer({}, None, True) == [bridge.consistent_output_layer]
    other = object()
    setup = mods[nemo_rl_policy.SETUP_MODULE].setup_model_and_optimizer
    assert setup({}, None, additional_pre_wrap_hooks=[other]) == [other, bridge.consistent_output_layer]
    nemo_rl_policy.check_output_layer(mods)
    assert nemo_rl_policy.install_output_layer({}) is False  # no NeMo RL Megatron setup in this process
    with pytest.raises(nemo_rl_policy.NeMoRLVersionError) as e:
        nemo_rl_policy.install_output_layer(_modules(SETUP_V06, worker=False))
    assert "additional_pre_wrap_hooks" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(nemo_rl_policy.NeMoRLVersionError, match="does not apply nemo-rz's output layer"):
        nemo_rl_policy.check_output_layer(_modules(SETUP_MAIN, worker=True))  # loaded after the install: refused


def test_driver_selects_the_consistent_logprobs(nemo_rl_main, tmp_path):
    """reinforce_zero.logprobs: consistent gives the loss VocabParallelLogprobs of the checkpoint's vocabulary (a
    LOGIT loss); without the consistent spec, with NeMo RL's fused packed loss or a temperature it is refused."""
    nemo_rl_main(True)
    path = save_hf(tiny_model(0, vocab_size=61), tmp_path / "ckpt")

    def master(**policy):
        cfg = megatron_policy()
        cfg["policy"].update(model_name=str(path), **policy)
        cfg["reinforce_zero"] = {"logprobs": "consistent"}
        return cfg

    loss = driver.loss_from_config(master())
    assert loss.input_type.value == "logit" and loss.logprobs_from_logits.vocab_size == 61
    assert driver.loss_from_config({**master(), "reinforce_zero": {}}).logprobs_from_logits is None
    no_spec = master()
    no_spec["policy"]["megatron_cfg"]["model_overrides"] = {}
    for cfg, words in [(no_spec, "needs NeMo RL's Megatron policy with nemo-rz's layer spec"),
                       (master(sequence_packing={"enabled": True, "fuse_loss": True}), "fuse_loss = True"),
                       (master(generation={"temperature": 0.7}), "policy.generation.temperature = 0.7"),
                       ({**master(), "reinforce_zero": {"logprobs": "fast"}}, "reinforce_zero.logprobs = 'fast'")]:
        with pytest.raises(driver.KitError) as e:
            driver.loss_from_config(cfg)
        assert words in str(e.value) and "\n" not in str(e.value)
