"""The OpenAI-compatible server under load: `python -m kvnumba serve`'s app on loopback
against direct calls of the same engine, in the same run.

A random Llama-shaped model and a word-level tokenizer, saved in a temporary directory
and loaded as `python -m kvnumba serve --model DIR` loads them; uvicorn serves the app on
a free 127.0.0.1 port. `CLIENTS` threads each stream `REQUESTS` completions one after
another over raw HTTP (server-sent events, greedy, `NEW` tokens each, every prompt of
`PROMPT` tokens); the same requests, submitted together, are then run on a second engine
of the same model by direct `Engine.submit` / `Engine.stream_step` calls, the way the
server's engine loop runs them. Reported: requests/s, time to first token and the time
between streamed tokens (percentiles 50, 90 and 99), and the server's time per request
and per streamed token as ratios against the direct run's (1.0: the server adds nothing).
Needs the `serve` extra (PyTorch, transformers, Starlette, uvicorn); on the CUDA
simulator every step runs its kernels thread by thread, so only `--quick`'s sizes are
practical there, and the ratios then mostly measure the simulator's steps.

    python -m kvnumba.bench.serve [--quick] [--json PATH]
"""
from __future__ import annotations

import http.client
import json
import socket
import statistics
import tempfile
import threading
import time

import kvnumba.device as kv_device

from .command import section_main
from .prerequisites import missing_packages

CLIENTS, REQUESTS, PROMPT, NEW = 16, 4, 32, 16
QUICK = dict(clients=2, requests=1, prompt=8, new=3)
#: the tokenizer's words, one token each (ids in order; 2 is the eos)
WORDS = ["<unk>", "<s>", "</s>"] + [f"{a}{b}" for a in "bdfgkmnpst" for b in "aeiou"][:61]


def saved_model(folder: str) -> None:
    """A random two-layer Llama over `WORDS` and its word-level tokenizer, saved in
    `folder`."""
    import tokenizers
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(WORDS), hidden_size=64,
                                      intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, eos_token_id=2,
                                      bos_token_id=1, pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def serving(app):
    """uvicorn serving `app` on a free loopback port in a thread: `(port, server, thread)`."""
    import uvicorn
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return sock.getsockname()[1], server, thread


def streamed(port: int, prompt: str, new: int) -> tuple:
    """One streamed completion: `(seconds to its first text, seconds between its texts,
    seconds in all, tokens)` (the tokens as its usage counts them)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    body = dict(model="bench", prompt=prompt, max_tokens=new, temperature=0, stream=True,
                stream_options=dict(include_usage=True))
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body).encode(),
                 {"Content-Type": "application/json"})
    answer = conn.getresponse()
    if answer.status != 200:
        raise RuntimeError(f"the server answered {answer.status}: {answer.read()[:200]}")
    stamps, tokens = [], 0
    for line in answer:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if chunk["choices"] and chunk["choices"][0]["text"]:
            stamps.append(time.perf_counter())
    conn.close()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return stamps[0] - start, gaps, time.perf_counter() - start, tokens


def direct(engine, prompts: list, new: int, eos) -> tuple:
    """The same requests through `engine`'s own calls: `(seconds in all, tokens)`."""
    start = time.perf_counter()
    for ids in prompts:
        engine.submit(ids, max_new_tokens=new, temperature=0.0, eos_token_id=eos)
    tokens = 0
    while engine.busy:
        tokens += sum(sum(map(len, update.tokens)) for update in engine.stream_step())
    return time.perf_counter() - start, tokens


def percentiles(values: list) -> dict:
    if len(values) < 2:
        return {f"p{q}": (values[0] if values else None) for q in (50, 90, 99)}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def run(quick: bool = False) -> dict:
    """Serve under load, then the same requests directly; the figures as a dict."""
    missing = missing_packages("serve", ("torch", "transformers", "starlette", "uvicorn"),
                               "serve", "PyTorch, transformers, Starlette and uvicorn")
    if missing is not None:
        raise missing
    from kvnumba.hf import Engine
    from kvnumba.serve import load_server
    sizes = QUICK if quick else dict(clients=CLIENTS, requests=REQUESTS, prompt=PROMPT,
                                     new=NEW)
    clients, requests, new = sizes["clients"], sizes["requests"], sizes["new"]
    words = WORDS[3:]
    prompts = [" ".join(words[(c * 7 + r * 3 + i) % len(words)] for i in range(sizes["prompt"]))
               for c in range(clients) for r in range(requests)]
    options = dict(max_seqs=clients, capacity=2 * (sizes["prompt"] + new) + 16)
    with tempfile.TemporaryDirectory() as folder:
        saved_model(folder)
        server = load_server(folder, name="bench", max_waiting=clients, **options)
        port, uv, thread = serving(server.app)
        try:
            streamed(port, prompts[0], 2)                      # compiles, warms the paths
            results, failures = [None] * len(prompts), []

            def client(c):
                try:
                    for r in range(requests):
                        results[c * requests + r] = streamed(port, prompts[c * requests + r],
                                                             new)
                except Exception as exc:            # noqa: BLE001 (reported below)
                    failures.append(exc)
            start = time.perf_counter()
            threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            served_s = time.perf_counter() - start
        finally:
            uv.should_exit = True
            thread.join(60)
        if failures:
            raise failures[0]
        tokenizer, model = server.tokenizer, server.engine.target.model
        engine = Engine(model, **options)
        ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
        direct(engine, ids[:1], 2, server.eos)
        direct_s, direct_tokens = direct(engine, ids, new, server.eos)
    tokens = sum(r[3] for r in results)
    return dict(device=kv_device.KIND, quick=quick, clients=clients, requests=len(prompts),
                prompt_tokens=sizes["prompt"], new_tokens=new, served_s=served_s,
                requests_per_s=len(prompts) / served_s,
                ttft_s=percentiles([r[0] for r in results]),
                inter_token_s=percentiles([g for r in results for g in r[1]]),
                served_tokens=tokens, direct_s=direct_s, direct_tokens=direct_tokens,
                request_ratio=(served_s / len(prompts)) / (direct_s / len(prompts)),
                token_ratio=(served_s / tokens) / (direct_s / direct_tokens))


def _ms(value) -> str:
    return "-" if value is None else f"{1e3 * value:.1f}"


def report(result: dict) -> str:
    ttft, itl = result["ttft_s"], result["inter_token_s"]
    return "\n".join([
        f"serve: {result['clients']} clients, {result['requests']} streamed completions of "
        f"{result['prompt_tokens']} + {result['new_tokens']} tokens, device "
        f"{result['device']}",
        f"  requests/s {result['requests_per_s']:.2f}; time to first token ms p50 "
        f"{_ms(ttft['p50'])} p90 {_ms(ttft['p90'])} p99 {_ms(ttft['p99'])}; between "
        f"tokens ms p50 {_ms(itl['p50'])} p90 {_ms(itl['p90'])} p99 {_ms(itl['p99'])}",
        f"  served {result['served_s']:.2f} s for {result['served_tokens']} tokens, direct "
        f"engine calls {result['direct_s']:.2f} s for {result['direct_tokens']}: the "
        f"server's time per request {result['request_ratio']:.2f}x, per streamed token "
        f"{result['token_ratio']:.2f}x the direct run's"])


def main(argv=None) -> int:
    return section_main(argv, "python -m kvnumba.bench.serve", __doc__, run, report,
                        "two clients, one short request each")


if __name__ == "__main__":
    raise SystemExit(main())
