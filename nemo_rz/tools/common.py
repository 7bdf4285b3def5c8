"""Shared pieces of the command-line tools: loading a model, making test prompts, and checking arguments
(sizes against the model and the machine's memory, output paths) before any work."""
from __future__ import annotations

import os
import stat
import sys

import torch

from nemo_rz import schema
from nemo_rz.models import Decoder, DecoderConfig

SEED_MAX = 2**32 - 1


def load_model(path: str | None, seed: int = 0) -> Decoder:
    """A Hugging Face checkpoint directory or .gguf file (nemo_rz.models.hf.load_hf), or (path None) a tiny random
    model with peaky distributions. The benchmarks and tools load real models through this."""
    if path:
        from nemo_rz.models.hf import load_hf

        return load_hf(path).eval()
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return model.eval()


def random_prompts(n: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in lengths]


def fail(message: str) -> None:
    """Bad input: one clear line on stderr, exit code 2, no traceback (docs/contracts.md, 7)."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


# -- argument checks -----------------------------------------------------------------------------------------
def check_range(option: str, value: int, lo: int, hi: int, why: str = "") -> None:
    """fail() unless lo <= value <= hi: one line naming the option, the value and the valid range."""
    if not lo <= value <= hi:
        fail(f"{option} {value}: must be in {lo}..{hi}{f' ({why})' if why else ''}")


def available_memory() -> int:
    """Bytes of memory this process can still use (nemo_rz.schema.available_memory: MemAvailable, lowered to a
    cgroup limit); no bound where the machine does not say."""
    found = schema.available_memory()
    return found if found is not None else 1 << 62


def usable_memory() -> int:
    """The memory a tool lets one run take: 80% of available_memory(), leaving room for everything else."""
    return available_memory() * 4 // 5


def human_bytes(n: float) -> str:
    """Bytes for people: 512 B, 3.2 KiB, 41 MiB, 1.5 GiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


def _element_size(cfg: DecoderConfig) -> int:
    return torch.empty((), dtype=cfg.torch_dtype).element_size()


def kv_bytes_per_token(cfg: DecoderConfig) -> int:
    """Bytes of KV cache one token of one sequence takes (every layer keeps keys and values)."""
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * _element_size(cfg)


def forward_bytes_per_token(cfg: DecoderConfig, length: int) -> int:
    """A generous estimate of the peak bytes per token of a batched forward that scores every position: the
    largest layer activations, a padded attention row per head, and the logits with their float32 log-softmax."""
    mlp = max(cfg.intermediate_size, (cfg.moe_intermediate_size or cfg.intermediate_size) * max(1, cfg.num_experts_per_tok)
              if cfg.num_experts else 0)
    layer = 4 * cfg.hidden_size + 2 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 3 * mlp
    return layer * _element_size(cfg) + 2 * 4 * cfg.num_heads * length + cfg.vocab_size * (_element_size(cfg) + 8)


def traced_bytes_per_token(cfg: DecoderConfig) -> int:
    """Bytes per token of every op output of a forward, all kept (what bisect's learner trace records)."""
    mlp = max(cfg.intermediate_size, (cfg.moe_intermediate_size or cfg.intermediate_size) * max(1, cfg.num_experts_per_tok)
              if cfg.num_experts else 0)
    layer = 6 * cfg.hidden_size + 4 * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + 4 * mlp
    return (cfg.num_layers * layer + 2 * cfg.hidden_size) * _element_size(cfg)


def regular_file_problem(path: str) -> str | None:
    """Why `path` cannot take a new file written there (None: it can). An existing path must be a regular file
    (or a symlink to one; the link itself is replaced, never what it points to): a directory, device, FIFO
    or socket is refused, so a write never replaces one. The folder must exist and be writable."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        st = os.stat(path)  # follows symlinks: a link to /dev/null is refused too
    except (FileNotFoundError, NotADirectoryError):
        st = None  # a new file (or a dangling symlink, which the write replaces)
    except OSError as e:
        return f"cannot inspect it: {e.strerror or e}"
    via = " (through a symlink)" if os.path.islink(path) else ""
    if st is not None and not stat.S_ISREG(st.st_mode):
        kinds = ((stat.S_ISDIR, "it is a directory"), (stat.S_ISFIFO, "it is a FIFO"), (stat.S_ISSOCK, "it is a socket"),
                 (stat.S_ISCHR, "it is a character device"), (stat.S_ISBLK, "it is a block device"))
        kind = next((k for test, k in kinds if test(st.st_mode)), "it is not a regular file")
        return kind + via
    if not os.path.isdir(folder):
        return f"no folder {folder}"
    if not os.access(folder, os.W_OK):
        return f"{folder} is not writable"
    return None
