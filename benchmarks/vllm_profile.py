"""Where one decode step of the consistent vLLM backend goes, against stock vLLM (eager), part by part.

Each (variant, batch) runs in a fresh child process with vLLM's engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
so the scheduler, the model runner and the model share one thread we can time). The child wraps the functions
that make up an engine step with an exclusive-time stack timer (a nested call's time goes to its own part, not to
its caller's) and generates `--max-new-tokens` tokens for `batch` fresh prompts, `--reps` times; every engine step
that ran a forward is counted, and the prefill step is kept apart from the decode steps by its token count.

Parts (rz-vllm: nemo_rz.ops calls; stock-eager: vLLM's CPU layers):

- linears: `ops.linear` / `UnquantizedLinearMethod.apply` (q, k, v, o, gate, up, down and the LM head);
- attention: `ops.attention` / vLLM's `Attention.forward` without its cache write; kv write: `PagedKVCache.write`
  / `CPUAttentionBackendImpl.do_kv_cache_update`; rope: `ops.rope` / `RotaryEmbedding.forward`;
- norms/activations: `ops.rms_norm`, `ops.silu_and_mul` / `RMSNorm`, `SiluAndMul`; embedding;
- model glue: the rest of the model's forward and compute_logits (Python between the ops, the per-step attention
  plan and RoPE tables of `models.decoder.prepared`);
- log_softmax: `ops.log_softmax` in compute_logits / the sampler's `compute_logprobs`; sampling: the sampler's
  own work (temperature, the seeded exponential draw); logprob gather: the sampled token's logprob and its rank
  (a count over the full vocabulary);
- attention metadata: the backend's `build` (+ `PagedKVCache.__init__`) and vLLM's `_build_attention_metadata`;
- input prep: the model runner's `_update_states` / `_prepare_inputs` / `_preprocess`; runner other: the rest of
  `execute_model` / `sample_tokens`; scheduler: `Scheduler.schedule` + `update_from_output`; engine other: the
  rest of `EngineCore.step`; front end: `LLMEngine.step` outside the core (output processing).

Variant rz-vllm-tiled is rz-vllm with ops.attention's C++ forward turned off (the tiled ATen path it replaces,
same bits): `--variants rz-vllm rz-vllm-tiled` measures that change alone.

A second pass of the same number of generate calls runs with the timers removed: its wall time per step is the
uninstrumented step, the first pass shows how it splits. The parent interleaves the children (variant order
rotated per round) and prints a table of ms per decode step by part, and the ratio of uninstrumented step times.

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_TOP_PAD_=268435456 \\
        python benchmarks/vllm_profile.py --model models/smollm2-135m-instruct --batch-sizes 8 32
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PARTS = ("linears", "attention", "kv write", "rope", "norms/activations", "embedding", "model glue", "log_softmax",
         "sampling", "logprob gather", "attention metadata", "input prep", "runner other", "scheduler",
         "engine other", "front end")


class StackTimer:
    """Exclusive time per part: while a wrapped call runs, its caller's part is paused. The clock is this thread's
    CPU time (time.thread_time; the in-process engine and its one-thread kernels run on the calling thread), which
    other tenants of a loaded machine inflate far less than wall time."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.kind = "decode"  # the step being timed: "prefill" or "decode" (set by the model runner's wrapper)
        self.buckets = {"prefill": collections.Counter(), "decode": collections.Counter()}
        self.stack: list[list] = []
        self.on = True
        self.patched: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, part: str) -> None:
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)
        if original is None:  # inherited: wrap what the attribute resolves to, restore by deleting ours
            original = getattr(owner, name)
            self.patched.append((owner, name, None))
        else:
            self.patched.append((owner, name, original))
        fn = original.__func__ if isinstance(original, staticmethod) else original
        timer = self

        def timed(*args, **kwargs):
            if not timer.on:
                return fn(*args, **kwargs)
            now = time.thread_time()
            if timer.stack:
                top = timer.stack[-1]
                timer.seconds[top[0]] += now - top[1]
            timer.stack.append([part, now])
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.thread_time()
                p, start = timer.stack.pop()
                timer.seconds[p] += end - start
                timer.calls[p] += 1
                if timer.stack:
                    timer.stack[-1][1] = end
                else:  # an outermost call ended: file its parts under the kind of step it ran
                    timer.buckets[timer.kind].update(timer.seconds)
                    timer.seconds.clear()

        setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod) else timed)

    def take(self) -> dict:
        out = {k: dict(v) for k, v in self.buckets.items()}
        for v in self.buckets.values():
            v.clear()
        self.seconds.clear()
        return out


