"""`python -m kvnumba demo|generate|serve [options]`: see `kvnumba.demo`,
`kvnumba.hf.cli` and `kvnumba.serve.cli` (`python -m kvnumba demo --help`, `python -m
kvnumba generate --help`, `python -m kvnumba serve --help`)."""
from __future__ import annotations

import sys

USAGE = """usage: python -m kvnumba {demo,generate,serve} [--help] [options]

commands:
  demo      serve several sessions of a small decoder through the cache, checked token
            by token against a cache-free NumPy run (python -m kvnumba demo --help)
  generate  serve a transformers model through kvnumba.hf.Engine; without --model, a
            self-check: a small random Llama served with continuous batching, sampled
            forks and a partly accepted draft, each checked against a reference without
            kvnumba (needs kvnumba[hf]; python -m kvnumba generate --help)
  serve     serve a local transformers model directory over OpenAI's API (completions
            and chat completions, streamed or not; needs kvnumba[serve]; python -m
            kvnumba serve --help)"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:])
    if argv[0] in ("generate", "serve"):
        from .hf.sharding import close_ranks
        if argv[0] == "generate":
            from .hf.cli import main as command
        else:
            from .serve.cli import main as command
        try:
            return command(argv[1:])
        finally:
            close_ranks()                   # under torchrun: before Python finalizes
    print(f"python -m kvnumba: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
