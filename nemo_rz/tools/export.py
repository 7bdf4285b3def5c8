"""Export a run's policy at a checkpoint as a Hugging Face model directory that transformers and stock vLLM load.

    python -m nemo_rz.tools.export RUN_DIR [--step N] [--dtype float32|bfloat16] OUT_DIR

OUT_DIR gets config.json (the family's architecture: the model.hf_path checkpoint's, or the natural one of a
fresh model), model.safetensors in the family's tensor names and expert layout, the run's tokenizer files with
their chat template (model.tokenizer / model.hf_path's; the character tokenizer of a fresh run as an equivalent
`tokenizers` file), and generation_config.json with every EOS id. Parts a run trains beside the policy are written
in their own formats: a LoRA run's adapters as a PEFT directory OUT_DIR/lora (base_model_name_or_path OUT_DIR,
whose weights are the frozen base), an EAGLE-3 draft as OUT_DIR/draft.pt (nemo_rz.models.draft.save_draft), an
MTP draft as the checkpoint's own model.layers.{L+j} (num_nextn_predict_layers). The checkpoint is read as a
resume reads it (checksums verified, nothing unpickled); OUT_DIR is written beside itself and renamed into place
when complete, and an existing OUT_DIR is never touched. `export.on_finish=true` makes a run export its last
checkpoint to RUN_DIR/export when it ends (export_on_finish).
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch

from nemo_rz import atomic
from nemo_rz.errors import ArgumentParser, CorruptCheckpoint
from nemo_rz.tools.common import fail

DTYPES = ("float32", "bfloat16")
LORA_DIR = "lora"
DRAFT_FILE = "draft.pt"
ON_FINISH_DIR = "export"


def _checkpoint(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder of update `step` (None: the newest intact one), verified."""
    from nemo_rz.runtime import checkpoint

    ckpt_dir = run_dir / "checkpoints"
    found = checkpoint.checkpoints(ckpt_dir)
    if not found:
        raise ValueError(f"{run_dir} has no checkpoints ({ckpt_dir} holds no step_N): train with checkpoint.every > 0 "
                         "(a run also saves at its last update), then export")
    if step is None:
        path = checkpoint.latest(ckpt_dir)
        if path is None:
            raise ValueError(f"no intact checkpoint in {ckpt_dir} ({', '.join(p.name for p in found)} fail their "
                             "checksums); resume the run to write a new one")
        return path
    path = next((p for p in found if int(p.name.removeprefix("step_")) == step), None)
    if path is None:
        raise ValueError(f"--step {step}: {ckpt_dir} has no step_{step}; it holds {', '.join(p.name for p in found)}")
    try:
        checkpoint.verify(path)
    except CorruptCheckpoint as e:
        raise ValueError(f"--step {step}: {e}; export another step") from None
    return path


def _run_config(run_dir: Path):
    """The run's saved config, validated and typed, as a resume reads it."""
    from nemo_rz import config as config_lib
    from nemo_rz import schema

    if not (run_dir / config_lib.RUN_CONFIG).is_file():
        raise ValueError(f"{run_dir} is not a run directory (no {config_lib.RUN_CONFIG}); pass the run_dir of a "
                         "nemo_rz.train run")
    return schema.typed(config_lib.load(None, [f"resume={run_dir}"]))


def _tokenizer(cfg):
    """The run's tokenizer: the HFTokenizer of model.tokenizer / model.hf_path, or the task's character tokenizer."""
    from nemo_rz.runtime import build
    from nemo_rz.tasks import load_tokenizer

    tok = load_tokenizer(build.tokenizer_spec(cfg.model))
    return tok if tok is not None else build.build_task(cfg.task, cfg.model).tokenizer


def _architecture(cfg) -> str | None:
    """The model.hf_path checkpoint's architecture (None: a fresh model's natural one, or a GGUF file's family)."""
    from nemo_rz.models.hf import read_json
    from nemo_rz.models.hf_config import CONFIG_FILE, architecture_of

    path = Path(cfg.model.hf_path) if cfg.model.hf_path else None
    if path is None or not (path / CONFIG_FILE).is_file():
        return None
    return architecture_of(read_json(path / CONFIG_FILE), str(path / CONFIG_FILE))