def _patch_common(timer: StackTimer) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    timer.wrap(LLMEngine, "step", "front end")
    timer.wrap(EngineCore, "step", "engine other")
    timer.wrap(Scheduler, "schedule", "scheduler")
    timer.wrap(Scheduler, "update_from_output", "scheduler")
    for name in ("execute_model", "sample_tokens", "_bookkeeping_sync"):
        timer.wrap(GPUModelRunner, name, "runner other")
    for name in ("_update_states", "_prepare_inputs", "_preprocess"):
        timer.wrap(GPUModelRunner, name, "input prep")
    timer.wrap(GPUModelRunner, "_build_attention_metadata", "attention metadata")
    timer.wrap(Sampler, "forward", "sampling")
    timer.wrap(Sampler, "gather_logprobs", "logprob gather")
    timer.wrap(Sampler, "compute_logprobs", "log_softmax")


def _patch_rz(timer: StackTimer) -> None:
    from nemo_rz import ops
    from nemo_rz.generation.vllm import attention, model

    for name, part in (("linear", "linears"), ("attention", "attention"), ("rope", "rope"), ("rms_norm", "norms/activations"),
                       ("silu_and_mul", "norms/activations"), ("embedding", "embedding"), ("log_softmax", "log_softmax")):
        timer.wrap(ops, name, part)
    timer.wrap(attention.PagedKVCache, "write", "kv write")
    timer.wrap(attention.PagedKVCache, "__init__", "attention metadata")
    timer.wrap(attention.NemoRZAttentionMetadataBuilder, "build", "attention metadata")
    timer.wrap(model.NemoRZForCausalLM, "forward", "model glue")
    timer.wrap(model.NemoRZForCausalLM, "compute_logits", "model glue")


def _patch_stock(timer: StackTimer) -> None:
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, CPUAttentionMetadataBuilder

    timer.wrap(UnquantizedLinearMethod, "apply", "linears")
    timer.wrap(UnquantizedEmbeddingMethod, "apply", "linears")  # the tied LM head
    timer.wrap(VocabParallelEmbedding, "forward", "embedding")
    timer.wrap(Attention, "forward", "attention")
    timer.wrap(CPUAttentionBackendImpl, "do_kv_cache_update", "kv write")
    timer.wrap(RotaryEmbedding, "forward", "rope")
    timer.wrap(RMSNorm, "forward", "norms/activations")
    timer.wrap(SiluAndMul, "forward", "norms/activations")
    timer.wrap(CPUAttentionMetadataBuilder, "build", "attention metadata")
    timer.wrap(LlamaForCausalLM, "forward", "model glue")
    timer.wrap(LlamaForCausalLM, "compute_logits", "model glue")


