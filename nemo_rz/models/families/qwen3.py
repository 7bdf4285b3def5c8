"""Qwen3 (Qwen3ForCausalLM): qk-norm; windows from max_window_layers on."""
from nemo_rz.models.families.base import Family
from nemo_rz.models.families.qwen2 import write_qwen_windows


class Qwen3(Family):
    def natural(self, cfg) -> bool:
        return cfg.qk_norm

    def write(self, cfg, out, types, sliding) -> None:
        write_qwen_windows(cfg, out, types, sliding)


FAMILY = Qwen3("Qwen3ForCausalLM", "qwen3", True, "config", 32768, 128, "qwen", gguf_arch="qwen3", rank=30)
