"""The OpenAI-compatible server (nbmoe.server) on the loopback, with the default model:
the official openai client, two clients at once, a client that goes away, bad requests."""
import json
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

KEY = "test-key"
HI = [{"role": "user", "content": "What is the capital of France?"}]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_path):
    """The default model with 2 slots of 512 tokens, served from a thread; yields its URL."""
    import nbmoe
    from nbmoe.loader.default_model import default_model_path
    from nbmoe.server.app import create_app
    llm = nbmoe.load(default_model_path(), n_ctx=1024, threads=2, n_slots=2)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(llm, alias="smol", api_key=KEY), host="127.0.0.1",
                                        port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        assert thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", llm
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server[0] + path, content=data, headers=headers, timeout=60, **kw)


# Compared replies come from the same cache state: a prompt evaluated in one batch and one
# whose last token is evaluated alone after its cached prefix can differ in their last
# digits (8-bit x in one-token products), enough to change a near-tie at temperature 0. So
# each prompt is asked once first, and the compared requests all reuse its cached prefix.

def test_openai_client_chat_and_completions(server, client):
    from nbmoe.text.chat_template import chat_prompt_ids
    llm = server[1]
    client.chat.completions.create(model="smol", messages=HI, max_tokens=8, temperature=0)
    r = client.chat.completions.create(model="smol", messages=HI, max_tokens=8, temperature=0)
    text = r.choices[0].message.content
    assert text.strip() and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(chat_prompt_ids(llm.tokenizer, HI))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens <= r.usage.prompt_tokens + 8
    chunks = list(client.chat.completions.create(model="smol", messages=HI, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    # completions: the raw prompt, no template; the last 2 of 6 tokens cut by max_tokens
    client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    c = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 6
    streamed = "".join(x.choices[0].text for x in client.completions.create(
        model="smol", prompt="The capital of France is", max_tokens=6, temperature=0, stream=True))
    assert streamed == c.choices[0].text
    # a stop string: the text before it, none of it
    word = c.choices[0].text.split()[1]
    s = client.completions.create(model="smol", prompt="The capital of France is", max_tokens=6,
                                  temperature=0, stop=[word, "zzz"])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text == c.choices[0].text.split(word)[0]
    assert [m.id for m in client.models.list().data] == ["smol"]
    # llama-server's ignore_eos: past the end-of-generation tokens, to max_tokens
    e = client.chat.completions.create(model="smol", messages=HI, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert e.choices[0].finish_reason == "length" and e.usage.completion_tokens == 24


def test_two_clients_at_once(server, client):
    prompts = ["My three favourite colors are", "Counting from one to ten: one,"]
    ask = dict(model="smol", max_tokens=12, temperature=0, stream=True)
    alone = [["".join(c.choices[0].text for c in client.completions.create(prompt=p, **ask))
              for p in prompts] for _ in range(2)][1]     # (the first round fills the slots)
    got, first, done = [None, None], [None, None], [None, None]

    def run(i):
        pieces = []
        for c in client.completions.create(prompt=prompts[i], **ask):
            if c.choices[0].text:
                first[i] = first[i] or time.perf_counter()
                pieces.append(c.choices[0].text)
        done[i], got[i] = time.perf_counter(), "".join(pieces)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == alone
    assert first[0] < done[1] and first[1] < done[0]      # both made progress
    assert any(key[-1] == "rows" for key in server[1]._plans)     # their tokens in one batch


def test_a_client_that_goes_away_frees_its_slot(server, client):
    body = dict(model="smol", prompt="Once upon a time", max_tokens=400, temperature=0, stream=True)
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    t0 = time.perf_counter()
    while httpx.get(server[0] + "/health").json()["slots_processing"]:
        assert time.perf_counter() - t0 < 15, "the slot was not freed"
        time.sleep(0.05)
    assert server[1].slots[0].tokens or server[1].slots[1].tokens
    assert len(max(server[1].slots[0].tokens, server[1].slots[1].tokens, key=len)) < 200   # stopped early
    r = client.completions.create(model="smol", prompt="Once upon a time", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize("path,body,key,status,message", [
    ("/v1/chat/completions", "{not json", KEY, 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": "smol"}, KEY, 400, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": HI, "temperature": "hot"}, KEY, 400, "'temperature' must be a number"),
    ("/v1/chat/completions", {"messages": HI, "n": 2}, KEY, 400, "'n' must be 1"),
    ("/v1/completions", {"prompt": 5}, KEY, 400, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": "Hi", "ignore_eos": "yes"}, KEY, 400, "'ignore_eos' must be"),
    ("/v1/chat/completions", {"messages": HI, "model": "gpt-4"}, KEY, 404, "the model 'gpt-4' does not exist"),
    ("/v1/completions", {"prompt": "word " * 600}, KEY, 400, "exceed a slot's context of 512"),
    ("/v1/completions", {"prompt": "Hi " * 20, "max_tokens": 500}, KEY, 400, "plus max_tokens 500 exceed"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 100000}, KEY, 400, "max_tokens is 100000, more than"),
    ("/v1/chat/completions", {"messages": HI}, "wrong", 401, "invalid or missing API key"),
    ("/v1/chat/completions", {"messages": HI}, None, 401, "invalid or missing API key"),
    ("/v1/nothing", {}, KEY, 404, "Not Found"),
])
def test_bad_requests(server, path, body, key, status, message):
    r = post(server, path, body, key)
    assert r.status_code == status
    err = r.json()["error"]
    assert message in err["message"] and err["type"]
    if status == 404 and "model" in err["message"]:
        assert err["code"] == "model_not_found"
    # the server goes on serving; the model answers to its alias, its file name, or no name
    llm = server[1]
    import os
    for model in ("smol", os.path.basename(llm.path), None):
        ok = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "temperature": 0,
                                              **({"model": model} if model else {})})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 1
        if status != 404:
            break


def test_health_needs_no_key(server):
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"


def test_bad_model_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    r = subprocess.run([sys.executable, "-m", "nbmoe.server", "-m", str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1


# ---- the parts without a server: stop strings, the worker's reply text ----------------------

def test_stop_strings_are_held_back():
    from nbmoe.server.stops import StopScanner
    s = StopScanner(["</s>", "STOP"])
    assert s.push("Hello <") == ("Hello ", False)      # "<" may begin "</s>"
    assert s.push("/x") == ("</x", False)
    assert s.push("ST") == ("", False) and s.held == "ST"
    assert s.push("OP and more") == ("", True)
    t = StopScanner(["STOP"])
    assert t.push("a ST") == ("a ", False) and t.flush() == "ST"       # the end releases it


class ScriptedEngine:
    """Stands in for the engine in SlotWorker: its logits pick the ids of a fixed reply."""

    def __init__(self, tokenizer, reply):
        from types import SimpleNamespace
        self.tokenizer, self.n_ctx, self.n_ubatch = tokenizer, 4096, 512
        self.reply_ids, self.slots, self.slot = tokenizer.encode(reply), [SimpleNamespace(tokens=[])], 0
        self.step = 0

    tokens = property(lambda self: self.slots[self.slot].tokens)

    def use_slot(self, i):
        self.slot = i

    def reuse_prefix(self, ids):
        self.slots[self.slot].tokens, self.step = [], 0
        return ids

    def eval_last(self, ids):
        import numpy as np
        self.tokens.extend(ids)
        logits = np.zeros(len(self.tokenizer.tokens), np.float32)
        logits[self.reply_ids[self.step]] = 1.0
        self.step += 1
        return logits

    def decode_slots(self, rows):
        import numpy as np
        out = []
        for slot, tok in rows:
            self.use_slot(slot)
            out.append(self.eval_last([tok]))
        return np.stack(out)


@pytest.mark.parametrize("batch", [True, False])
@pytest.mark.parametrize("stop,text", [([], "Six — ünïcödé 😀."), (["ünï", "zz"], "Six — ")])
def test_worker_answers_with_the_final_channel(stop, text, batch):
    """gpt-oss: the reasoning is not the answer; a stop string inside the answer cuts it."""
    from test_harmony import REPLY, harmony_tokenizer
    from nbmoe.server.protocol import Request, SamplingParams
    from nbmoe.server.slots import Job, SlotWorker
    engine = ScriptedEngine(harmony_tokenizer(), REPLY)
    events, done = [], threading.Event()
    req = Request(chat=True, model=None, prompt_ids=[1, 2, 3], stop=stop,
                  sampling=SamplingParams(temperature=0))

    def emit(ev):
        events.append(ev)
        if ev[0] != "text":
            done.set()
    worker = SlotWorker(engine, batch)
    worker.submit(Job(req, emit))
    assert done.wait(10)
    worker.close()
    assert "".join(e[1] for e in events if e[0] == "text") == text
    assert events[-1][:2] == ("done", "stop")


def test_batching_is_off_for_experts_in_ram_beside_a_gpu():
    """-cb / -nocb, and by default batched decoding unless MoE experts live in RAM while a GPU
    runs the rest (there a batch's tokens read as many expert bytes as turns)."""
    from nbmoe.server.__main__ import parse_args
    from types import SimpleNamespace
    from nbmoe.server.slots import batch_decoding
    assert [parse_args(a).batch for a in ([], ["-cb"], ["-nocb"])] == [None, True, False]
    hybrid = {"blk.0.ffn_up_exps.weight": ("CPU", "-ot"), "blk.0.attn_q.weight": ("CUDA0", "-ngl")}
    on_gpu = {name: ("CUDA0", "-ngl") for name in hybrid}
    gpu, cpu = {"CPU": None, "CUDA0": None}, {"CPU": None}
    assert not batch_decoding(SimpleNamespace(backends=gpu, placement=hybrid))
    assert batch_decoding(SimpleNamespace(backends=gpu, placement=on_gpu))
    assert batch_decoding(SimpleNamespace(backends=cpu, placement=hybrid))
