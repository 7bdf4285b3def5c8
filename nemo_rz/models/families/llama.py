"""Llama (LlamaForCausalLM): the fallback family of a dense config (no qk-norm, no windows)."""
import re

from nemo_rz.models.families.base import Family

_QK = re.compile(r"\.self_attn\.(q|k)_proj\.weight$")


def _permute(t, heads: int, inverse: bool):
    """llama.cpp's converter permutes the rows of Llama's q/k weights (each head's rotary halves interleaved);
    the GGUF reader undoes it."""
    rows = t.shape[0]
    if inverse:
        return t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)
    return t.reshape(heads, 2, rows // heads // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


class Llama(Family):
    def from_gguf(self, name, t, cfg):
        m = _QK.search(name)
        return t if m is None else _permute(t, cfg.num_heads if m.group(1) == "q" else cfg.num_kv_heads, True)

    def to_gguf(self, name, t, cfg):
        m = _QK.search(name)
        return t if m is None else _permute(t, cfg.num_heads if m.group(1) == "q" else cfg.num_kv_heads, False)

    def natural(self, cfg) -> bool:
        return True

    def write(self, cfg, out, types, sliding) -> None:
        out.update(mlp_bias=False, pretraining_tp=1)


FAMILY = Llama("LlamaForCausalLM", "llama", False, "config", 2048, gguf_arch="llama", rank=100)
