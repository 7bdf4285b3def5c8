"""Check that a vLLM install runs nemo-rz's model with the kit's settings and records the learner's logprobs.

Run it with the Python of NeMo RL's vLLM workers, before a long job (NeMo RL pins its own vLLM version):

    NeMo-RL/venvs/nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker/bin/python \
        /path/to/nemo-rz/examples/nemo_rl/check_vllm.py CHECKPOINT [--dtype float32] [--logprobs-mode raw_logits]

It builds `vllm.LLM` as NeMo RL's VllmGenerationWorker does (NeMo RL's own arguments, then the override's
`vllm_kwargs`, then `vllm_cfg.logprobs_mode`), samples as NeMo RL does (temperature 1, full vocabulary,
`logprobs=0`), and compares every recorded logprob with nemo-rz's learner on the same tokens (`load_hf`,
consistent kernels). One line out: tokens compared, how many differ, the largest difference. Exit 0 when none
differ, 1 when some do, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROG = "check_vllm"


def llm_arguments(checkpoint: str, generation: dict, dtype: str, max_model_len: int) -> dict:
    """vllm.LLM arguments as NeMo RL's VllmGenerationWorker._load_model builds them (nemo_rl/models/generation/
    vllm/vllm_worker.py, main of 2026-08-22): its fixed ones, then vllm_kwargs, then vllm_cfg.logprobs_mode. The
    GPU-only ones (sleep mode, gpu_memory_utilization) are left out; the KV cache gets a fixed size instead."""
    cfg = generation["vllm_cfg"]
    kwargs = dict(model=checkpoint, served_model_name=checkpoint, load_format="auto", skip_tokenizer_init=True,
                  tensor_parallel_size=cfg["tensor_parallel_size"],
                  pipeline_parallel_size=cfg["pipeline_parallel_size"],
                  enable_expert_parallel=cfg["expert_parallel_size"] > 1, enable_prefix_caching=True, dtype=dtype,
                  seed=0, enforce_eager=cfg["enforce_eager"], max_model_len=max_model_len, trust_remote_code=False,
                  disable_log_stats=False, kv_cache_memory_bytes=256 << 20, **generation["vllm_kwargs"])
    if cfg.get("logprobs_mode") is not None:
        kwargs["logprobs_mode"] = cfg["logprobs_mode"]
    return kwargs


def compare(learner_lps: list, recorded_lps: list) -> tuple[int, int, float]:
    """(tokens compared, tokens whose float32 logprobs differ bitwise, largest absolute difference)."""
    import torch

    a, b = torch.cat(learner_lps), torch.cat(recorded_lps)
    return a.numel(), int((a != b).sum()), float((a - b).abs().max()) if a.numel() else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="Hugging Face checkpoint directory (Qwen3, Qwen2 or Llama family)")
    parser.add_argument("--rz-config", default=str(HERE / "reinforce_zero.yaml"))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--logprobs-mode", help="override vllm_cfg.logprobs_mode (NeMo RL v0.6 / v0.7 pass "
                                                "processed_logprobs whatever the config says)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # one process: quicker, nothing to clean up

    import torch
    import yaml

    from nemo_rz import ops
    from nemo_rz.models.hf import load_hf
    from nemo_rz.models.hf_config import ARCHITECTURES, CONFIG_FILE

    config_file = Path(args.checkpoint) / CONFIG_FILE
    if not config_file.is_file():
        print(f"{PROG}: {args.checkpoint} has no {CONFIG_FILE}; pass a Hugging Face checkpoint directory",
              file=sys.stderr)
        return 2
    hf = json.loads(config_file.read_text())
    family = next((a for a in hf.get("architectures") or [] if a in ARCHITECTURES), None)
    if family is None:
        print(f"{PROG}: {config_file} names {hf.get('architectures')}; nemo-rz's vLLM model builds "
              f"{', '.join(ARCHITECTURES)}", file=sys.stderr)
        return 2
    generation = yaml.safe_load(Path(args.rz_config).read_text())["policy"]["generation"]
    generation["vllm_kwargs"]["hf_overrides"]["nemo_rz_architecture"] = family
    if args.logprobs_mode:
        generation["vllm_cfg"]["logprobs_mode"] = args.logprobs_mode
    max_len = min(int(hf.get("max_position_embeddings", 512)), 512)

    import vllm

    from nemo_rz.generation.vllm.plugin import register

    register()  # the entry point does this in vLLM's own processes
    llm = vllm.LLM(**llm_arguments(args.checkpoint, generation, args.dtype, max_len))
    g = torch.Generator().manual_seed(0)
    vocab = int(hf["vocab_size"])
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(1, max_len - args.max_tokens, (args.prompts,), generator=g)]
    # as NeMo RL's worker samples: temperature, top_p, top_k from the config, the sampled token's logprob only
    params = vllm.SamplingParams(temperature=generation["temperature"], top_p=generation["top_p"],
                                 top_k=generation["top_k"] or -1, max_tokens=args.max_tokens, logprobs=0,
                                 ignore_eos=True, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    learner = load_hf(args.checkpoint, dtype=args.dtype)
    learned, recorded = [], []
    with ops.use_kernels(generation["vllm_kwargs"]["hf_overrides"]["nemo_rz_kernels"]), torch.no_grad():
        for prompt, out in zip(prompts, outs):
            tokens = list(out.outputs[0].token_ids)
            recorded.append(torch.tensor([d[t].logprob for t, d in zip(tokens, out.outputs[0].logprobs)]))
            learned.append(learner.token_logprobs(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:])
    total, differ, worst = compare(learned, recorded)
    mode = generation["vllm_cfg"].get("logprobs_mode")
    print(f"vLLM {vllm.__version__}, logprobs_mode={mode}, {args.dtype}: {differ} of {total} tokens differ from "
          f"nemo-rz's learner (largest difference {worst:.3g})")
    return 0 if differ == 0 and total else 1


if __name__ == "__main__":
    sys.exit(main())
