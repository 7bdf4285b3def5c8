"""Real Hugging Face artefacts built in memory for tests: a small byte-level BPE tokenizer with a ChatML chat
template, a tiny random Llama checkpoint directory that carries it, and the same model as a GGUF file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]  # ids 0..3
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 100, 7) for b in range(0, 100, 11)] + [
    "You are a careful assistant. Answer with just the number.", "Reverse the digits.", "hello world"]


def bpe_tokenizer(vocab_size: int = 320, bos: bool = False, chat_template: str | None = CHATML):
    """A transformers tokenizer: byte-level BPE trained on CORPUS (any text encodes, decode round-trips),
    <|endoftext|> as BOS (when bos) and unknown token, <|im_end|> as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS, trainer)
    if bos:
        from tokenizers import processors

        tk.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<pad>", chat_template=chat_template)


def word_tokenizer(words: list[str]):
    """A word-level tokenizer with [UNK]: text outside `words` cannot be encoded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<|im_end|>", *words])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<|im_end|>")


def llama_checkpoint(path: Path, tokenizer, seed: int = 0, eos_token_id=None, **overrides) -> Path:
    """A random LlamaForCausalLM checkpoint directory (transformers' own writer) with `tokenizer` saved beside it."""
    import transformers

    torch.manual_seed(seed)
    cfg = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
               tie_word_embeddings=False)
    cfg.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).float().eval()
    with torch.no_grad():  # peaky, varied distributions (as tests/conftest.tiny_model)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    if eos_token_id is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_token_id}))
    return path


def llama_gguf(path: Path, tokenizer, seed: int = 0, arch: str = "llama", add_bos: bool | None = None,
               hidden: int = 64, heads: int = 4, kv_heads: int = 2, layers: int = 2, ffn: int = 128,
               rope_theta: float = 10000.0) -> Path:
    """A GGUF file (float32 tensors, as llama.cpp lays out a Llama model) with random weights, `tokenizer`'s
    vocabulary, merges and chat template in its metadata."""
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    added = {t.content for t in tokenizer.added_tokens_decoder.values()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_pad_token_id(tokenizer.pad_token_id)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if tokenizer.chat_template:
        w.add_chat_template(tokenizer.chat_template)
    head_dim = hidden // heads

    def tensor(name, *shape, scale=0.3):
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    tensor("token_embd.weight", len(tokens), hidden)
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        tensor(f"blk.{i}.attn_q.weight", heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    tensor("output.weight", len(tokens), hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
