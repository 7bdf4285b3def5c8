"""Bring your own Hugging Face model: load a Qwen2/Qwen3/Llama checkpoint, roll out, check zero mismatch.

    python examples/bring_your_own_hf_model.py [HF_DIR or MODEL.gguf]

Without HF_DIR a tiny random Qwen3 is made with transformers and saved first (weights never come from a hub
here). Then: same logits as transformers (to float tolerance), and the engine's recorded logprobs equal the
learner's bit for bit.
"""
import sys
import tempfile
from pathlib import Path

import torch

from nemo_rz.models.hf import load_hf
from nemo_rz.tasks.hf_tokenizer import TOKENIZER_FILES
from nemo_rz.tools.check_mismatch import check


def tiny_qwen3(path: str) -> None:
    import transformers

    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(path)


if __name__ == "__main__":
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    if len(sys.argv) == 1:
        tiny_qwen3(path)
    model = load_hf(path)
    print(f"loaded {path}: {model.config.num_layers} layers, hidden {model.config.hidden_size}, vocab {model.config.vocab_size}")
    for row in check(model, [1, 8], max_new_tokens=16):
        print(f"batch {row['batch_size']:>2}: {row['diff_tokens']} of {row['tokens']} tokens differ between rollout and learner")
    # Training uses the checkpoint's own tokenizer; the tiny random model has none, so it takes the character one.
    own = Path(path).is_file() or any((Path(path) / f).is_file() for f in TOKENIZER_FILES)
    print(f"train on it: python -m nemo_rz.train model.hf_path={path}" + ("" if own else " model.tokenizer=char"))