def _model(cfg, tok, weights: dict[str, torch.Tensor], dtype: str, where: Path):
    """The run's Decoder (LoRA adapters applied as in the run) holding the checkpoint's policy weights in `dtype`."""
    from nemo_rz.models import Decoder, lora
    from nemo_rz.runtime import build

    with torch.device("meta"):
        shape = build.build_model(cfg.model, tok) if not cfg.model.hf_path else None
    if shape is None:  # the checkpoint's config only: its weights are the run's starting point, not needed here
        shape = _hf_path_config(cfg)
    else:
        shape = shape.config
    mcfg = dataclasses.replace(shape, dtype=dtype)
    with torch.device("meta"):
        model = Decoder(mcfg)
        if cfg.lora.rank:
            lora.apply_lora(model, lora.LoraSpec(cfg.lora.rank, cfg.lora.alpha, cfg.lora.rslora, cfg.lora.modules))
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which the model has not"
        raise ValueError(f"checkpoint {where}: model.safetensors {what} ({len(missing)} missing, {len(extra)} unexpected): "
                         "it does not match the run's config.yaml; export the run it belongs to")
    state = {}
    for k, v in weights.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise ValueError(f"checkpoint {where}: {k} is {list(v.shape)}, the run's model has {list(expected[k].shape)}; "
                             "it does not match the run's config.yaml")
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"checkpoint {where}: {k} holds non-finite values; export an earlier step")
        state[k] = v.to(expected[k].dtype).contiguous()  # the model's own dtype per tensor: adapters and float32
        # buffers (DeepSeek's routing bias) stay float32
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _hf_path_config(cfg):
    """DecoderConfig of model.hf_path (a checkpoint directory's config.json; a GGUF file is read in full)."""
    from nemo_rz.models.hf import load_hf, read_json
    from nemo_rz.models.hf_config import CONFIG_FILE, config_from_hf

    path = Path(cfg.model.hf_path)
    if (path / CONFIG_FILE).is_file():
        return config_from_hf(read_json(path / CONFIG_FILE), str(path / CONFIG_FILE))
    return load_hf(path).config


def _char_tokenizer(tok):
    """A transformers fast tokenizer with the character tokenizer's ids: one token per character (ids 3...), <pad> 0,
    <bos> 1, <eos> 2, BOS added in front as the run's prompts have it. A character outside the alphabet encodes as
    <pad> (its unknown token, as GPT-2's is <|endoftext|>): the model's vocabulary has no spare id for a new <unk>
    (an id past it would index outside the embedding inside vLLM), and without one `tokenizers` raises "Missing [UNK]
    token", which vLLM's server answers with HTTP 500. Existing ids are unchanged; the returned token ids
    (return_token_ids) show the substitution."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from nemo_rz.tasks.tokenizer import BOS, EOS, PAD, SPECIALS

    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate(tok.chars)}
    t = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    t.decoder = decoders.Fuse()
    t.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=t, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=PAD,
                                   clean_up_tokenization_spaces=False)
    return fast


def _write_tokenizer(tok, out: Path) -> dict:
    """The tokenizer files in `out`; returns generation_config.json's token ids."""
    from nemo_rz.tasks import HFTokenizer

    if isinstance(tok, HFTokenizer):
        tok.tok.save_pretrained(str(out))
        file = out / "tokenizer_config.json"
        config = json.loads(file.read_text(encoding="utf-8"))
        config["add_bos_token"] = tok.add_bos  # the run's BOS policy (a GGUF's is not in transformers' files)
        file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    else:
        _char_tokenizer(tok).save_pretrained(str(out))
    return {"bos_token_id": tok.bos_id, "eos_token_id": list(tok.eos_ids), "pad_token_id": tok.pad_id}


