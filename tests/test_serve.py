"""`python -m kvnumba serve`'s app, served by uvicorn on a free loopback port: a tiny
random Llama and a word-level tokenizer with a chat template, saved in a directory and
loaded as the command line loads them; driven by the official `openai` client and raw
HTTP. Every text is checked against `model.generate()` on the same tokenizer and
template (greedy); n, stop and seed; concurrent streams; a client leaving mid-stream;
malformed requests and a full server (each 400 / 429, the next request exact);
`/metrics` read by `prometheus_client`'s parser. Tiny model, few tokens (the CUDA
simulator runs every step's kernels thread by thread)."""
import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
parser = pytest.importorskip("prometheus_client.parser")

from kvnumba.serve import load_server  # noqa: E402
from hfmodels import tiny  # noqa: E402

#: the tokenizer's words, one token each (ids in order); 2 is the model's eos
WORDS = ["<unk>", "<s>", "</s>", "user", "assistant", "system", ":"] + \
    [f"{a}{b}" for a in "bdfgkmnpst" for b in "aeiou"][:57]
TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> "
            "{% endfor %}{% if add_generation_prompt %}<s> assistant :{% endif %}")
NAME = "tiny"
MAX_SEQS = 8
CAPACITY = 48
NEW = 6
MESSAGES = [{"role": "system", "content": "ba be bi"},
            {"role": "user", "content": "da de di do"}]
PROMPT = "ka ke ki ko ku ma"


def word_tokenizer():
    """A word-level tokenizer over `WORDS` (split at spaces, joined by spaces), `<s>` and
    `</s>` its special tokens, with `TEMPLATE` as its chat template."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The model directory (weights, generation config with eos 2, tokenizer, template),
    and the model and tokenizer as `transformers` loads them back."""
    path = tmp_path_factory.mktemp("served") / NAME
    tiny("llama").save_pretrained(path, safe_serialization=True)
    word_tokenizer().save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    return path, model, transformers.AutoTokenizer.from_pretrained(path)


def start(app):
    """uvicorn serving `app` on a free loopback port in a thread: (base url, server)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


@pytest.fixture(scope="module")
def served(saved):
    """The server of `saved`'s directory, listening: (base url, `Server`)."""
    path = saved[0]
    server = load_server(str(path), max_seqs=MAX_SEQS, capacity=CAPACITY, max_waiting=64)
    url, uv, thread = start(server.app)
    yield url, server
    uv.should_exit = True
    thread.join(60)
    assert not server.loop.thread.is_alive(), "the engine loop outlived the server"


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="none", max_retries=0)


def reference(saved, ids, max_new=NEW):
    """`model.generate()`'s greedy text after token ids `ids` (the model's eos), and its
    token count."""
    _, model, tokenizer = saved
    prompt = torch.tensor([ids])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                         max_new_tokens=max_new, pad_token_id=0)[0, len(ids):].tolist()
    return tokenizer.decode(out, skip_special_tokens=True), len(out)


def chat_ids(saved, messages=MESSAGES):
    ids = saved[2].apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def post(url, path, body, raw=False):
    """POST `body` (JSON, or bytes as they are): (status, parsed JSON answer)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    data = body if raw else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    status, text = answer.status, answer.read()
    conn.close()
    return status, json.loads(text)


def get(url, path):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    answer = conn.getresponse()
    status, text = answer.status, answer.read().decode()
    conn.close()
    return status, text


def words(seed, count=5):
    """`count` distinct-looking words of the vocabulary (no special ones), as a prompt."""
    import random
    pick = random.Random(seed)
    return " ".join(WORDS[pick.randrange(7, len(WORDS))] for _ in range(count))


def streamed(chunks, chat):
    """The texts of a stream's choices joined, their finish reasons, and its usage."""
    texts, reasons, usage = {}, {}, None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