def child(args) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import torch
    import vllm_throughput as vt  # the benchmark's engines, with the same settings

    set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op when it binds threads
    set_threads(1)
    timer = StackTimer()
    _patch_common(timer)
    (_patch_rz if args.child.startswith("rz") else _patch_stock)(timer)
    steps = collections.Counter()
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner.execute_model

    def counted(self, scheduler_output, *a, **k):  # decode steps: one scheduled token per request
        n, reqs = scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens)
        if n:
            timer.kind = "decode" if n == reqs else "prefill"
            steps[timer.kind] += 1
        return original(self, scheduler_output, *a, **k)

    GPUModelRunner.execute_model = counted
    b, path = args.batch, args.model_path
    max_len = args.prompt_len + args.max_new_tokens
    if args.child == "rz-vllm-tiled":
        import importlib

        # the tiled ATen path: the C++ forward's bits at its old cost
        importlib.import_module("nemo_rz.ops.attention")._cpp_applies = lambda *a: False
    if args.child.startswith("rz"):
        from nemo_rz.generation.vllm import VLLMRolloutEngine

        engine = vt.Ours(VLLMRolloutEngine(path, max_batch_size=b, max_model_len=max_len, prefix_caching=False,
                                           kernels="consistent", multiprocess=False))
    else:
        engine = vt.Stock(path, b, max_len, compiled=False)
    set_threads(1)  # both variants' kernels on one thread, as the benchmark's worker processes run them
    g = torch.Generator().manual_seed(args.seed + b)
    vocab = args.vocab

    def run(rep):
        prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=g).tolist()
        t0, c0 = time.perf_counter(), time.process_time()
        engine.generate(prompts, args.max_new_tokens, 1000 * rep)
        return time.perf_counter() - t0, time.process_time() - c0

    timer.on = False
    run(-1)  # warm-up
    timer.on = True
    timer.take()
    steps.clear()
    wall = sum(run(r)[0] for r in range(args.reps))
    parts = timer.take()
    counts = dict(steps)
    timer.on = False
    steps.clear()
    plain = [run(args.reps + r) for r in range(args.reps)]
    print("RESULT " + json.dumps({"variant": args.child, "batch": b, "threads": torch.get_num_threads(),
                                  "instrumented_wall": wall, "plain_walls": [w for w, _ in plain],
                                  "plain_cpu": [c for _, c in plain], "parts": parts,
                                  "steps": counts, "plain_steps": dict(steps)}), flush=True)
    engine.close()


def gemm_ab(args) -> None:
    """The model's linears alone, one decode step's worth (distinct weights, so each is read from memory as in a
    real step): MKL `torch.mm` on the contiguous [K, N] operand (the consistent route's library call) vs vLLM's
    oneDNN `onednn_mm` on weights prepacked once (what stock vLLM-CPU runs), CPU time, interleaved; and, per
    shape, the row counts at which oneDNN gives a row other bits than a 512-row call (row invariance)."""
    import torch
    from vllm import _custom_ops as vops

    torch.set_num_threads(1)
    cfg = json.loads((Path(args.model_path) / "config.json").read_text())
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    layer = [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]
    shapes_ = layer * cfg["num_hidden_layers"] + [(h, cfg["vocab_size"])]
    g = torch.Generator().manual_seed(0)
    mkl, dnn = [], []
    for k, n in shapes_:
        w = torch.randn(n, k, generator=g) / k ** 0.5
        mkl.append(w.t().contiguous())
        dnn.append(vops.create_onednn_mm(w.t(), 32))
    print(f"{len(shapes_)} linears, {sum(k * n for k, n in shapes_) * 4 / 1e6:.0f} MB of float32 weights")
    for k, n in dict.fromkeys(shapes_):
        w = torch.randn(n, k, generator=g) / k ** 0.5
        handle = vops.create_onednn_mm(w.t(), 32)
        x = torch.randn(512, k, generator=g)
        ref = vops.onednn_mm(handle, x, None)
        bad = [m for m in (*range(1, 65), 96, 128, 200, 256, 384, 511)
               if not torch.equal(vops.onednn_mm(handle, x[:m].clone(), None), ref[:m])]
        print(f"oneDNN K={k} N={n}: row counts giving other bits than one 512-row call: {bad or 'none'}")
    for m in args.batch_sizes:
        xs = {k: torch.randn(m, k, generator=g) for k, _ in shapes_}
        times = {"mkl": [], "onednn": []}
        for rep in range(args.reps * 3):
            for name in (("mkl", "onednn") if rep % 2 == 0 else ("onednn", "mkl")):
                c0 = time.thread_time()
                if name == "mkl":
                    for (k, _), w_t in zip(shapes_, mkl):
                        torch.mm(xs[k], w_t)
                else:
                    for (k, _), handle in zip(shapes_, dnn):
                        vops.onednn_mm(handle, xs[k], None)
                times[name].append(1e3 * (time.thread_time() - c0))
        a, b = statistics.median(times["mkl"]), statistics.median(times["onednn"])
        print(f"M={m}: one step's linears, CPU ms (median of {len(times['mkl'])}): MKL {a:.1f}, oneDNN prepacked {b:.1f} "
              f"(oneDNN/MKL time {b / a:.2f})")


