"""Llama (LlamaForCausalLM): the fallback family of a dense config (no qk-norm, no windows)."""
from nemo_rz.models.families.base import Family


class Llama(Family):
    def natural(self, cfg) -> bool:
        return True

    def write(self, cfg, out, types, sliding) -> None:
        out.update(mlp_bias=False, pretraining_tp=1)


FAMILY = Llama("LlamaForCausalLM", "llama", False, "config", 2048, gguf_arch="llama", rank=100)
