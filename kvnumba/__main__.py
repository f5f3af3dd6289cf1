"""`python -m kvnumba demo [options]`: see `kvnumba.demo` (`python -m kvnumba demo --help`)."""
from __future__ import annotations

import sys

USAGE = """usage: python -m kvnumba demo [--help] [options]

commands:
  demo    serve several sessions of a small decoder through the cache, checked token by
          token against a cache-free NumPy run (python -m kvnumba demo --help)"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"python -m kvnumba: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    from .demo import main as demo_main
    return demo_main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
