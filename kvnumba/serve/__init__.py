"""An OpenAI-compatible server over `kvnumba.hf.Engine` (extra `kvnumba[serve]`;
`python -m kvnumba serve --model DIR`): completions and chat completions, streamed or
not, from one engine loop that batches every client's requests; docs/serve.md.

    from kvnumba.serve import load_server
    server = load_server("path/to/model", max_seqs=8, capacity=2048)
    # server.app: an ASGI app (uvicorn.run(server.app, port=8000))
"""
from .cli import load_server

__all__ = ["load_server"]
