"""``ep-fuse serve``: HF's OpenAI-compatible server with continuous batching compiled by ep_fuse, driven by the
``openai`` client on a loopback port. A tiny Qwen3-MoE (1 layer, fp32) and a character-level tokenizer with a
Qwen-style chat template are saved to a temp dir; every completion must equal eager ``generate`` of the same
prompt.

The server tests run twice: with HF's continuous-batching paths left uncompiled (``cb_compile_configs``, the
one function that names the compile configs, swapped for one that names none: the HTTP behaviour, fast), and
compiled by ep_fuse (``executor="eager"`` to keep compile time low; still minutes on CPU, because each padded
batch shape and graph piece compiles anew: ``slow``). The variant with Inductor as executor is slow too."""

from __future__ import annotations

import concurrent.futures as cf
import http.client
import json
import os
import pickle
import socket
import string
import threading
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import ep_fuse  # noqa: E402
from ep_fuse import serve  # noqa: E402
from ep_fuse.testing import tiny as tiny_models  # noqa: E402

pytestmark = pytest.mark.hf

ENGINE = serve._assembly() == "engine"
"""transformers >= 5.25: the server runs in a process of its own, its model in HF's spawned engine process (reports
are read from the engine's dumps); 5.24: in a thread of this process."""

NEW = 8
CB = dict(cb_num_blocks=48, cb_block_size=32, cb_max_batch_tokens=64)
"""A 1536-token KV cache (48 blocks of 32): longer requests are refused."""
PROMPTS = ["hello world", "MoE", "the quick brown fox", "a", "Serve me, please!", "12345 67890", "ok", "zz top"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_tiny(path) -> None:
    """A 1-layer tiny Qwen3-MoE (fp32) and a character-level tokenizer in ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"]
    vocab = {t: i for i, t in enumerate(specials + list(string.printable[:95]) + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                                unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    model = tiny_models.build("qwen3_moe", dtype=torch.float32, num_hidden_layers=1)
    model.generation_config.eos_token_id = vocab["<|im_end|>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.generation_config.do_sample = False
    model.save_pretrained(path)
    fast.save_pretrained(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Eager:
    """Eager ``generate`` of the saved model: the expected text of a completion or a chat completion."""

    def __init__(self, path) -> None:
        self.tok = transformers.AutoTokenizer.from_pretrained(path)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def _gen(self, ids: list[int]) -> str:
        with torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        return self.tok.decode(out[0, len(ids):], skip_special_tokens=True)

    def completion(self, prompt: str) -> str:
        return self._gen(self.tok(prompt).input_ids)

    def chat(self, content: str) -> str:
        ids = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
        return self._gen(list(ids))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen3_moe")
    save_tiny(path)
    return str(path)


@pytest.fixture(scope="module")
def eager(model_dir):
    return Eager(model_dir)


SERVER_PARAMS = ["ep_fuse"] if ENGINE else ["uncompiled", pytest.param("ep_fuse", marks=pytest.mark.slow)]
"""5.24: also a server without compile configs (fast); 5.25's engine process cannot be patched from here."""


@pytest.fixture(scope="module", params=SERVER_PARAMS)
def server(request, model_dir, tmp_path_factory):
    torch._dynamo.reset()
    ep_fuse.reset_reports()
    port = free_port()
    patch = pytest.MonkeyPatch()
    if request.param == "uncompiled":
        patch.setattr(serve, "cb_compile_configs", lambda options=None: (None, None))
    options = {"executor": "eager"}
    dumps = tmp_path_factory.mktemp("engine_dumps") if ENGINE else None
    if ENGINE:  # the reference provider: the Triton interpreter would run HF's warm-up at its largest sizes
        options.update(dump_dir=str(dumps), providers={"cpu": ["reference"]})
    before = set(threading.enumerate())  # threads of earlier tests in this process are not the server's
    try:
        srv = serve.start(model_dir, options, host="127.0.0.1", port=port, device="cpu", dtype="float32", **CB)
    except Exception:
        patch.undo()
        raise
    srv.port, srv.model, srv.compiled, srv.dumps = port, model_dir, request.param == "ep_fuse", dumps
    srv.threads_before = before
    yield srv
    serve.stop(srv)
    patch.undo()


def engine_counts(srv) -> dict[str, int]:
    """Fused sites per pattern over every graph the server compiled: this process's reports (5.24), or the reports
    the engine process dumped (5.25)."""
    counts: dict[str, int] = {}
    if srv.dumps is None:
        reports = [[m.pattern for m in rep.matches] for rep in ep_fuse.reports()]
    else:
        reports = [[m["pattern"] for m in json.loads(p.read_text())["matches"]]
                   for p in sorted(srv.dumps.rglob("report.json"))]
    for patterns in reports:
        for name in patterns:
            counts[name] = counts.get(name, 0) + 1
    return counts


def client(srv, timeout: float = 300):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", timeout=timeout, max_retries=0)


def chat(srv, content: str, **kw):
    return client(srv).chat.completions.create(model=srv.model, messages=[{"role": "user", "content": content}],
                                               max_tokens=NEW, temperature=0, **kw)


def complete(srv, prompt: str, **kw):
    return client(srv).completions.create(model=srv.model, prompt=prompt, max_tokens=NEW, temperature=0, **kw)


def post(srv, path: str, body: bytes) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


# --------------------------------------------------------------------------- no server
def test_compile_configs_name_ep_fuse_for_both_paths():
    varlen, decode = serve.cb_compile_configs({"executor": "eager"})
    for cc in (varlen, decode):
        assert (cc.backend, cc.fullgraph, cc.mode, cc.options) == ("ep_fuse", False, None, {"executor": "eager"})
    plain = serve.cb_compile_configs()  # mode None = Inductor's default (HF's own default is reduce-overhead)
    assert all((cc.backend, cc.mode, cc.options, cc.dynamic) == ("ep_fuse", None, {}, True) for cc in plain)
    with pytest.raises(ValueError, match="use_cuda_graph"):
        serve.cb_compile_configs({"mode": "reduce-overhead"})


def test_with_ep_fuse_compile_keeps_what_the_caller_set():
    mine = transformers.CompileConfig(backend="inductor", mode="default")
    given = transformers.ContinuousBatchingConfig(num_blocks=8, varlen_compile_config=mine)
    out = serve.with_ep_fuse_compile(given, {"executor": "eager"})
    assert out is not given and given.decode_compile_config is None
    assert out.num_blocks == 8 and out.varlen_compile_config.backend == "inductor"
    assert out.decode_compile_config.backend == "ep_fuse"
    assert serve.with_ep_fuse_compile(None).varlen_compile_config.backend == "ep_fuse"


def test_hf_cuda_graph_decision_reads_our_compile_configs(monkeypatch):
    """On a CUDA machine HF decides ``use_cuda_graph`` from the compile configs' ``options`` (``options.get``): it
    crashed on ``options=None`` (found on an H200); here the accelerator check is forced on."""
    from transformers.generation.continuous_batching import initialization

    monkeypatch.setattr(initialization, "get_accelerator_graph_name", lambda: "cuda")
    cfg = serve.with_ep_fuse_compile(None, {"executor": "eager"})
    initialization.decide_use_cuda_graphs(cfg, is_attn_mask_needed=True, cuda_graph_requested=False)
    assert cfg.use_cuda_graph == (False, False)  # HF's own rule for masked attention, when nobody asked
    cfg = serve.with_ep_fuse_compile(None, use_cuda_graph=True)
    initialization.decide_use_cuda_graphs(cfg, is_attn_mask_needed=True, cuda_graph_requested=False)
    assert cfg.use_cuda_graph == (True, True)
    off = transformers.ContinuousBatchingConfig(use_cuda_graph=False)
    assert serve.with_ep_fuse_compile(off, use_cuda_graph=True).use_cuda_graph is False  # the caller's choice wins


def test_async_batching_follows_hf_rule_with_our_mask_decision(monkeypatch):
    """Asynchronous batching is turned on exactly where HF's own rule holds once the mask decision is ep_fuse's:
    CUDA graphs set on, the model on CUDA, its CB attention mask-free (``ep_fuse::varlen_attention``); a caller's
    explicit choice is kept and without ``model`` nothing changes (here "on CUDA" is forced)."""
    from ep_fuse.hf import varlen_attention

    model = tiny_models.build("qwen3_moe", dtype=torch.float32, num_hidden_layers=1)
    graphs = transformers.ContinuousBatchingConfig(use_cuda_graph=True)
    per_path = transformers.ContinuousBatchingConfig(use_cuda_graph=(True, False))
    assert serve.async_batching_reason(graphs, model) == "not on CUDA"
    monkeypatch.setattr(serve, "_on_cuda", lambda m: True)
    varlen_attention.disable(model)
    assert serve.async_batching_reason(graphs, model) == "the attention needs HF's mask"
    assert serve.with_ep_fuse_compile(graphs, model=model).use_async_batching is None  # HF decides (off for sdpa)
    try:
        assert varlen_attention.enable(model, force=True)
        assert serve.async_batching_reason(transformers.ContinuousBatchingConfig(), model) == "CUDA graphs not set on"
        assert serve.with_ep_fuse_compile(graphs, model=model).use_async_batching is True
        assert serve.with_ep_fuse_compile(per_path, model=model).use_async_batching is True
        assert serve.with_ep_fuse_compile(None, use_cuda_graph=True, model=model).use_async_batching is True
        assert serve.with_ep_fuse_compile(graphs).use_async_batching is None  # no model: nothing decided
        off = transformers.ContinuousBatchingConfig(use_cuda_graph=True, use_async_batching=False)
        assert serve.with_ep_fuse_compile(off, model=model).use_async_batching is False  # the caller's choice wins
    finally:
        varlen_attention.disable(model)


def test_prepare_for_serving_rejects_a_model_without_continuous_batching():
    with pytest.raises(serve.ServeError, match="no continuous batching"):
        serve.prepare_for_serving(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("argv, code, message", [
    (["m", "--no-such-option"], 2, "No such option"),
    (["m", "--ep-fuse-option", "executor"], 2, "KEY=VALUE"),
    (["m", "--ep-fuse-option", "no_such_key=1"], 2, "no_such_key"),
    ([], 2, "name the model"),
    (["/nonexistent/model/dir", "--device", "cpu"], 3, "cannot load"),
])
def test_cli_errors(argv, code, message, capsys):
    assert serve.main(argv) == code
    assert message in capsys.readouterr().err


def test_cli_routes_serve_to_ep_fuse_serve(capsys):
    from ep_fuse import cli

    assert cli.main(["serve", "m", "--no-such-option"]) == 2
    assert "No such option" in capsys.readouterr().err


def test_an_untested_server_assembly_names_the_releases_that_work(monkeypatch):
    import inspect

    monkeypatch.setattr(inspect, "getsource", lambda obj: "def __init__(self):\n    self.run()\n")
    with pytest.raises(serve.ServeError, match=r"5\.24 and 5\.25.*transformers==5\.24\.\* or transformers==5\.25") as err:
        serve._assembly()
    assert err.value.code == 2
    assert serve.main(["m"]) == 2


@pytest.mark.skipif(not ENGINE, reason="transformers 5.25's engine process loads with a pickled ModelLoader")
def test_the_engine_loader_pickles_and_prepares_in_the_engine(model_dir):
    """What HF 5.25 sends to its spawned engine: ``partial(loader.load_model_and_processor, model_id)``."""
    import functools

    from transformers.cli.serving.model_manager import ModelLoader

    loader = serve.EngineLoader(ModelLoader(device="cpu", dtype="float32"), {"executor": "eager"})
    load = pickle.loads(pickle.dumps(functools.partial(loader.load_model_and_processor, model_dir)))
    assert load.func.__self__.options == {"executor": "eager"} and load.func.__self__.dtype is torch.float32
    model, processor = load(on_progress=None)
    assert model._ep_fuse_serving == {"executor": "eager"} and processor is not None
    config, _ = loader.load_config(model_dir)  # the API server's side: HF's loader
    assert config.model_type == "qwen3_moe"


# --------------------------------------------------------------------------- with a server
def test_concurrent_requests_equal_eager(server, eager):
    jobs = [("chat", p) for p in PROMPTS] + [("completion", p) for p in PROMPTS]
    with cf.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(chat if kind == "chat" else complete, server, p) for kind, p in jobs]
        results = [f.result() for f in futures]
    for (kind, prompt), res in zip(jobs, results):
        if kind == "chat":
            got, want = res.choices[0].message.content, eager.chat(prompt)
        else:
            got, want = res.choices[0].text, eager.completion(prompt)
        assert got == want, (kind, prompt)
    if not server.compiled:
        assert not ep_fuse.reports()
        return
    counts = engine_counts(server)
    assert counts.get("moe_experts", 0) >= 1 and counts.get("moe_gating", 0) >= 1, counts
    assert set(counts) <= {"moe_experts", "moe_gating", "rms_norm", "add_rms_norm", "rope"}, counts


def test_streaming_arrives_token_by_token(server):
    for prompt in ("the quick brown fox", "hello world"):
        whole = chat(server, prompt).choices[0].message.content
        pieces = [c.choices[0].delta.content for c in chat(server, prompt, stream=True)
                  if c.choices and c.choices[0].delta.content]
        assert len(pieces) > 1 and "".join(pieces) == whole
        text = complete(server, prompt).choices[0].text
        pieces = [c.choices[0].text for c in complete(server, prompt, stream=True) if c.choices and c.choices[0].text]
        assert len(pieces) > 1 and "".join(pieces) == text


def _disconnect_mid_stream(srv) -> int:
    """Open a streamed chat completion, read its first event, hang up; returns the bytes read."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=120)
    body = {"model": srv.model, "messages": [{"role": "user", "content": "hang up"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.fp.readline()
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    return len(first)


def test_bad_requests_get_errors_and_lose_no_other_request(server, eager):
    with cf.ThreadPoolExecutor(8) as pool:
        good = [pool.submit(complete, server, p) for p in PROMPTS[:4]]
        malformed = pool.submit(post, server, "/v1/chat/completions", b"{not json")
        unknown = pool.submit(post, server, "/v1/chat/completions",
                              json.dumps({"model": server.model, "messages": [], "no_such_field": 1}).encode())
        oversized = pool.submit(complete, server, "x" * 2000)
        hang_up = pool.submit(_disconnect_mid_stream, server)
        assert malformed.result()[0] in (400, 422)
        status, text = unknown.result()
        assert status == 422 and "no_such_field" in text
        with pytest.raises(openai.BadRequestError) as err:
            oversized.result()
        # 5.25 refuses a prompt past the model's context (128 tokens here) before the KV cache (1536) is asked
        assert ("--max-model-len" if ENGINE else "KV cache") in err.value.response.text
        with pytest.raises(openai.BadRequestError) as err:
            chat(server, "y" * 2000, stream=True)
        assert ("at most 128" if ENGINE else "raise --cb-num-blocks") in err.value.response.text
        assert hang_up.result() > 0
        for prompt, fut in zip(PROMPTS, good):
            assert fut.result().choices[0].text == eager.completion(prompt)
    assert chat(server, "still there?").choices[0].message.content == eager.chat("still there?")
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out |= {int(c) for c in f.read().split()}
    return out


def test_shutdown_is_clean(server):
    if ENGINE:
        engines = _children(server.process.pid)
        assert engines, "5.25 runs the model in an engine process of the server's"
        serve.stop(server)
        assert not server.process.is_alive() and server.process.exitcode == 0
        deadline = time.monotonic() + 20
        while any(os.path.exists(f"/proc/{p}") for p in engines) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{p}") for p in engines), "the engine process outlived its server"
        _port_is_free(server.port)
        return
    before = {t.name for t in threading.enumerate()}
    assert "uvicorn-thread" in before
    serve.stop(server)
    assert not server._thread.is_alive()
    # AnyIO's worker threads (sync endpoints such as /health run there) end within their 10 s idle time
    deadline = time.monotonic() + 20
    while True:
        leftover = [t for t in threading.enumerate() if t.is_alive() and not t.daemon
                    and t is not threading.main_thread() and t not in server.threads_before]
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leftover, [t.name for t in leftover]
    _port_is_free(server.port)


def _port_is_free(port: int) -> None:
    with socket.socket() as s:  # nothing listens on the port any more
        assert s.connect_ex(("127.0.0.1", port)) != 0
    with socket.socket() as s:  # and it can be listened on again (connections of the tests may sit in TIME_WAIT)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@pytest.mark.slow
def test_inductor_executor_equals_eager(model_dir, eager):
    """The full path: ep_fuse's rewrite compiled by Inductor in both continuous-batching paths."""
    torch._dynamo.reset()
    port = free_port()
    srv = serve.start(model_dir, {}, host="127.0.0.1", port=port, device="cpu", dtype="float32", **CB)
    srv.port, srv.model = port, model_dir
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: complete(srv, p), PROMPTS[:4]))
        for prompt, res in zip(PROMPTS, results):
            assert res.choices[0].text == eager.completion(prompt)
    finally:
        serve.stop(srv)
