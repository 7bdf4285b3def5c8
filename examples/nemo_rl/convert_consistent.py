"""Convert a Hugging Face checkpoint to the Megatron-Bridge checkpoint that NeMo RL's Megatron policy loads with
nemo-rz's consistent layer spec (megatron_consistent.yaml).

NeMo RL converts a Hugging Face model itself on its first Megatron run, but with Megatron-Bridge's stock layer spec
(Transformer Engine's fused norm-linear modules: `linear_qkv.layer_norm_weight`); the consistent spec's modules are
Megatron's local-spec names (`input_layernorm.weight`), so its checkpoint is converted here, by NeMo RL's own
converter (`nemo_rl.models.megatron.community_import.import_model_from_hf_name`, as NeMo RL's converter round-trip
test calls it) with `transformer_layer_spec=consistent_layer_spec`:

    cd NeMo-RL
    uv run --extra mcore python /path/to/nemo-rz/examples/nemo_rl/convert_consistent.py \
        Qwen/Qwen2.5-1.5B /checkpoints/qwen2.5-1.5b-consistent --dtype bfloat16
    # then: policy.pretrained_checkpoint.path=/checkpoints/qwen2.5-1.5b-consistent/iter_0000000

Read against NeMo RL main of 2026-08-22 (the function's signature and the megatron_config keys it reads).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

PROG = "convert_consistent"


def megatron_config(dtype: str) -> dict:
    """The policy.megatron_cfg keys import_model_from_hf_name reads: one process, no model parallelism."""
    return {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
            "expert_tensor_parallel_size": 1, "expert_model_parallel_size": 1,
            "num_layers_in_first_pipeline_stage": None, "num_layers_in_last_pipeline_stage": None,
            "pipeline_dtype": dtype, "sequence_parallel": False, "gradient_accumulation_fusion": False}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("model", help="Hugging Face model name or local checkpoint (policy.model_name)")
    parser.add_argument("output", help="folder for the Megatron-Bridge checkpoint (gets iter_0000000/)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"),
                        help="policy.precision of the run")
    args = parser.parse_args(argv)
    if Path(args.output, "iter_0000000").exists():
        print(f"{PROG}: {args.output}/iter_0000000 exists; pass an empty output folder", file=sys.stderr)
        return 2
    try:
        from megatron.bridge.training.model_load_save import temporary_distributed_context
        from nemo_rl.models.megatron.community_import import import_model_from_hf_name
    except ImportError as e:
        print(f"{PROG}: NeMo RL's Megatron converter is not importable here ({e}); run it in NeMo RL's environment "
              "with its Megatron extra: cd NeMo-RL && uv run --extra mcore python ...", file=sys.stderr)
        return 2
    from nemo_rz.runtime.megatron.bridge import consistent_layer_spec

    with temporary_distributed_context(backend="gloo"):
        import_model_from_hf_name(args.model, args.output, megatron_config=megatron_config(args.dtype),
                                  transformer_layer_spec=consistent_layer_spec)
    print(f"policy.pretrained_checkpoint.path={Path(args.output).resolve() / 'iter_0000000'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
