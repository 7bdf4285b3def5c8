"""NeMo RL's GRPO with REINFORCE Zero's loss: `ReinforceZeroLossFn` where NeMo RL builds `ClippedPGLossFn`.

Run it in NeMo RL's environment, from NeMo RL's checkout (examples/nemo_rl/README.md says how to install
nemo-rz there):

    uv run python /path/to/nemo-rz/examples/nemo_rl/run_grpo_reinforce_zero.py \
        [--config examples/configs/grpo_math_1B.yaml] [--rz-config reinforce_zero.yaml] [overrides ...]

NeMo RL has no loss registry: `nemo_rl.algorithms.grpo.setup()` builds `ClippedPGLossFn(loss_fn config)` and
returns it inside a tuple (10 entries in v0.6, 13 in v0.7 and later). This driver wraps `setup`: the wrapper
checks the config, calls NeMo RL's `setup` unchanged, and returns the same tuple with a `ReinforceZeroLossFn` in
the one place that held the `ClippedPGLossFn`. It then runs NeMo RL's own entry point, `examples/run_grpo.py`,
which imports `setup` when it runs and so gets the wrapper; data, cluster, generation, refit and the sync or
async training loop all stay NeMo RL's. Read against NeMo RL v0.6.0, v0.7.0 and main of 2026-08-22.

With `policy.megatron_cfg.model_overrides.transformer_layer_spec` set (megatron_consistent.yaml), the wrapper also
turns that "module:function" string into the function before NeMo RL's setup (NeMo RL hands YAML values to the
Megatron-Bridge provider verbatim, and the provider calls the field), after refusing the Megatron settings that
nemo-rz's consistent spec cannot run (nemo_rz/runtime/megatron/bridge.py).

The config is NeMo RL's `--config` (default: its examples/configs/grpo_math_1B.yaml) with `--rz-config`
(default: reinforce_zero.yaml beside this script) merged on top by NeMo RL's `defaults:` inheritance, then the
command line's overrides, exactly as NeMo RL applies them.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import runpy
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROG = "run_grpo_reinforce_zero"
ARCH = "NemoRZForCausalLM"  # nemo-rz's model class inside vLLM (nemo_rz.generation.vllm.ARCH)


class KitError(ValueError):
    """A config or a NeMo RL version this driver cannot run with; the message is one line."""


def _get(cfg, key: str, default=None):
    """cfg[key] for dicts (NeMo RL v0.6 configs), the attribute for pydantic models (v0.7+ MasterConfig)."""
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def loss_from_config(master_config):
    """The ReinforceZeroLossFn the config asks for, after checking the loss settings NeMo RL itself acts on."""
    from nemo_rz.algorithms import ReinforceZeroLossFn

    rz = _get(master_config, "reinforce_zero")
    if not isinstance(rz, Mapping):
        raise KitError("the config has no reinforce_zero section: merge examples/nemo_rl/reinforce_zero.yaml "
                       "(--rz-config)")
    loss_cfg = _get(master_config, "loss_fn", {})
    for key, want, why in (
        ("reference_policy_kl_penalty", 0, "REINFORCE Zero has no KL term, and NeMo RL would load a reference model"),
        ("use_kl_in_reward", False, "NeMo RL would subtract a KL penalty from the rewards"),
    ):
        value = _get(loss_cfg, key, want)
        if value != want:
            raise KitError(f"loss_fn.{key} = {value!r}: {why}; set it to {want}")
    token_level = _get(loss_cfg, "token_level_loss", False)
    if not isinstance(token_level, bool):
        raise KitError(f"loss_fn.token_level_loss = {token_level!r}: expected true or false")
    head = logprobs_head(master_config, rz.get("logprobs", "nemo_rl"))
    try:
        return ReinforceZeroLossFn(correction=rz.get("correction", "unclipped"), token_level_loss=token_level,
                                   ratio_source=rz.get("ratio_source", "current"), logprobs_from_logits=head,
                                   **dict(rz.get("params") or {}))
    except (ValueError, KeyError, TypeError) as e:
        raise KitError(f"reinforce_zero: {e}") from None


LOGPROBS = ("nemo_rl", "consistent")


def logprobs_head(master_config, which):
    """reinforce_zero.logprobs: None for NeMo RL's log-softmax (`nemo_rl`); for `consistent`, nemo-rz's over the
    Megatron policy's logits (nemo_rz.runtime.megatron.nemo_rl_policy.VocabParallelLogprobs), after refusing what
    would put other arithmetic between the model's logits and the loss."""
    if which not in LOGPROBS:
        raise KitError(f"reinforce_zero.logprobs = {which!r}: expected one of {', '.join(LOGPROBS)}")
    if which == "nemo_rl":
        return None
    policy = _get(master_config, "policy", {})
    meg = policy.get("megatron_cfg") or {}
    spec = (meg.get("model_overrides") or {}).get("transformer_layer_spec")
    key = "reinforce_zero.logprobs = 'consistent'"
    named = spec in (SPEC_PATH, SPEC_PATH.replace(":", ".")) or getattr(spec, "__name__", None) == "consistent_layer_spec"
    if not (meg.get("enabled", False) and named):
        raise KitError(f"{key} needs NeMo RL's Megatron policy with nemo-rz's layer spec ({SPEC_KEY}: {SPEC_PATH}, "
                       "megatron_consistent.yaml), which also gives it nemo-rz's output layer")
    packing = policy.get("sequence_packing") or {}
    gen = policy.get("generation") or {}
    _refuse([
        ("policy.sequence_packing.fuse_loss", packing.get("fuse_loss", False), lambda v: not v,
         "NeMo RL's fused packed loss computes the logprobs itself (LOGPROB losses only): set false"),
        ("policy.generation.temperature", gen.get("temperature", 1.0), lambda v: v == 1.0,
         "NeMo RL divides the logits by it in the model dtype before the loss: set 1.0"),
    ])
    try:
        from nemo_rz.runtime.megatron.nemo_rl_policy import VocabParallelLogprobs
    except ImportError as e:
        raise KitError(f"{key}: nemo-rz's Megatron side needs megatron-core where the driver runs ({e}); run the "
                       "driver with NeMo RL's Megatron extra: uv run --extra mcore python ...") from None
    return VocabParallelLogprobs(vocab_size(policy.get("model_name")))


