import atexit
import os
import shutil
import site
import subprocess
import tempfile
import venv
from pathlib import Path

import pytest
import torch

from nemo_rz import ops
from nemo_rz.generation.packing import pack
from nemo_rz.models import Decoder, DecoderConfig
from nemo_rz.models.moe import recorded_routing

# Probe results (ops/probe_cache.py) of this session only, never the user's cache (child processes inherit it).
os.environ["NEMO_RZ_CACHE_DIR"] = tempfile.mkdtemp(prefix="nemo-rz-test-probes-")
atexit.register(shutil.rmtree, os.environ["NEMO_RZ_CACHE_DIR"], True)


def tiny_model(seed: int = 0, **overrides) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=48, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    cfg.update(overrides)
    model = Decoder(DecoderConfig(**cfg))
    # Larger-than-init weights give peaky, varied distributions, so differences are not hidden by tiny logits.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def count_diff(model, completions, temperature: float = 1.0) -> tuple[int, int]:
    """(generated tokens whose rollout and learner logprobs differ bitwise, tokens compared), the learner
    seeing all completions padded into one [B, T] batch as in training."""
    batch = pack(completions)
    with torch.no_grad():
        lp = model.token_logprobs(batch.input_ids, batch.lengths, temperature)
    valid = batch.mask.bool()
    return int((lp[valid] != batch.rollout_logprobs[valid]).sum()), int(valid.sum())


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    """transformers' own float32 logits of a checkpoint directory (eager attention): the parity reference."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_saved_reloads(model: Decoder, saved, ids: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    """A checkpoint nemo-rz saved at `saved`: transformers' logits on it stay within tol of `expected`, and it loads
    back as the same model (config and every tensor)."""
    from nemo_rz.models import load_hf

    assert (hf_logits(saved, ids) - expected).abs().max().item() < tol
    again = load_hf(saved)
    assert again.config == model.config
    mine, theirs = model.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def logit_diff(model: Decoder, ids: torch.Tensor, expected: torch.Tensor, mode: str = "consistent") -> float:
    """The largest |logit - expected| of nemo-rz's model on ids, in kernel mode `mode`."""
    with ops.use_kernels(mode), torch.no_grad():
        return (model(ids) - expected).abs().max().item()


def learner_routing(model, ids) -> dict:
    """{(MoE layer, sequence, position): experts} of the learner's forward over the batch ids [B, T]."""
    b, t = ids.shape
    with recorded_routing(model) as logs, torch.no_grad():
        model.token_logprobs(ids)
    return {(name, s, p): e for name, (experts,) in logs.items()
            for (s, p), e in zip(((s, p) for s in range(b) for p in range(t)), experts.tolist())}


def rollout_routing(model, ids, chunks) -> dict:
    """The same for the engine's forwards: every sequence advances by chunks[(sequence + step) % len] tokens per
    step, so steps mix prefill chunks and single tokens of different sequences, against a KV cache."""
    b, t = ids.shape
    cache, done, out, step = model.new_cache(b, t), [0] * b, {}, 0
    with recorded_routing(model) as logs, torch.no_grad():
        while min(done) < t:
            rows = []
            for s in range(b):
                end = min(t, done[s] + chunks[(s + step) % len(chunks)])
                rows += [(s, p) for p in range(done[s], end)]
                done[s] = end
            seq, pos = torch.tensor(rows).T
            model.step(ids[seq, pos], pos, seq, cache)
            for name, log in logs.items():
                out.update({(name, s, p): e for (s, p), e in zip(rows, log[-1].tolist())})
            step += 1
    return out


