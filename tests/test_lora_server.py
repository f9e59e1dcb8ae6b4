"""Multi-LoRA serving (issue 35) against a real server: the tiny random GGUF
served by ``python -m jaxserve.main --mode serve --http_port 0
--lora_modules a=...,b=...`` on 127.0.0.1, with two PEFT adapters made by
``peft`` on transformers' copy of the file's very weights (as
``test_lora_engine.py`` makes them on the tiny Llama; ``init_lora_weights=False``
and B scaled up, so the adapters move the greedy tokens).

The OpenAI ``model`` field and gRPC ``lora_name`` pick an adapter; each
greedy output must equal ``LLM.generate(..., lora_request=LoRARequest(...))``
of an in-process engine with the same LoRA slots, and differ from the base.
Adapters load and unload at run time (HTTP and gRPC), a bad folder is a 400
naming the file, an unknown model a 404 (gRPC NOT_FOUND), and the per-adapter
and swap counters move on ``/metrics``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import httpx
import pytest

from server_util import ServerProcess
from test_server import ENGINE_FLAGS

pytestmark = pytest.mark.slow  # torch + transformers + peft make the adapters

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = [[3, 17, 42, 99, 7, 120, 5, 64, 33, 200, 11], [250, 1, 77, 9]]
LORA_FLAGS = ["--max_loras", "2", "--max_lora_rank", "8"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """(the tiny GGUF's path, {adapter name: its PEFT folder}): adapters ``a``
    (plain) and ``b`` (rsLoRA), rank 8 over every projection."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from tiny_gguf import write_tiny_gguf
    from tiny_models import hf_llama
    from jaxserve.config import ModelConfig
    cfg = ModelConfig(vocab_size=320, max_position_embeddings=512, num_layers=2)
    path = tmp_path_factory.mktemp("lora-gguf") / "tiny.gguf"
    params = write_tiny_gguf(path, cfg)
    folders = {}
    for i, (name, extra) in enumerate((("a", {}), ("b", {"use_rslora": True}))):
        torch.manual_seed(2000 + i)
        model = peft.get_peft_model(hf_llama(cfg, params), peft.LoraConfig(
            r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False, **extra))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(4.0)
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        model.save_pretrained(folder)
        folders[name] = str(folder)
    return str(path), folders


@pytest.fixture(scope="module")
def server(model_files):
    path, folders = model_files
    modules = ",".join(f"{n}={f}" for n, f in folders.items())
    s = ServerProcess(["--model", path, "--http_port", "0", *ENGINE_FLAGS, *LORA_FLAGS,
                       "--lora_modules", modules])
    yield s
    assert s.terminate() == 0


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def expected(model_files):
    """name (None: the base) -> greedy token ids and text of each prompt, from
    ``LLM.generate`` with a ``LoRARequest`` on an engine with the server's
    LoRA slots."""
    from conftest import XLA_CACHE
    from jaxserve import LLM, LoRARequest, SamplingParams
    path, folders = model_files
    llm = LLM(path, num_pages=1024, page_size=8, compilation_cache_dir=XLA_CACHE,
              enable_lora=True, max_loras=2, max_lora_rank=8)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    out = {}
    for i, name in enumerate([None, *folders]):
        lr = None if name is None else LoRARequest(name, i, folders[name])
        res = llm.generate(PROMPTS, sp, lora_request=lr)
        out[name] = [(r.outputs[0].token_ids, r.outputs[0].text) for r in res]
    return out


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param, err
    return err["message"]


def _complete(http, model: str, prompt) -> httpx.Response:
    return http.post("/v1/completions", json=dict(model=model, prompt=prompt,
                                                  max_tokens=MAX_TOKENS, temperature=0.0))


def test_lora_flags_parse():
    from jaxserve import flags as cli
    cli.FLAGS.unparse_flags()
    try:
        cli.FLAGS(["jaxserve"])
        assert cli.lora_config() is None and cli.lora_modules() == []
        cli.FLAGS.unparse_flags()
        cli.FLAGS(["jaxserve", "--enable_lora", "--max_loras", "3"])
        lc = cli.lora_config()
        assert (lc.max_loras, lc.max_lora_rank) == (3, 16)
        cli.FLAGS.unparse_flags()
        here, there = sys.prefix, sys.exec_prefix  # two folders that exist
        cli.FLAGS(["jaxserve", f"--lora_modules=x={here}, y = {there}"])
        assert cli.lora_modules() == [("x", here), ("y", there)]
        assert cli.lora_config().max_loras == 4  # --lora_modules turns LoRA on
        for value, needle in ((f"x={here},x={there}", "'x' is given twice"),
                              ("nameonly", "'nameonly': expected name=path"),
                              ("=/tmp", "'=/tmp': expected name=path"),
                              ("z=/no/such/folder", "'/no/such/folder' is not a folder"),
                              (f"smollm2-135m={here}", "the name is --model's")):
            cli.FLAGS.unparse_flags()
            cli.FLAGS(["jaxserve", f"--lora_modules={value}"])
            with pytest.raises(ValueError, match="--lora_modules entry") as e:
                cli.engine_config()
            assert needle in str(e.value), e.value
        cli.FLAGS.unparse_flags()
        cli.FLAGS(["jaxserve", "--enable_lora", "--max_lora_rank", "0"])
        with pytest.raises(ValueError, match="--max_lora_rank"):
            cli.lora_config()
    finally:
        cli.FLAGS.unparse_flags()


def test_bad_lora_module_folder_exits_2_naming_the_entry(model_files, tmp_path):
    path, _ = model_files
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    proc = subprocess.run(
        [sys.executable, "-m", "jaxserve.main", "--mode", "serve", "--model", path, "--port", "0",
         "--metrics_port", "-1", "--nowarmup", "--lora_modules", f"bad={tmp_path}"],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"--lora_modules entry 'bad={tmp_path}'" in errors[0], errors[0]
    assert "adapter_model.safetensors" in errors[0], errors[0]


def test_models_list_base_and_adapters(server, http, model_files):
    path, folders = model_files
    data = http.get("/v1/models").json()["data"]
    assert [c["id"] for c in data] == [path, "a", "b"]
    assert data[0]["parent"] is None and data[0]["root"] == path
    for card in data[1:]:
        assert card == dict(card, object="model", owned_by="jaxserve", root=folders[card["id"]],
                            parent=path)
    assert http.get("/v1/models/b").json() == data[2]
    assert "does not exist" in _error(http.get("/v1/models/nope"), 404, "model")


def test_completions_and_chat_with_an_adapter_equal_llm_generate(server, http, expected,
                                                                model_files):
    base = model_files[0]
    for model in (None, "a", "b"):
        for i, prompt in enumerate(PROMPTS):
            r = _complete(http, model or base, prompt)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["text"] == expected[model][i][1], (model, i)
            assert body["model"] == (model or base)
    for name in ("a", "b"):  # each adapter changes the greedy tokens of some prompt
        assert [t for t, _ in expected[name]] != [t for t, _ in expected[None]], name
    assert expected["a"] != expected["b"]
    # chat: the adapter reaches the chat route too (and changes its answer)
    chats = {}
    for model in ("a", "b"):
        r = http.post("/v1/chat/completions", json=dict(
            model=model, messages=[{"role": "user", "content": "hello world"}],
            max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True))
        assert r.status_code == 200, r.text
        chats[model] = [e["token"] for e in r.json()["choices"][0]["logprobs"]["content"]]
        assert r.json()["model"] == model
    assert chats["a"] != chats["b"]
    msg = _error(_complete(http, "nope", PROMPTS[0]), 404, "model")
    assert "`nope` does not exist" in msg and "'a', 'b'" in msg, msg


def test_load_use_unload_then_404(server, http, model_files, expected, tmp_path):
    _, folders = model_files
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": folders["b"]})
    assert r.status_code == 200 and "c" in r.text, r.text
    assert [c["id"] for c in http.get("/v1/models").json()["data"]][1:] == ["a", "b", "c"]
    r = _complete(http, "c", PROMPTS[0])  # b's weights under another name: b's output
    assert r.json()["choices"][0]["text"] == expected["b"][0][1]
    msg = _error(http.post("/v1/load_lora_adapter", json={"lora_name": "c",
                                                          "lora_path": folders["a"]}), 400, None)
    assert "already loaded" in msg
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    _error(_complete(http, "c", PROMPTS[0]), 404, "model")
    assert "not found" in _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "c"}),
                                 404, "lora_name")
    # a folder the model cannot take: 400 naming the file
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
    msg = _error(http.post("/v1/load_lora_adapter", json={"lora_name": "d",
                                                          "lora_path": str(tmp_path)}), 400, None)
    assert "adapter_model.safetensors" in msg, msg
    _error(http.post("/v1/load_lora_adapter", json={"lora_name": "d"}), 400, "lora_path")
    assert [c["id"] for c in http.get("/v1/models").json()["data"]][1:] == ["a", "b"]


