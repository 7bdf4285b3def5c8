"""Batch-invariant Triton kernels vs the library kernels: correctness, invariance and speed.

On a GPU:      python benchmarks/gpu_kernels.py [--dtype bf16] [--kernels linear,attention_decode]
On CPU (smoke): python benchmarks/gpu_kernels.py --interpret --small   (TRITON_INTERPRET=1, fp32, < 60 s)
Without a GPU:  python benchmarks/gpu_kernels.py --compile-only [--arch 90 80]   (builds each kernel's cubin)

For every kernel it checks the error against a float64 (fp32 kernels) or float32 (16-bit kernels)
reference, checks bitwise batch invariance (rows computed alone or in other batches give the same bits;
attention decode and chunked prefill give prefill's bits), then times the Triton kernel and the library
baseline (cuBLAS via F.linear, F.rms_norm, silu*mul, torch log_softmax, SDPA) as the median of many runs
with CUDA events and a flushed L2, and prints achieved bandwidth and FLOP rate as a fraction of the
device's peaks (table below, or --peak-tbs / --peak-tflops). Timings are not asserted anywhere: record
them in benchmarks/RESULTS.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# name substring -> (HBM TB/s, dense bf16/fp16 tensor TFLOP/s, fp32 non-tensor TFLOP/s); first match wins
PEAKS = [
    ("H100 PCIe", (2.0, 756.0, 51.0)),
    ("H100 NVL", (3.9, 835.0, 60.0)),
    ("H200", (4.8, 989.0, 67.0)),
    ("H100", (3.35, 989.0, 67.0)),
    ("GH200", (4.0, 989.0, 67.0)),
    ("A100-SXM4-80GB", (2.04, 312.0, 19.5)),
    ("A100", (1.56, 312.0, 19.5)),
    ("L40S", (0.864, 362.0, 91.6)),
    ("L4", (0.3, 121.0, 30.3)),
    ("A10", (0.6, 125.0, 31.2)),
]


def import_kernels():
    """``nemo_rz.kernels``, from the installed package or, when nemo-rz is not installed, this checkout."""
    try:
        return importlib.import_module("nemo_rz.kernels")
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        return importlib.import_module("nemo_rz.kernels")


# ------------------------------------------------------------------------------------------------ timing
class Timer:
    def __init__(self, device, iters, warmup):
        self.device, self.iters, self.warmup = device, iters, warmup
        self.flush = None
        if device.type == "cuda":
            import torch

            self.flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)

    def __call__(self, fn) -> float:
        """Median milliseconds of fn()."""
        import torch

        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(self.iters):
                self.flush.zero_()  # evict the inputs from L2 so memory-bound kernels read HBM
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.iters):
                t = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)


@dataclass
class Row:
    kernel: str
    shape: str
    err: float
    tol: float
    invariant: bool
    ms: float
    base_ms: float
    bytes: float
    flops: float


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    fin = ref.isfinite()
    if not fin.any():
        return 0.0
    if not bool((out.isfinite() == fin).all()):
        return math.inf
    return ((out - ref)[fin].abs().max() / ref[fin].abs().max().clamp_min(1e-30)).item()


# ------------------------------------------------------------------------------------------------ cases
def run(args):
    import torch
    import torch.nn.functional as F

    K = import_kernels()
    interp = args.interpret
    dev = torch.device("cpu" if interp else "cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ref_dtype = torch.float64 if dtype == torch.float32 else torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    timer = Timer(dev, args.iters, args.warmup)
    gen = torch.Generator(device="cpu").manual_seed(0)
    small = args.small
    rows: list[Row] = []
    wanted = set(args.kernels.split(",")) if args.kernels else None

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device=dev, dtype=dtype)

    def want(name):
        return wanted is None or name in wanted

    def equal_rows(fn, x, picks):
        full = fn(x)
        return all(torch.equal(fn(x[p]), full[p]) for p in picks)

    def picks_for(M):
        return [slice(0, 1), slice(M - 1, M), slice(0, max(1, M // 3)), torch.randperm(M, generator=gen)[: max(1, M // 2)].to(dev)]

    elt = torch.tensor([], dtype=dtype).element_size()

    # linear ---------------------------------------------------------------------------------
    if want("linear"):
        shapes = [(1, 256, 256), (33, 256, 256)] if small else [
            (1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (4096, 4096, 4096), (4096, 14336, 4096), (4096, 4096, 14336)]
        NK = sorted({(n, k) for _, n, k in shapes})
        for n, k in NK:
            m_max = max(m for m, n2, k2 in shapes if (n2, k2) == (n, k))
            x, w, b = randn(m_max, k), randn(n, k, scale=k ** -0.5), randn(n)
            inv = equal_rows(lambda a: K.linear(a, w, b), x, picks_for(m_max))
            for m, n2, k2 in shapes:
                if (n2, k2) != (n, k):
                    continue
                xm = x[:m]
                y = K.linear(xm, w, b)
                err = rel_err(y, F.linear(xm.to(ref_dtype), w.to(ref_dtype), b.to(ref_dtype)))
                ms = timer(lambda: K.linear(xm, w, b))
                base = timer(lambda: F.linear(xm, w, b))
                rows.append(Row("linear", f"M={m} N={n} K={k}", err, tol, inv, ms, base,
                                (m * k + n * k + m * n + n) * elt, 2.0 * m * n * k))

    # rms_norm -------------------------------------------------------------------------------
    if want("rms_norm"):
        for m, h in ([(1, 1024), (17, 1024)] if small else [(1, 4096), (128, 4096), (16384, 4096), (4096, 8192)]):
            x, w = randn(m, h), randn(h)
            ref = x.to(ref_dtype) * torch.rsqrt(x.to(ref_dtype).pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(ref_dtype)
            err = rel_err(K.rms_norm(x, w, 1e-6), ref)
            inv = equal_rows(lambda a: K.rms_norm(a, w, 1e-6), x, picks_for(m))
            ms = timer(lambda: K.rms_norm(x, w, 1e-6))
            base = timer(lambda: F.rms_norm(x, (h,), w, 1e-6))
            rows.append(Row("rms_norm", f"M={m} H={h}", err, tol, inv, ms, base, (2 * m * h + h) * elt, 4.0 * m * h))

    # silu_and_mul ---------------------------------------------------------------------------
    if want("silu_and_mul"):
        for m, f in ([(1, 1024), (17, 1024)] if small else [(1, 14336), (128, 14336), (8192, 14336)]):
            g, u = randn(m, f, scale=3.0), randn(m, f)
            gd = g.to(ref_dtype)
            err = rel_err(K.silu_and_mul(g, u), gd / (1 + torch.exp(-gd)) * u.to(ref_dtype))
            full = K.silu_and_mul(g, u)
            inv = all(torch.equal(K.silu_and_mul(g[p], u[p]), full[p]) for p in picks_for(m))
            ms = timer(lambda: K.silu_and_mul(g, u))
            base = timer(lambda: F.silu(g) * u)
            rows.append(Row("silu_and_mul", f"M={m} F={f}", err, tol, inv, ms, base, 3 * m * f * elt, 5.0 * m * f))

    # logprobs -------------------------------------------------------------------------------
    if want("token_logprobs") or want("log_softmax"):
        T = 0.7
        for m, v in ([(1, 5000), (9, 5000)] if small else [(1, 151936), (256, 151936), (4096, 151936)]):
            logits = randn(m, v, scale=3.0)
            tg = torch.randint(0, v, (m,), generator=gen).to(dev)
            ref = torch.log_softmax(logits.to(torch.float64 if interp else torch.float32) / T, -1)
            if want("token_logprobs"):
                lp = K.token_logprobs(logits, tg, T)
                err = rel_err(lp, ref.gather(1, tg[:, None])[:, 0])
                full = lp
                inv = all(torch.equal(K.token_logprobs(logits[p], tg[p], T), full[p]) for p in picks_for(m))
                inv = inv and torch.equal(lp, K.log_softmax(logits, T).gather(1, tg[:, None])[:, 0])
                ms = timer(lambda: K.token_logprobs(logits, tg, T))
                base = timer(lambda: torch.log_softmax(logits.float() / T, -1).gather(1, tg[:, None]))
                rows.append(Row("token_logprobs", f"M={m} V={v}", err, 1e-5, inv, ms, base, m * v * elt, 4.0 * m * v))
            if want("log_softmax"):
                err = rel_err(K.log_softmax(logits, T), ref)
                inv = equal_rows(lambda a: K.log_softmax(a, T), logits, picks_for(m)[:2])
                ms = timer(lambda: K.log_softmax(logits, T))
                base = timer(lambda: torch.log_softmax(logits.float() / T, -1))
                rows.append(Row("log_softmax", f"M={m} V={v}", err, 1e-5, inv, ms, base, m * v * (elt + 4), 5.0 * m * v))

    # attention ------------------------------------------------------------------------------
    if want("attention_decode") or want("attention_prefill"):
        H, Hkv, D = (4, 2, 32) if small else (32, 8, 128)
        scale = D ** -0.5

        def sdpa(q4, k4, v4, causal):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, scale=scale, enable_gqa=True)

        def sdpa_ref(q, k_seq, v_seq, pos):
            """fp64/fp32 reference for queries q [n, H, D] at positions pos of one sequence."""
            kk = k_seq.to(ref_dtype).repeat_interleave(H // Hkv, 0)
            vv = v_seq.to(ref_dtype).repeat_interleave(H // Hkv, 0)
            s = torch.einsum("nhd,hld->hnl", q.to(ref_dtype), kk) * scale
            s = s.masked_fill(torch.arange(kk.shape[1], device=dev)[None, None, :] > pos[None, :, None], float("-inf"))
            return torch.einsum("hnl,hld->nhd", torch.softmax(s, -1), vv)

        if want("attention_prefill"):
            for n in ([96] if small else [1024, 4096]):
                k_cache, v_cache = randn(1, Hkv, n, D), randn(1, Hkv, n, D)
                q = randn(n, H, D)
                seq = torch.zeros(n, dtype=torch.int64, device=dev)
                pos = torch.arange(n, device=dev)
                out = K.attention(q, k_cache, v_cache, seq, pos, scale)
                sel = torch.arange(0, n, max(1, n // 64), device=dev)
                err = rel_err(out[sel], sdpa_ref(q[sel], k_cache[0], v_cache[0], pos[sel]))
                c = 32 if small else 512
                chunked = torch.cat([K.attention(q[a:a + c], k_cache, v_cache, seq[a:a + c], pos[a:a + c], scale)
                                     for a in range(0, n, c)])
                inv = torch.equal(chunked, out)
                ms = timer(lambda: K.attention(q, k_cache, v_cache, seq, pos, scale))
                q4 = q.transpose(0, 1)[None]
                base = timer(lambda: sdpa(q4, k_cache, v_cache, True))
                rows.append(Row("attention_prefill", f"N={n} H={H}/{Hkv} D={D}", err, tol, inv, ms, base,
                                (2 * n * H * D + 2 * n * Hkv * D) * elt, 4.0 * H * D * n * (n + 1) / 2))

        if want("attention_decode"):
            for B, L in ([(3, 96)] if small else [(1, 4096), (32, 4096), (128, 2048)]):
                k_cache, v_cache = randn(B, Hkv, L, D), randn(B, Hkv, L, D)
                q = randn(B, H, D)
                seq = torch.arange(B, device=dev)
                pos = torch.full((B,), L - 1, device=dev)
                out = K.attention(q, k_cache, v_cache, seq, pos, scale)
                err = max(rel_err(out[b:b + 1], sdpa_ref(q[b:b + 1], k_cache[b], v_cache[b], pos[b:b + 1]))
                          for b in range(min(B, 4)))
                # decode row == the same token's row in a prefill of its whole sequence
                qp = randn(L, H, D)
                qp[L - 1] = q[0]
                pre = K.attention(qp, k_cache, v_cache, torch.zeros(L, dtype=torch.int64, device=dev),
                                  torch.arange(L, device=dev), scale)
                inv = torch.equal(pre[L - 1], out[0]) and torch.equal(
                    K.attention(q[:1], k_cache, v_cache, seq[:1], pos[:1], scale), out[:1])
                ms = timer(lambda: K.attention(q, k_cache, v_cache, seq, pos, scale))
                q4 = q[:, :, None, :]
                base = timer(lambda: sdpa(q4, k_cache, v_cache, False))
                rows.append(Row("attention_decode", f"B={B} L={L} H={H}/{Hkv} D={D}", err, tol, inv, ms, base,
                                (2 * B * Hkv * L * D + 2 * B * H * D) * elt, 4.0 * B * H * L * D))
    return rows


# ------------------------------------------------------------------------------------------------ report
def peaks(args):
    bw, tf16, tf32 = None, None, None
    if not args.interpret:
        import torch

        name = torch.cuda.get_device_name()
        for key, (b, t16, t32) in PEAKS:
            if key in name:
                bw, tf16, tf32 = b, t16, t32
                break
    tflops = tf32 if args.dtype == "fp32" else tf16
    return (args.peak_tbs or bw), (args.peak_tflops or tflops)


def report(rows, args):
    bw, tf = peaks(args)
    hdr = (f"{'kernel':<18} {'shape':<28} {'rel_err':>9} {'ok':>3} {'inv':>4} {'triton ms':>10} "
           f"{'base ms':>9} {'x base':>7} {'TB/s':>7} {'%BW':>6} {'TFLOP/s':>8} {'%FLOP':>6}")
    print(hdr)
    print("-" * len(hdr))
    bad = 0
    for r in rows:
        tbs = r.bytes / (r.ms * 1e-3) / 1e12
        tfs = r.flops / (r.ms * 1e-3) / 1e12
        ok = r.err <= r.tol
        bad += (not ok) + (not r.invariant)
        pbw = f"{100 * tbs / bw:5.1f}%" if bw else "   n/a"
        ptf = f"{100 * tfs / tf:5.1f}%" if tf else "   n/a"
        print(f"{r.kernel:<18} {r.shape:<28} {r.err:9.2e} {'yes' if ok else 'NO':>3} {'yes' if r.invariant else 'NO':>4} "
              f"{r.ms:10.4f} {r.base_ms:9.4f} {r.ms / r.base_ms:7.2f} {tbs:7.3f} {pbw:>6} {tfs:8.2f} {ptf:>6}")
    print("-" * len(hdr))
    peak_src = "override" if (args.peak_tbs or args.peak_tflops) else "table"
    print(f"peaks ({peak_src}): {bw or 'n/a'} TB/s, {tf or 'n/a'} TFLOP/s {args.dtype};  'x base' = triton time / "
          "baseline time;  ok = rel_err <= tolerance;  inv = bitwise batch/decode invariance")
    return bad


# ------------------------------------------------------------------------------------------------ compile only
def compile_only(archs):
    """Build every kernel to a cubin for the given SM versions (no GPU needed; uses Triton's ptxas)."""
    os.environ["TRITON_INTERPRET"] = "0"
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import_kernels()
    mod = {m: importlib.import_module(f"nemo_rz.kernels.{m}")
           for m in ("matmul", "rmsnorm", "activation", "logprobs", "causal_attention", "moe")}

    def sig(spec, **const):
        return {k: ("constexpr" if k in const else v) for k, v in spec.items()}, const

    n_ok = 0
    for arch in archs:
        for dt in ("fp32", "bf16", "fp16"):
            tdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dt]
            cfg = mod["matmul"].tile_config(tdt, 4096, 4096)
            p = f"*{dt}"
            jobs = [
                (mod["matmul"]._linear_kernel, *sig(
                    dict(x_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, M="i32", N="i32", K="i32", stride_xm="i32", stride_wn="i32",
                         stride_ym="i32", HAS_BIAS="", IEEE="", BLOCK_M="", BLOCK_N="", BLOCK_K="", GROUP_M="",
                         num_programs="i32"),
                    HAS_BIAS=True, IEEE=dt == "fp32", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                    GROUP_M=cfg.group_m), dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)),
                (mod["rmsnorm"]._rms_norm_kernel, *sig(
                    dict(x_ptr=p, w_ptr=p, y_ptr=p, H="i32", stride_x="i32", eps="fp32", BLOCK_H=""), BLOCK_H=4096),
                 dict(num_warps=8)),
                (mod["activation"]._silu_and_mul_kernel, *sig(
                    dict(g_ptr=p, u_ptr=p, y_ptr=p, F="i32", stride_g="i32", stride_u="i32", BLOCK_F=""), BLOCK_F=2048), dict(num_warps=4)),
                (mod["logprobs"]._token_logprobs_kernel, *sig(
                    dict(logits_ptr=p, targets_ptr="*i64", out_ptr="*fp32", V="i32", stride_l="i32", temperature="fp32",
                         BLOCK_V=""),
                    BLOCK_V=4096), dict(num_warps=8)),
                (mod["logprobs"]._log_softmax_kernel, *sig(
                    dict(logits_ptr=p, out_ptr="*fp32", V="i32", stride_l="i32", temperature="fp32", BLOCK_V=""), BLOCK_V=4096),
                 dict(num_warps=8)),
            ]
            ecfg = mod["moe"].expert_config(tdt, 2048, 1024)
            jobs.append((mod["moe"]._expert_linear_kernel, *sig(
                dict(x_ptr=p, w_ptr=p, b_ptr=p, y_ptr=p, order_ptr="*i64", tile_expert_ptr="*i64", tile_start_ptr="*i64",
                     group_end_ptr="*i64", N="i32", K="i32", E="i32", stride_xm="i32", stride_we="i32", stride_wk="i32",
                     stride_be="i32", stride_ym="i32", HAS_BIAS="", IEEE="", BLOCK_M="", BLOCK_N="", BLOCK_K=""),
                HAS_BIAS=True, IEEE=dt == "fp32", BLOCK_M=ecfg.block_m, BLOCK_N=ecfg.block_n, BLOCK_K=ecfg.block_k),
                dict(num_warps=ecfg.num_warps, num_stages=ecfg.num_stages)))
            for paged in (False, True):
                jobs.append((mod["causal_attention"]._attention_kernel, *sig(
                    dict(q_ptr=p, k_ptr=p, v_ptr=p, o_ptr=p, seq_ptr="*i64", pos_ptr="*i64", start_ptr="*i64",
                         bt_ptr="*i32", sink_ptr=p, scale="fp32", stride_qt="i32", stride_qh="i32", bt_stride="i32",
                         cache_stride0="i32", cache_stride1="i32", H="", D="", GROUP="", HAS_WINDOW="", PAGED="",
                         PAGE_SIZE="", HAS_SINKS="", G_PAD="", BLOCK_D="", KV_BLOCK="", IEEE=""),
                    H=32, D=128, GROUP=4, HAS_WINDOW=paged, PAGED=paged, PAGE_SIZE=16, HAS_SINKS=paged, G_PAD=16, BLOCK_D=128,
                    KV_BLOCK=mod["causal_attention"].KV_BLOCK, IEEE=dt == "fp32"), dict(num_warps=4, num_stages=2)))
            for fn, signature, const, opts in jobs:
                t = time.perf_counter()
                k = triton.compile(ASTSource(fn, signature, const), target=GPUTarget("cuda", arch, 32), options=opts)
                assert k.asm.get("cubin"), fn
                n_ok += 1
                print(f"sm_{arch} {dt:<4} {fn.__name__:<24} cubin {len(k.asm['cubin']):>7} B  {time.perf_counter() - t:5.2f} s")
    print(f"compiled {n_ok} kernels")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interpret", action="store_true", help="run on CPU under TRITON_INTERPRET=1 (smoke test)")
    ap.add_argument("--small", action="store_true", help="small shapes (use with --interpret)")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                    help="default: bf16 on GPU, fp32 under --interpret")
    ap.add_argument("--kernels", default="", help="comma list: linear,rms_norm,silu_and_mul,token_logprobs,"
                    "log_softmax,attention_decode,attention_prefill (default all)")
    ap.add_argument("--iters", type=int, default=None, help="timed runs (default 50 GPU, 1 interpret)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed runs first (default 5 GPU, 0 interpret)")
    ap.add_argument("--peak-tbs", type=float, default=None, help="override peak memory bandwidth, TB/s")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override peak TFLOP/s for --dtype")
    ap.add_argument("--compile-only", action="store_true", help="only build cubins (no GPU needed)")
    ap.add_argument("--arch", type=int, nargs="+", default=[90], help="SM versions for --compile-only")
    args = ap.parse_args(argv)

    if args.compile_only:
        compile_only(args.arch)
        return 0
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    args.dtype = args.dtype or ("fp32" if args.interpret else "bf16")
    args.iters = args.iters or (1 if args.interpret else 50)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.interpret else 5)
    if args.interpret and args.dtype != "fp32":
        print("--interpret runs fp32 only (numpy has no bf16 matmul)", file=sys.stderr)
        return 2
    if not args.interpret:
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device: use --interpret --small for a CPU smoke test, or --compile-only", file=sys.stderr)
            return 2
    t0 = time.perf_counter()
    rows = run(args)
    bad = report(rows, args)
    print(f"{len(rows)} cases, {bad} failed checks, {time.perf_counter() - t0:.1f} s"
          + (" (interpreter: timings are not meaningful)" if args.interpret else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
