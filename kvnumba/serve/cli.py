"""`python -m kvnumba serve --model DIR`: a local `transformers` model directory
(weights, tokenizer, chat template) served over OpenAI's API by uvicorn, the engine's
options on the command line (`parser`), the model loaded once (`load_server`).

A mistake of the user's (a bad option, a missing directory, a model kvnumba refuses) is
one line on stderr and exit status 2, before anything listens. SIGINT and SIGTERM stop
the server: it stops taking connections, ends the streams in flight (after
`--graceful-s` seconds at most) and stops the engine loop.

Under torchrun the model is split over the ranks by its tensor-parallel plan: rank 0
serves HTTP and its engine leads, the other ranks' engines `follow` its steps (ignoring
SIGINT and SIGTERM: they return when rank 0's engine closes, as its server stops), and
while no request runs rank 0 takes an empty step every quarter of `--rank-timeout`, so
the other ranks' waits never run out."""
from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from importlib.util import find_spec
from pathlib import Path

from .. import device
from ..config import DTYPES
from ..errors import KVCacheError
from ..hf.cli import (Parser, UsageError, _number, check_directory, count, has_tokenizer,
                      load, refused, split_needs)
from ..hf.engine import RANK_TIMEOUT
from ..hf.sharding import launched_rank, launched_ranks, split_loading
from ..hf.speculative import DRAFT_LEN

PROG = "python -m kvnumba serve"
port = _number(int, "a port number from 0 to 65535", lambda v: 0 <= v <= 65535)
size = _number(int, "a whole number of bytes of at least 1 (e.g. 2000000000)",
               lambda v: v >= 1)
seconds = _number(float, "a number of seconds of at least 0", lambda v: v >= 0)
waiting = _number(int, "a whole number of at least 0", lambda v: v >= 0)


def parser() -> Parser:
    """The options of `python -m kvnumba serve`."""
    p = Parser(prog=PROG, description="Serve a local transformers model directory over "
                                      "OpenAI's API through kvnumba.hf.Engine.")
    p.add_argument("--model", metavar="DIR", required=True,
                   help="a local transformers model directory: config.json, safetensors "
                        "weights, a tokenizer (a chat template for /v1/chat/completions)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on "
                                                       "(default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="the port (default 8000)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in requests and /v1/models (default: the "
                        "directory's name)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="K/V storage dtype (default: the model's)")
    p.add_argument("--max-seqs", type=count, default=8, metavar="N",
                   help="sequences generated at once (default 8; a request with n > 1 "
                        "takes n)")
    p.add_argument("--capacity", type=count, default=2048, metavar="N",
                   help="the most positions of one sequence, prompt and completion "
                        "(default 2048)")
    p.add_argument("--kv-bytes", type=size, metavar="BYTES",
                   help="a fixed byte budget for the K/V storage of every cache (default: "
                        "pools that grow as needed)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full (default: reuse prompt prefixes "
                        "other requests computed)")
    p.add_argument("--draft", metavar="DIR",
                   help="a draft model directory with the model's vocabulary "
                        "(speculative decoding)")
    p.add_argument("--draft-len", type=count, default=DRAFT_LEN, metavar="K",
                   help=f"draft tokens proposed per step (default {DRAFT_LEN})")
    p.add_argument("--max-waiting", type=waiting, default=64, metavar="N",
                   help="sequences that may wait beyond --max-seqs; a request past them "
                        "gets HTTP 429 (default 64)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the probe that checks the model through kvnumba against its "
                        "own attention before serving")
    p.add_argument("--rank-timeout", type=seconds, default=RANK_TIMEOUT, metavar="S",
                   help=f"under torchrun, the most seconds a rank waits for the others "
                        f"(default {RANK_TIMEOUT:g})")
    p.add_argument("--graceful-s", type=seconds, default=5.0, metavar="S",
                   help="on SIGINT / SIGTERM, the most seconds the streams in flight may "
                        "go on (default 5)")
    return p


def load_server(model: str, *, name: str | None = None, draft: str | None = None,
                max_waiting: int = 64, **engine_options):
    """A `Server` of the model directory `model` (its tokenizer and eos ids too), its
    `Engine` made with `engine_options` (and `draft`, a draft model directory)."""
    import transformers

    from ..hf import Engine
    from .app import Server
    check_directory(model, "--model")
    if not has_tokenizer(model):
        raise UsageError(f"--model {model}: no tokenizer (tokenizer.json, "
                         f"tokenizer_config.json); save one into the directory "
                         f"(tokenizer.save_pretrained(DIR))")
    if draft:
        check_directory(draft, "--draft")
    tokenizer = load(transformers.AutoTokenizer, model, "--model")
    split = split_loading() if launched_ranks() > 1 else {}
    loaded = load(transformers.AutoModelForCausalLM, model, "--model", **split).eval()
    draft_model = load(transformers.AutoModelForCausalLM, draft, "--draft", **split).eval() \
        if draft else None
    eos = loaded.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    engine = Engine(loaded, draft_model=draft_model, **engine_options)
    return Server(engine, tokenizer, name=name or Path(model).resolve().name, eos=eos,
                  max_waiting=max_waiting)


def stopping(base):
    """`uvicorn.Server` (`base`) whose SIGINT and SIGTERM stop it and end the process with
    exit status 0 (a second signal stops at once), rather than raise the signal again
    once stopped."""
    class Stopping(base):
        @contextlib.contextmanager
        def capture_signals(self):
            wanted = (signal.SIGINT, signal.SIGTERM)
            before = {sig: signal.signal(sig, self.handle_exit) for sig in wanted}
            try:
                yield
            finally:
                for sig, handler in before.items():
                    signal.signal(sig, handler)
    return Stopping


def follow(engine) -> int:
    """A rank other than 0: follow rank 0's engine until it closes (SIGINT and SIGTERM
    ignored meanwhile: rank 0 stops the job); exit status 0."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    engine.follow()
    return 0


def main(argv=None) -> int:
    """`python -m kvnumba serve [options]`: serve until SIGINT / SIGTERM; exit status 0,
    or 2 on a user error (one line on stderr)."""
    try:
        args = parser().parse_args(argv)
        needed = ("torch", "transformers", "starlette", "uvicorn", "prometheus_client") + \
            split_needs()
        missing = [name for name in needed if find_spec(name) is None]
        if missing:
            raise UsageError(f"needs the serve extra ({', '.join(missing)} not installed): "
                             f"python -m pip install -e '.[serve]' in a kvnumba checkout")
        import uvicorn
        if not sys.stderr.isatty():
            import transformers
            transformers.utils.logging.disable_progress_bar()
        with device.simulator_pace():
            server = load_server(args.model, name=args.served_model_name, draft=args.draft,
                                 max_waiting=args.max_waiting, dtype=args.dtype,
                                 max_seqs=args.max_seqs, capacity=args.capacity,
                                 kv_bytes=args.kv_bytes, draft_len=args.draft_len,
                                 prefix_cache=not args.no_prefix_cache,
                                 verify=not args.no_verify, rank_timeout=args.rank_timeout)
            if launched_rank() != 0:
                return follow(server.engine)
            print(f"{PROG}: serving {server.name!r} on http://{args.host}:{args.port}/v1 "
                  f"(max_seqs {args.max_seqs}, capacity {args.capacity})", file=sys.stderr,
                  flush=True)
            stopping(uvicorn.Server)(uvicorn.Config(
                server.app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=args.graceful_s)).run()
        return 0
    except (UsageError, KVCacheError, OSError) as exc:
        return refused(PROG, exc)
