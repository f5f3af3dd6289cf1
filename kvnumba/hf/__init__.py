"""Serving Hugging Face `transformers` models through the cache (extra `kvnumba[hf]`).

A model runs over kvnumba by its attention interface: `register()` adds an attention
function named `"kvnumba"` (and no mask creation for it), and a model called with
`input_ids [1, T]` packed from a step's inputs, `position_ids [1, T]` = the step's
positions and `use_cache=False` has each layer write its new K/V into the cache and
attend over each sequence's own history (`update_and_attend`). `Engine` runs the
serving loop on top: continuous batching, forks (`n > 1`) and speculative decoding.

    import kvnumba.hf as kvhf
    engine = kvhf.Engine(model, max_seqs=8, capacity=2048)
    outs = engine.generate([[1, 5, 9], [4, 2]], max_new_tokens=16)
"""
from .attention import ATTENTION, register
from .config import cache_config
from .engine import Engine, Update, Usage

__all__ = ["ATTENTION", "Engine", "Update", "Usage", "cache_config", "register"]