def vocab_size(model_name) -> int:
    """The checkpoint's vocabulary size (its Hugging Face config), the one the rollout engine samples over."""
    from transformers import AutoConfig

    try:
        size = AutoConfig.from_pretrained(model_name).vocab_size
    except (OSError, ValueError) as e:
        raise KitError(f"reinforce_zero.logprobs = 'consistent': the config of policy.model_name {model_name!r} "
                       f"cannot be read ({str(e).splitlines()[0]}); set policy.model_name to the checkpoint") from None
    if not isinstance(size, int) or size < 1:
        raise KitError(f"policy.model_name {model_name!r}: its config's vocab_size is {size!r}, not a vocabulary size")
    return size


def check_generation(master_config) -> None:
    """Refuse sampling that leaves the importance weights without full-vocabulary logprobs; if the config runs
    nemo-rz's model in vLLM, also the settings that would make its recorded logprobs describe another distribution
    or other arithmetic than the learner's, and fill in the checkpoint family."""
    from nemo_rz.ops import KERNELS, KV_BLOCK

    policy = _get(master_config, "policy", {})
    gen = policy.get("generation") or {}
    kwargs = gen.get("vllm_kwargs") or {}
    overrides = kwargs.get("hf_overrides") or {}
    cfg = gen.get("vllm_cfg") or {}
    g, c, h = "policy.generation", "policy.generation.vllm_cfg", "policy.generation.vllm_kwargs.hf_overrides"
    # Importance weights need full-vocabulary logprobs on both sides; with top-k / top-p NeMo RL's learner
    # renormalises over the kept set and zeroes the logprob of a sampled token outside it, unseen by the loss.
    _refuse([
        (f"{g}.top_k", gen.get("top_k"), lambda v: v in (None, 0, -1),
         "top-k changes the distribution the logprobs describe, and NeMo RL's learner would zero some: set null"),
        (f"{g}.top_p", gen.get("top_p"), lambda v: v == 1.0,
         "top-p changes the distribution the logprobs describe, and NeMo RL's learner would zero some: set 1.0"),
    ])
    if ARCH not in (overrides.get("architectures") or []):  # NeMo RL's stock vLLM model: nothing of nemo-rz in vLLM
        if cfg.get("logprobs_mode") == "raw_logits":
            raise KitError("policy.generation.vllm_cfg.logprobs_mode = 'raw_logits' without nemo-rz's model in vLLM "
                           "would record vLLM's raw logits as logprobs: set processed_logprobs")
        return
    learner_dtype = policy.get("precision")
    _refuse([
        (f"{g}.backend", gen.get("backend"), lambda v: v == "vllm", "nemo-rz's model runs inside vLLM: set vllm"),
        (f"{g}.temperature", gen.get("temperature"), lambda v: v == 1.0,
         "the model already returns log_softmax(logits / nemo_rz_temperature) and NeMo RL would divide by it again "
         "in vLLM's sampler: set 1.0"),
        (f"{h}.nemo_rz_temperature", overrides.get("nemo_rz_temperature", 1.0), lambda v: v == 1.0,
         "the learner's logprobs are at generation.temperature 1.0: set 1.0"),
        (f"{h}.nemo_rz_kernels", overrides.get("nemo_rz_kernels", "consistent"), lambda v: v in KERNELS,
         f"use one of {', '.join(KERNELS)}"),
        (f"{h}.nemo_rz_precision", overrides.get("nemo_rz_precision"), _unquantized,
         "NeMo RL's learner runs unquantized linears; quantized rollout linears would give other logprobs: set null"),
        (f"{h}.nemo_rz_lora", overrides.get("nemo_rz_lora"), lambda v: v is None,
         "NeMo RL's learner trains no nemo-rz LoRA adapters, so the rollout's would give other logprobs: set null"),
        (f"{c}.precision", cfg.get("precision"), lambda v: v in ("float32", "bfloat16") and v == learner_dtype,
         f"rollout and learner must use one dtype, float32 or bfloat16 (policy.precision is {learner_dtype!r})"),
        (f"{c}.kv_cache_dtype", cfg.get("kv_cache_dtype", "auto"), lambda v: v == "auto",
         "a quantized KV cache changes keys and values: set auto"),
        (f"{c}.enforce_eager", cfg.get("enforce_eager", False), lambda v: v is True,
         "CUDA graphs would capture the model's step: set true"),
        *((f"{c}.{key}", cfg.get(key, 1), lambda v: v == 1, "nemo-rz's vLLM model runs unsharded: set 1 (one engine "
           "per GPU)") for key in ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size")),
        (f"{g}.refit_transport", gen.get("refit_transport"), lambda v: v is None,
         "nemo-rz's model takes new weights by Hugging Face name through its load_weights, which NeMo RL's default "
         "refit (IPC or collective) calls; the other transports write vLLM's own parameter layout: set null"),
        ("policy.generation.vllm_kwargs.block_size", kwargs.get("block_size"),
         lambda v: isinstance(v, int) and v > 0 and v % KV_BLOCK == 0,
         f"nemo-rz's paged attention reads whole {KV_BLOCK}-token tiles: set a multiple of {KV_BLOCK}"),
    ])
    overrides["nemo_rz_architecture"] = checkpoint_family(policy.get("model_name"),
                                                          overrides.get("nemo_rz_architecture"))


def _refuse(rules) -> None:
    """rules: (dotted key, value, ok(value), why and what to set); the first value that is not ok is refused."""
    for key, value, ok, why in rules:
        if not ok(value):
            raise KitError(f"{key} = {value!r}: {why}")


def _unquantized(spec) -> bool:
    from nemo_rz.quant.linear import Precision

    try:
        return not Precision.of(spec).enabled
    except (TypeError, ValueError):
        return False


def checkpoint_family(model_name, given):
    """The architecture nemo-rz's Decoder must build for the checkpoint: `given`, or read from its config."""
    from nemo_rz.models.hf_config import ARCHITECTURES

    key = "policy.generation.vllm_kwargs.hf_overrides.nemo_rz_architecture"
    if given is None:
        from transformers import AutoConfig

        try:
            found = AutoConfig.from_pretrained(model_name).architectures or []
        except (OSError, ValueError) as e:
            raise KitError(f"{key} is null and the config of policy.model_name {model_name!r} cannot be read "
                           f"({str(e).splitlines()[0]}); set it to one of {', '.join(ARCHITECTURES)}") from None
        given = next((a for a in found if a in ARCHITECTURES), found[0] if found else None)
    if given not in ARCHITECTURES:
        raise KitError(f"{key} = {given!r}: nemo-rz's vLLM model builds {', '.join(ARCHITECTURES)}; use such a "
                       "checkpoint, or drop the hf_overrides to keep NeMo RL's stock vLLM model")
    return given


SPEC_KEY = "policy.megatron_cfg.model_overrides.transformer_layer_spec"
SPEC_PATH = "nemo_rz.runtime.megatron.bridge:consistent_layer_spec"


def reads_model_overrides() -> bool:
    """Whether the NeMo RL here merges policy.megatron_cfg.model_overrides into the Megatron-Bridge provider
    (nemo_rl/models/megatron/setup.py, main from 2026-08-11; v0.6 and v0.7 ignore the key)."""
    try:
        found = importlib.util.find_spec("nemo_rl.models.megatron.setup")
    except (ImportError, ValueError):
        return False
    return bool(found and found.origin) and "model_overrides" in Path(found.origin).read_text(errors="replace")


def check_megatron(master_config) -> None:
    """With a layer spec named in policy.megatron_cfg.model_overrides: the string replaced by the function, and, for
    nemo-rz's consistent spec, the Megatron settings it cannot run refused before any worker starts."""
    policy = _get(master_config, "policy", {})
    meg = policy.get("megatron_cfg") or {}
    overrides = meg.get("model_overrides") or {}
    value = overrides.get("transformer_layer_spec")
    if value is None:
        return
    if not meg.get("enabled", False):
        raise KitError(f"{SPEC_KEY} is set but policy.megatron_cfg.enabled is false: run NeMo RL's Megatron policy "
                       "(e.g. --config examples/configs/grpo_math_1B_megatron.yaml) or drop the key")
    if not reads_model_overrides():
        raise KitError(f"{SPEC_KEY}: this NeMo RL does not read policy.megatron_cfg.model_overrides (NeMo RL main "
                       "from 2026-08-11 does; v0.6 and v0.7 would build the stock spec): use such a NeMo RL")
    try:
        from nemo_rz.runtime.megatron import bridge
    except ImportError as e:
        raise KitError(f"{SPEC_KEY}: nemo-rz's Megatron layer spec needs megatron-core where the driver runs ({e}); "
                       "run the driver with NeMo RL's Megatron extra: uv run --extra mcore python ...") from None
    try:
        fn = bridge.resolve_layer_spec(value)
    except ValueError as e:
        raise KitError(str(e)) from None
    if fn is bridge.consistent_layer_spec:
        m = "policy.megatron_cfg"
        ckpt = policy.get("pretrained_checkpoint") or {}
        _refuse([
            ("policy.pretrained_checkpoint.format", ckpt.get("format"), lambda v: v == "megatron_bridge",
             "the checkpoint NeMo RL converts from Hugging Face is built with the stock Transformer Engine spec, whose "
             "norm parameters (linear_qkv.layer_norm_weight) the consistent spec does not have: convert it with the "
             "consistent spec (examples/nemo_rl/README.md) and set megatron_bridge"),
            ("policy.pretrained_checkpoint.path", ckpt.get("path"), lambda v: isinstance(v, str) and bool(v),
             "set the checkpoint converted with the consistent spec"),
            *((f"{m}.{key}", meg.get(key, 1), lambda v: v == 1, why) for key, why in (
                ("tensor_model_parallel_size", "the consistent linears have no Megatron sharded checkpoint layout "
                 "yet: set 1"),
                ("pipeline_model_parallel_size", "the consistent spec lists every layer (one stage): set 1"),
                ("context_parallel_size", "the consistent core attention sees its rank's tokens only: set 1"))),
            (f"{m}.sequence_parallel", meg.get("sequence_parallel", False), lambda v: v is False,
             "the consistent linears do not scatter the sequence: set false"),
            (f"{m}.use_fused_linear_logprobs", meg.get("use_fused_linear_logprobs", False), lambda v: v is False,
             "NeMo RL's fused linear cross-entropy bypasses the model's output layer: set false"),
        ])
    overrides["transformer_layer_spec"] = fn


def swap_loss(returned, clipped_cls, loss_fn):
    """`returned` (setup's tuple) with `loss_fn` in the one place that holds a `clipped_cls` instance."""
    where = [i for i, x in enumerate(returned)
             if isinstance(x, clipped_cls)] if isinstance(returned, tuple) else []
    if len(where) != 1:
        raise KitError(f"nemo_rl.algorithms.grpo.setup returned {type(returned).__name__} with {len(where)} "
                       f"{clipped_cls.__name__} objects, expected a tuple with one: this NeMo RL version is not "
                       "one the driver was read against (v0.6.0 to main of 2026-08-22)")
    return returned[:where[0]] + (loss_fn,) + returned[where[0] + 1:]


@contextlib.contextmanager
def reinforce_zero_setup(grpo):
    """While active, `grpo.setup` checks the config (before NeMo RL starts any worker), runs NeMo RL's setup and
    returns its tuple with ReinforceZeroLossFn in place of ClippedPGLossFn."""
    original, clipped = grpo.setup, grpo.ClippedPGLossFn

    @functools.wraps(original)
    def setup(master_config, *args, **kwargs):
        loss_fn = loss_from_config(master_config)
        check_generation(master_config)
        check_megatron(master_config)
        return swap_loss(original(master_config, *args, **kwargs), clipped, loss_fn)

    grpo.setup = setup
    try:
        yield
    finally:
        grpo.setup = original


def _fail(message: str) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="NeMo RL GRPO config (default: NeMo RL's examples/configs/grpo_math_1B.yaml)")
    parser.add_argument("--rz-config", default=str(HERE / "reinforce_zero.yaml"), help="override merged on top")
    parser.add_argument("--nemo-rl-script", help="NeMo RL's GRPO entry point (default: examples/run_grpo.py of "
                                                 "the checkout nemo_rl is imported from)")
    args, overrides = parser.parse_known_args(argv)
    try:
        import nemo_rl
        from nemo_rl.algorithms import grpo
    except ImportError as e:
        return _fail(f"nemo_rl is not importable here ({e}); run this script in NeMo RL's environment: "
                     f"cd NeMo-RL && uv run python {Path(__file__).resolve()} ...")
    try:
        import nemo_rz.algorithms  # noqa: F401
    except ImportError as e:
        return _fail(f"nemo_rz is not importable in NeMo RL's environment ({e}); install it there as "
                     f"{HERE / 'README.md'} says")
    script = Path(args.nemo_rl_script or Path(nemo_rl.__file__).resolve().parent.parent / "examples" / "run_grpo.py")
    base = Path(args.config or script.parent / "configs" / "grpo_math_1B.yaml")
    for flag, path in (("--nemo-rl-script", script), ("--config", base), ("--rz-config", Path(args.rz_config))):
        if not path.is_file():
            return _fail(f"{flag}: {path} is not a file; pass the right path with {flag}")
    argv_before = sys.argv
    with tempfile.TemporaryDirectory(prefix="nemo_rz_grpo_") as tmp:
        merged = Path(tmp) / "config.yaml"  # NeMo RL's load_config merges `defaults` in order (JSON is YAML)
        merged.write_text(json.dumps({"defaults": [str(base.resolve()), str(Path(args.rz_config).resolve())]}))
        sys.argv = [str(script), "--config", str(merged), *overrides]
        try:
            with reinforce_zero_setup(grpo):
                runpy.run_path(str(script), run_name="__main__")
        except KitError as e:
            return _fail(str(e))
        finally:
            sys.argv = argv_before
    return 0


if __name__ == "__main__":
    sys.exit(main())
