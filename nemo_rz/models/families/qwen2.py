"""Qwen2 (Qwen2ForCausalLM): q/k/v biases, no o bias; windows from max_window_layers on."""
from nemo_rz.models.families.base import Family


def write_qwen_windows(cfg, out, types, sliding) -> None:
    out.update(use_sliding_window=sliding, sliding_window=cfg.sliding_window if sliding else None,
               max_window_layers=types.index("sliding_attention") if sliding else cfg.num_layers, layer_types=types)


class Qwen2(Family):
    def natural(self, cfg) -> bool:
        return cfg.attention_bias and not cfg.o_proj_bias

    def write(self, cfg, out, types, sliding) -> None:
        write_qwen_windows(cfg, out, types, sliding)


FAMILY = Qwen2("Qwen2ForCausalLM", "qwen2", False, "qkv", 32768, None, "qwen", gguf_arch="qwen2", rank=40)