def test_chat_and_completions_streamed_or_not_are_generates_text(saved, client):
    ids = chat_ids(saved)
    expected, count = reference(saved, ids)
    assert expected.count(" ") >= 2          # a few words (no early eos)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0)
    assert out.choices[0].message.content == expected
    assert out.choices[0].finish_reason == ("length" if count == NEW else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), count)
    texts, reasons, usage = streamed(client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=NEW, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=True)
    assert texts == {0: expected} and reasons == {0: out.choices[0].finish_reason}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), count)

    prompt_ids = saved[2](PROMPT)["input_ids"]
    expected, count = reference(saved, prompt_ids, 4)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == expected and out.usage.completion_tokens == count
    texts, _, usage = streamed(client.completions.create(
        model=NAME, prompt=prompt_ids, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True}), chat=False)
    assert texts == {0: expected} and usage.prompt_tokens == len(prompt_ids)


def test_a_repeated_prompt_reports_its_cached_tokens(saved, served, client):
    messages = [{"role": "system", "content": words(1, 20)}, MESSAGES[1]]
    ids = chat_ids(saved, messages)
    page = served[1].engine.config.page_size
    expected, _ = reference(saved, ids, 2)
    cached = []
    for _ in range(2):
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2,
                                             temperature=0)
        assert out.choices[0].message.content == expected
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert len(ids) > page and cached[1] == (len(ids) - 1) // page * page


def test_n_choices_stop_strings_and_seeds(saved, client):
    prompt = words(2)
    expected, _ = reference(saved, saved[2](prompt)["input_ids"])
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW,
                                    temperature=0, n=2)
    assert [c.text for c in out.choices] == [expected, expected]
    assert out.usage.completion_tokens == 2 * NEW

    third = expected.split(" ")[2]      # stop at the third word, streamed or not
    stop = " " + third
    cut = expected[:expected.index(stop)]
    for stream in (False, True):
        answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=NEW,
                                           temperature=0, stop=[stop, "zz zz"], stream=stream)
        if stream:
            texts, reasons, _ = streamed(answer, chat=False)
        else:
            texts = {0: answer.choices[0].text}
            reasons = {0: answer.choices[0].finish_reason}
        assert texts == {0: cut} and reasons == {0: "stop"}

    def sampled(seed):
        out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3,
                                             temperature=1.0, seed=seed, n=2)
        return [c.message.content for c in out.choices]
    first = sampled(7)
    assert sampled(7) == first


def test_concurrent_streams_are_each_exact(saved, served):
    """More clients streaming at once than the sequences (10 over 8): two wait, every
    text exact."""
    clients = MAX_SEQS + 2
    prompts = [words(100 + i, 3 + i % 4) for i in range(clients)]
    expected = [reference(saved, saved[2](p)["input_ids"], 2)[0] for p in prompts]

    async def one(api, prompt):
        stream = await api.completions.create(model=NAME, prompt=prompt, max_tokens=2,
                                              temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_of_them():
        async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="none",
                                      max_retries=0) as api:
            return await asyncio.gather(*(one(api, p) for p in prompts))
    assert asyncio.run(all_of_them()) == expected


