"""`python -m kvnumba serve`'s app, served by uvicorn on a free loopback port: a tiny
random Llama and a word-level tokenizer with a chat template, saved in a directory and
loaded as the command line loads them; driven by the official `openai` client and raw
HTTP. Every text is checked against `model.generate()` on the same tokenizer and
template (greedy); n, stop and seed; concurrent streams; a client leaving mid-stream;
malformed requests and a full server (each 400 / 429, the next request exact);
`/metrics` read by `prometheus_client`'s parser. Tiny model, few tokens (the CUDA
simulator runs every step's kernels thread by thread)."""
import asyncio
import http.client
import json
import socket
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


def test_smoke(served, client, saved):
    ids = chat_ids(saved)
    expected, count = reference(saved, ids)
    out = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0)
    assert out.choices[0].message.content == expected
    assert out.usage.completion_tokens == count
    assert out.usage.prompt_tokens == len(ids)