def preset_run(preset: str, run: Path, *overrides: str) -> tuple[str, list[dict]]:
    """A 3-update smoke run of `python -m nemo_rz.train --config preset` in `run` (10 warm-up steps, 4 x 4 samples,
    the kernel/routing decomposition at every update): its saved config.yaml text and metrics rows."""
    import json
    import sys

    cmd = [sys.executable, "-m", "nemo_rz.train", "--config", preset, f"run_dir={run}", "algo.updates=3",
           "warmup.steps=10", "algo.prompts_per_update=4", "algo.group_size=4", "eval.n=8", "eval.every=3",
           "progress=false", "metrics.tensorboard=false", "metrics.decomposition_every=1", "checkpoint.every=3",
           *overrides]
    proc = subprocess.run(cmd, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return (run / "config.yaml").read_text(), rows


@pytest.fixture(autouse=True)
def _consistent_mode():
    with ops.use_kernels("consistent"):
        yield


@pytest.fixture(scope="session")
def model():
    return tiny_model()


def venv_over_this(path: Path, with_checkout: bool) -> Path:
    """A new virtual environment at `path` that also sees this interpreter's packages (torch...), whether this one
    is a virtual environment itself or not; its python. With `with_checkout`, this checkout's editable install is
    seen too (the .pth files of those folders are read); without, only what is installed into the new one."""
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    dirs = site.getsitepackages()
    lines = [f"import site; site.addsitedir({d!r})" for d in dirs] if with_checkout else dirs
    Path(purelib, "_outer_packages.pth").write_text("\n".join(lines) + "\n")
    return python


@pytest.fixture(scope="session")
def logged_run(tmp_path_factory):
    """A 2-update in-process run of the tiny model on a GSM8K-shaped parquet file (task.name=hf_dataset), logging to
    metrics.jsonl, TensorBoard, W&B (offline) and MLflow (a file store), exporting at the end: (run dir, metrics rows).
    Shared by test_hf_dataset.py and test_loggers.py."""
    import json

    datasets = pytest.importorskip("datasets")
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    from nemo_rz import train

    root = tmp_path_factory.mktemp("logged_run")
    rows = [dict(question=f"{a}+{b}=", answer=f"{a} and {b} make {a + b}.\n#### {a + b}") for a in range(5) for b in range(5)]
    datasets.Dataset.from_list(rows).to_parquet(str(root / "gsm8k.parquet"))
    run = root / "run"
    env = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT", "WANDB_API_KEY", "MLFLOW_TRACKING_URI")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    for k in ("WANDB_API_KEY", "MLFLOW_TRACKING_URI"):
        os.environ.pop(k, None)
    try:
        rc = train.main([
            f"run_dir={run}", "task.name=hf_dataset", f"task.options.path={root / 'gsm8k.parquet'}",
            "task.options.prompt_field=question", "task.options.answer_field=answer", "task.options.answer_extractor=gsm8k",
            "task.options.verifier=numeric", "task.options.heldout_fraction=0.2", "warmup.steps=2", "algo.updates=2",
            "algo.prompts_per_update=2", "algo.group_size=2", "algo.max_new_tokens=3", "eval.n=4", "eval.every=0",
            "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "progress=false",
            "metrics.decomposition_every=1", "metrics.tensorboard=true", "metrics.wandb=true", "metrics.mlflow=true",
            "checkpoint.every=2", "export.on_finish=true",
        ])
    finally:
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert rc == 0
    return run, [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


# -- MKL's code path on this CPU --------------------------------------------------------------------------------
def mkl_avx512_path() -> bool:
    """Whether MKL's sgemm takes its AVX-512 code path here (Intel CPUs with AVX-512; on AMD ones, Zen 4 included,
    MKL runs its AVX2 path, whose row counts and block rule differ)."""
    from nemo_rz.kernels import cpu as cpu_kernels

    return torch.backends.mkl.is_available() and cpu_kernels.MKL_ORDER == cpu_kernels.AVX512


# -- the Triton interpreter on this CPU ------------------------------------------------------------------------
def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (TRITON_INTERPRET, which the kernel test modules default to 1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def interpreter_dot_row_invariant(block_m, block_k, block_n):
    """Under the interpreter tl.dot is numpy's matmul (its BLAS: OpenBLAS in numpy's wheels) on the tile, plus
    the accumulator. Does that give a row of a [block_m, block_k] @ [block_k, block_n] float32 tile the same bits
    at any position and whatever the tile's other rows (the zeros of masked rows included)? Not on every CPU:
    OpenBLAS's AVX2 kernels do not (AMD EPYC here). A GPU's dot is the kernel's own (True)."""
    if not interpreting():
        return True
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((block_m, block_k), dtype=np.float32)
    b = rng.standard_normal((block_k, block_n), dtype=np.float32)
    full = np.matmul(a, b)
    perm = rng.permutation(block_m)
    if not np.array_equal(np.matmul(a[perm], b), full[perm]):
        return False
    for i in range(0, block_m, 7):
        for at in (0, block_m - 1):
            alone = np.zeros_like(a)
            alone[at] = a[i]
            if not np.array_equal(np.matmul(alone, b)[at], full[i]):
                return False
    return True


def skip_unless_dot_row_invariant(cfg):
    if not interpreter_dot_row_invariant(cfg.block_m, cfg.block_k, cfg.block_n):
        pytest.skip(f"interpreter artefact: numpy's matmul (tl.dot here) gives a row of a {cfg.block_m}x{cfg.block_k}"
                    f" @ {cfg.block_k}x{cfg.block_n} float32 tile other bits by its position and the tile's other rows"
                    " on this CPU, so no kernel's row invariance can be seen here (it is checked on a GPU or where"
                    " numpy's BLAS is row-invariant)")