def open_stream(url, body):
    """A raw streaming request whose first event has arrived: (socket, that event)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=300)
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    seen = b""
    while b"data: " not in seen or not seen.rstrip().endswith(b"}"):
        got = sock.recv(65536)
        assert got, seen
        seen += got
    return sock, seen


def wait_idle(server):
    """Until the server holds no request (the engine loop has taken every cancel)."""
    deadline = time.monotonic() + 300
    while server.holding or server.loop.snapshot.running or server.loop.snapshot.waiting:
        assert time.monotonic() < deadline, "the server did not free its requests"
        time.sleep(0.05)


def metrics(url):
    status, text = get(url, "/metrics")
    assert status == 200
    return {s.name + "".join(f"[{v}]" for v in s.labels.values()): s.value
            for family in parser.text_string_to_metric_families(text)
            for s in family.samples}


def test_a_client_leaving_mid_stream_frees_its_sequence(saved, served, client):
    url, server = served
    before = metrics(url)
    sock, first = open_stream(url, dict(model=NAME, prompt=words(3), max_tokens=40,
                                        temperature=0))
    assert b'"text"' in first and b"[DONE]" not in first
    sock.close()
    wait_idle(server)
    after = metrics(url)
    assert after["kvnumba_cache_pages[held]"] == before["kvnumba_cache_pages[held]"]
    assert after["kvnumba_requests_running"] == 0
    generated = after["kvnumba_generation_tokens_total"] - \
        before["kvnumba_generation_tokens_total"]
    assert 1 <= generated < 40                 # cancelled before it finished
    expected, _ = reference(saved, saved[2](PROMPT)["input_ids"], 3)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == expected


BAD = [
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "JSON object"),
    ({"model": NAME, "prompt": "ba", "colour": 3}, "colour", "unknown field"),
    ({"model": NAME, "prompt": "ba", "temperature": -1}, "temperature", "at least 0"),
    ({"model": NAME, "prompt": "ba", "top_p": 0}, "top_p", "above 0"),
    ({"model": NAME, "prompt": "ba", "n": MAX_SEQS + 1}, "n", f"at most {MAX_SEQS}"),
    ({"model": NAME, "prompt": "ba", "max_tokens": 0}, "max_tokens", "at least 1"),
    ({"model": NAME, "prompt": "ba", "max_tokens": CAPACITY}, "max_tokens",
     f"at most {CAPACITY - 1}"),
    ({"model": NAME, "prompt": " ".join(["ba"] * CAPACITY)}, "prompt", "shorten"),
    ({"model": NAME, "prompt": [1, 99]}, "prompt", "outside the vocabulary"),
    ({"model": NAME, "prompt": "ba", "stop": ""}, "stop", "non-empty"),
    ({"model": NAME, "prompt": "ba", "seed": "x"}, "seed", "whole number"),
    ({"model": NAME, "prompt": "ba", "presence_penalty": 1}, "presence_penalty",
     "leave it out"),
    ({"model": NAME, "prompt": "ba", "stream_options": {"include_usage": True}},
     "stream_options", "stream=true"),
    ({"prompt": "ba"}, "model", "/v1/models"),
]


def test_malformed_requests_are_400_naming_the_field_and_serving_goes_on(saved, served,
                                                                        client):
    url = served[0]
    for body, param, words_ in BAD:
        status, answer = post(url, "/v1/completions", body, raw=isinstance(body, bytes))
        assert status == 400, (body, answer)
        error = answer["error"]
        assert error["param"] == param and words_ in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    status, answer = post(url, "/v1/chat/completions",
                          {"model": NAME, "messages": [{"role": "robot", "content": "x"}]})
    assert status == 400 and answer["error"]["param"] == "messages[0].role"
    status, answer = post(url, "/v1/completions", {"model": "other", "prompt": "ba"})
    assert status == 404 and answer["error"]["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=NAME, prompt="ba", max_tokens=CAPACITY)
    assert raised.value.param == "max_tokens"
    expected, _ = reference(saved, saved[2](PROMPT)["input_ids"], 3)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == expected


def test_a_full_server_answers_429_and_serves_once_free(saved, served, client):
    url, server = served
    server.max_waiting = 0
    try:
        sock, _ = open_stream(url, dict(model=NAME, prompt=words(4), max_tokens=40,
                                        temperature=1.0, n=MAX_SEQS))
        status, answer = post(url, "/v1/completions", {"model": NAME, "prompt": "ba"})
        assert status == 429 and answer["error"]["code"] == "queue_full"
        assert f"limit of {MAX_SEQS}" in answer["error"]["message"]
        assert "--max-waiting" in answer["error"]["message"]
        sock.close()
        wait_idle(server)
    finally:
        server.max_waiting = 64
    expected, _ = reference(saved, saved[2](PROMPT)["input_ids"], 3)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    assert out.choices[0].text == expected


def test_metrics_models_and_health(saved, served, client):
    url, server = served
    before = metrics(url)
    out = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0)
    after = metrics(url)
    assert after["kvnumba_generation_tokens_total"] - \
        before["kvnumba_generation_tokens_total"] == out.usage.completion_tokens
    assert after["kvnumba_step_seconds_count"] > before["kvnumba_step_seconds_count"]
    assert after["kvnumba_requests_running"] == after["kvnumba_requests_waiting"] == 0
    pages = [after[f"kvnumba_cache_pages[{s}]"] for s in ("held", "cached", "free")]
    total = sum(p.max_pages for p in server.engine.target.cache.pool_pages())
    assert sum(pages) == total and pages[0] >= 1
    stats = server.engine.stats
    assert after["kvnumba_prefix_cache_hit_rate"] == pytest.approx(stats.hit_rate)
    assert after["kvnumba_draft_acceptance_rate"] == 0.0
    assert [m.id for m in client.models.list()] == [NAME]
    assert get(url, "/health") == (200, '{"status":"ok"}')


@contextlib.contextmanager
def listening(command: list):
    """`command` plus `--port P` (a free port) started, yielded as `(process, url)` once
    its `/health` answers; killed if it is still running after the block."""
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command + ["--port", str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if get(f"http://127.0.0.1:{port}", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()


def completed(saved, url, prompt=PROMPT, max_new=2):
    """Whether `/v1/completions` of `prompt` answers `model.generate()`'s text."""
    expected, _ = reference(saved, saved[2](prompt)["input_ids"], max_new)
    status, answer = post(url, "/v1/completions", {"model": NAME, "prompt": prompt,
                                                   "max_tokens": max_new, "temperature": 0})
    return status == 200 and answer["choices"][0]["text"] == expected


