"""Mistral (MistralForCausalLM): no biases; every layer slides when sliding_window is set. Its GGUF files are
written as architecture "llama"."""
from nemo_rz.models.families.llama import Llama


class Mistral(Llama):  # Llama's GGUF layout (permuted q/k), its own config
    def natural(self, cfg) -> bool:
        return cfg.window(0) is not None and cfg.layer_types is None and not cfg.attention_bias

    def write(self, cfg, out, types, sliding) -> None:
        out["sliding_window"] = cfg.sliding_window if sliding else None


FAMILY = Mistral("MistralForCausalLM", "mistral", False, "none", 4096 * 32, None, "all", gguf_arch="llama", rank=90)