def _write_json(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def export(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None, dtype: str = "float32") -> Path:
    """Write the policy of `run_dir`'s checkpoint `step` (None: the newest intact one) as a Hugging Face directory at
    `out_dir` (see the module docstring). One-line ValueError for a bad run, step, dtype or an existing out_dir."""
    from nemo_rz.models import lora
    from nemo_rz.models.hf import save_hf
    from nemo_rz.runtime import checkpoint
    from nemo_rz.runtime.weights import WeightsBundle

    run, out = Path(run_dir), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: export writes {' or '.join(DTYPES)}")
    if not run.is_dir():
        raise ValueError(f"run directory {run} does not exist; pass the run_dir of a nemo_rz.train run")
    if out.exists() or out.is_symlink():
        raise ValueError(f"{out} already exists; choose a new output directory (nothing was written)")
    cfg = _run_config(run)
    path = _checkpoint(run, step)
    try:
        weights, _, _, state = checkpoint.load(path)
    except CorruptCheckpoint as e:
        raise ValueError(str(e)) from None
    bundle = WeightsBundle.from_flat(weights, int(state.get("version", -1)))
    tok = _tokenizer(cfg)
    model = _model(cfg, tok, bundle.policy, dtype, path)
    if model.config.vocab_size < tok.vocab_size:
        raise ValueError(f"checkpoint {path}: the model's vocabulary ({model.config.vocab_size}) is smaller than the "
                         f"tokenizer's ({tok.vocab_size}); it does not belong to this run")
    draft = bundle.parts.get("draft")
    arch = _architecture(cfg)
    with atomic.new_dir(out) as tmp:
        ids = _write_tokenizer(tok, tmp)
        adapted = lora.adapted(model)
        base = model
        if adapted:  # the base in OUT_DIR itself, the adapters beside it in PEFT's format
            lora.save_peft(model, tmp / LORA_DIR, base_model=str(out.resolve()))
        tensors, extra_config = None, {}
        if draft is not None and cfg.draft.kind == "mtp":
            head = _mtp_head(model, draft, path)
            tensors, extra_config = head.file_tensors(model), {"num_nextn_predict_layers": len(head.layers)}
        elif draft is not None:
            _save_eagle(cfg, model, draft, tmp / DRAFT_FILE, path)
        plain = _without_adapters(base) if adapted else base
        save_hf(plain, tmp, arch, extra_tensors=tensors,
                extra_config={**extra_config, "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"][0],
                              "pad_token_id": ids["pad_token_id"]})
        _write_json(tmp / "generation_config.json", ids)
    return out


def _without_adapters(model):
    """A Decoder holding `model`'s base weights alone (its adapters left out), sharing their storage."""
    from nemo_rz.models import Decoder, lora

    with torch.device("meta"):
        plain = Decoder(model.config)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not lora.is_adapter(k)}, strict=True, assign=True)
    return plain.eval()


def _mtp_head(model, draft: dict, where: Path):
    from nemo_rz.models.mtp import MTPHead

    layers = {int(k.split(".")[1]) for k in draft if k.startswith("layers.")}
    with torch.device("meta"):
        head = MTPHead(model.config, len(layers))
    try:
        head.load_state_dict({k: v.to(model.config.torch_dtype) for k, v in draft.items()}, strict=False, assign=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {where}: its MTP draft does not fit the run's model ({str(e).splitlines()[0][:120]})") from None
    return head


def _save_eagle(cfg, model, draft: dict, file: Path, where: Path) -> None:
    from nemo_rz.models.draft import DraftHead, save_draft

    d = cfg.draft
    vocab = draft.get("vocab")
    with torch.device("meta"):
        head = DraftHead(model.config, d.aux_layers, d.num_layers, None if vocab is None else int(vocab.numel()))
    try:
        head.load_state_dict(draft, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {where}: its draft does not fit the run's draft.* settings "
                         f"({str(e).splitlines()[0][:120]})") from None
    save_draft(head, file)


def export_on_finish(run_dir: Path, log=print) -> Path | None:
    """export.on_finish=true: the run's newest checkpoint to RUN_DIR/export (replacing an earlier export)."""
    import shutil

    from nemo_rz.runtime import checkpoint

    run = Path(run_dir)
    if checkpoint.latest(run / "checkpoints") is None:
        log("export.on_finish: the run wrote no checkpoint (checkpoint.every=0?); nothing exported")
        return None
    out = run / ON_FINISH_DIR
    fresh = run / f".{ON_FINISH_DIR}.new"
    if fresh.exists():
        shutil.rmtree(fresh)
    export(run, fresh)
    if out.exists():
        shutil.rmtree(out)
    os.replace(fresh, out)
    log(f"exported the policy to {out} (transformers / vLLM load it)")
    return out


def main(argv=None) -> int:
    ap = ArgumentParser(prog="python -m nemo_rz.tools.export", description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="a nemo_rz.train run directory (config.yaml, checkpoints/step_N)")
    ap.add_argument("out", help="the Hugging Face model directory to create")
    ap.add_argument("--step", type=int, default=None, help="the checkpoint's update (default: the newest intact one)")
    ap.add_argument("--dtype", choices=DTYPES, default="float32")
    try:
        args = ap.parse_args(argv)
    except ValueError as e:
        fail(str(e))
    try:
        out = export(args.run_dir, args.out, args.step, args.dtype)
    except ValueError as e:
        fail(str(e))
    except OSError as e:
        fail(f"cannot write {args.out}: {e.strerror or e}; check the path and free space")
    print(f"wrote {out}: transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}) or vllm serve {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