def test_grpc_lora_name(server, model_files, expected):
    from jaxserve.server.client import Client
    _, folders = model_files
    with Client(server.target) as c:
        for name in (None, "a", "b"):
            got = c.complete(token_ids=PROMPTS[1], lora_name=name or "", max_tokens=MAX_TOKENS,
                             temperature=0.0)
            assert got.token_ids == list(expected[name][1][0]), name
        with pytest.raises(grpc.RpcError) as e:
            c.complete(token_ids=PROMPTS[1], lora_name="nope", max_tokens=2)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        assert "lora_name" in e.value.details() and "nope" in e.value.details()
        info = c.model_info()
        assert info.max_loras == 2
        assert [(x.name, x.path) for x in info.lora_adapters] == [("a", folders["a"]),
                                                                  ("b", folders["b"])]
        c.load_lora_adapter("g", folders["a"])
        got = c.complete(token_ids=PROMPTS[0], lora_name="g", max_tokens=MAX_TOKENS,
                         temperature=0.0)
        assert got.token_ids == list(expected["a"][0][0])
        c.unload_lora_adapter("g")
        with pytest.raises(grpc.RpcError) as e:
            c.unload_lora_adapter("g")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as e:
            c.load_lora_adapter("h", "/no/such/folder")
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_metrics_count_requests_per_adapter_and_swaps(server, http, model_files):
    assert http.post("/v1/load_lora_adapter", json={
        "lora_name": "m", "lora_path": model_files[1]["a"]}).status_code == 200
    before = server.metrics()
    usage = {"b": [0, 0]}  # prompt, completion tokens of the "b" requests
    for model in ("b", "b", "a", "m"):  # 3 adapters through 2 slots: a write at least
        r = _complete(http, model, PROMPTS[1])
        assert r.status_code == 200
        if model == "b":
            usage["b"][0] += r.json()["usage"]["prompt_tokens"]
            usage["b"][1] += r.json()["usage"]["completion_tokens"]
    after = server.metrics()
    key = 'jaxserve_lora_requests_total{lora_name="b"}'
    assert after[key] - before.get(key, 0) == 2
    gen = 'jaxserve_lora_tokens_total{kind="generation",lora_name="b"}'
    prompt = 'jaxserve_lora_tokens_total{kind="prompt",lora_name="b"}'
    assert after[gen] - before.get(gen, 0) == usage["b"][1]
    # Prompt tokens computed: the second "b" request finds the first's full pages cached.
    assert 0 < after[prompt] - before.get(prompt, 0) <= usage["b"][0]
    assert after["jaxserve_lora_swaps_total"] - before.get("jaxserve_lora_swaps_total", 0) >= 1
    assert after["jaxserve_lora_slots_resident"] == 2
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "m"}).status_code == 200
    info = [k for k in after if k.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