SERVE = [sys.executable, "-m", "kvnumba", "serve", "--max-seqs", "2", "--capacity", "32",
         "--no-verify"]


def test_the_command_line_serves_until_sigterm_and_stops_cleanly(saved):
    with listening(SERVE + ["--model", str(saved[0])]) as (process, url):
        assert completed(saved, url)
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err


def launched(parent: int) -> dict:
    """The processes torchrun `parent` started, by their `RANK` (read from /proc)."""
    ranks = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            stat = open(f"/proc/{pid}/stat").read()
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                rank = dict(e.split(b"=", 1) for e in environ if b"=" in e)[b"RANK"]
                ranks[int(rank)] = int(pid)
    return ranks


def test_a_model_split_over_two_ranks_serves_idles_and_stops_on_sigterm(saved):
    # torchrun: rank 0 serves HTTP, rank 1 follows its steps; idle past --rank-timeout
    # (rank 0's empty steps keep rank 1's waits short), then SIGTERM to rank 0 stops both
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m"] + SERVE[2:]
    with listening(torchrun + ["--model", str(saved[0]), "--rank-timeout", "2"]) as \
            (process, url):
        assert completed(saved, url)
        time.sleep(4)
        assert completed(saved, url, words(4), 3)
        ranks = launched(process.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[0], signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err, err
    assert err.count("serving 'tiny' on") == 1          # rank 0 alone


def test_ranks_that_lost_each_other_end_the_requests_and_the_loop(saved, monkeypatch):
    # a step raising RankFailureError (a split model's ranks lost each other) ends the
    # engine loop: the request in flight answers 500 naming it, /health answers 503
    import kvnumba as kv
    server = load_server(str(saved[0]), max_seqs=2, capacity=32, verify=False)
    lost = "step 3: the ranks lost each other (...); restart the job"

    def losing():
        raise kv.RankFailureError(lost)
    monkeypatch.setattr(server.engine, "stream_step", losing)
    url, uv, thread = start(server.app)
    try:
        status, answer = post(url, "/v1/completions", {"model": NAME, "prompt": PROMPT,
                                                       "max_tokens": 2})
        assert status == 500 and lost in answer["error"]["message"]
        assert get(url, "/health")[0] == 503
        assert isinstance(server.loop.error, kv.RankFailureError)
    finally:
        uv.should_exit = True
        thread.join(60)


def test_a_command_line_mistake_is_one_line_and_exit_status_2(tmp_path):
    from kvnumba.__main__ import main
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert err.getvalue().count("\n") == 1 and "no such directory" in err.getvalue()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    assert "a port number from 0 to 65535" in err.getvalue()