def main() -> None:
    import shapes

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--variants", nargs="+", default=["rz-vllm", "stock-eager"], choices=["rz-vllm", "rz-vllm-tiled", "stock-eager"])
    ap.add_argument("--reps", type=int, default=2, help="generate calls per pass (two passes: timed parts, plain)")
    ap.add_argument("--rounds", type=int, default=1, help="child processes per (variant, batch), interleaved")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--gemm-ab", action="store_true", help="time the model's linears alone: MKL vs oneDNN prepacked")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    shapes.add_arguments(ap)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.gemm_ab:
        args.model_path = args.model or sys.exit("vllm_profile: --gemm-ab needs --model (a checkpoint directory)")
        return gemm_ab(args)

    with tempfile.TemporaryDirectory() as d:
        path = shapes.checkpoint(args, d, args.seed)
        vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
        results = []
        for rnd in range(args.rounds):
            for b in args.batch_sizes:
                order = args.variants[rnd % len(args.variants):] + args.variants[: rnd % len(args.variants)]
                for v in order:
                    cmd = [sys.executable, __file__, "--child", v, "--batch", str(b), "--model-path", str(path),
                           "--vocab", str(vocab), "--reps", str(args.reps), "--prompt-len", str(args.prompt_len),
                           "--max-new-tokens", str(args.max_new_tokens), "--seed", str(args.seed)]
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                    if out.returncode or not lines:
                        sys.exit(f"vllm_profile: child {v} batch {b} failed (rc {out.returncode}):\n{out.stderr[-3000:]}")
                    r = json.loads(lines[-1][len("RESULT "):])
                    results.append(r)
                    x = per_step(r)
                    print(f"round {rnd} batch {b} {v}: {x['plain cpu']:.1f} CPU ms / {x['plain wall']:.1f} wall ms per step "
                          f"plain, {r['threads']} threads", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, args)


def per_step(r: dict) -> dict:
    """ms per decode step by part (decode steps only), the instrumented parts' sum, and the plain (uninstrumented)
    wall time per generated token-step: generate's whole wall time, prefill included, over its decode steps + 1."""
    decode = r["parts"]["decode"]
    n = max(r["steps"].get("decode", 0), 1)
    out = {p: 1e3 * decode.get(p, 0.0) / n for p in PARTS}
    out["total"] = sum(out[p] for p in PARTS)
    out["prefill step"] = 1e3 * sum(r["parts"]["prefill"].values()) / max(r["steps"].get("prefill", 0), 1)
    steps = max(r["plain_steps"].get("decode", 0) + r["plain_steps"].get("prefill", 0), 1)
    out["plain wall"] = 1e3 * sum(r["plain_walls"]) / steps
    out["plain cpu"] = 1e3 * sum(r["plain_cpu"]) / steps
    return out


def report(results: list[dict], args) -> None:
    print(f"\nms per decode step by part (prompt {args.prompt_len}, {args.max_new_tokens} new tokens, medians over "
          "rounds), in CPU ms of the engine's thread; total: their sum; prefill step: one prefill step, all parts; "
          "plain cpu / wall: uninstrumented generate calls' process CPU / wall time per engine step\n")
    by = collections.defaultdict(list)
    for r in results:
        by[(r["batch"], r["variant"])].append(per_step(r))
    cols = [(b, v) for b in args.batch_sizes for v in args.variants]
    print("| part | " + " | ".join(f"{v} b{b}" for b, v in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for p in (*PARTS, "total", "prefill step", "plain cpu", "plain wall"):
        print(f"| {p} | " + " | ".join(f"{statistics.median(x[p] for x in by[c]):.2f}" for c in cols) + " |")
    for other in ("stock-eager", "rz-vllm-tiled"):
        if {"rz-vllm", other} <= set(args.variants):
            for b in args.batch_sizes:
                for clock in ("attention", "plain cpu", "plain wall"):
                    ratio = statistics.median(x[clock] for x in by[(b, other)]) / statistics.median(
                        x[clock] for x in by[(b, "rz-vllm")])
                    print(f"batch {b}: rz-vllm speed / {other} ({clock} per step) = {ratio:.2f}x")


if __name__ == "__main__":
    main()
