"""A `transformers` model with its own kvnumba cache and session table, run one packed
step at a time through the step driver (`ServedModel`), the verbs that change its
table, and what its pools can hold."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from .. import BatchedSequenceCache, SessionTable, page_keys, run_inputs
from ..errors import ConfigError
from .attention import ATTENTION
from .config import model_layer_map, text_config
from .latent import capturing
from .layermap import shared_attention, sharing
from .mixers import mixer_layers
from .mixing import running, state_specs


@dataclass(frozen=True)
class TableVerb:
    """A verb of `ServedModel` that changes its session table (`TABLE_VERBS`): whether its
    first argument is a session id (`takes`), whether it returns a new one (`makes`) and
    whether it closes its first argument's session (`ends`)."""

    name: str
    takes: bool = False
    makes: bool = False
    ends: bool = False


#: The verbs that change a served model's session table, listed once: the engine's every
#: decision about the model's cache goes through them (and `run`), so rank 0 of a split
#: model records them and the other ranks replay them (`lockstep`).
TABLE_VERBS = {verb.name: verb for verb in (
    TableVerb("open", makes=True),
    TableVerb("clone", takes=True, makes=True),
    TableVerb("close", takes=True, ends=True),
    TableVerb("register", takes=True),
)}


class ServedModel:
    """A model and its own cache and session table, run one packed step at a time."""

    def __init__(self, model, config):
        self.model = model
        self.cache = BatchedSequenceCache(config)
        self.table = SessionTable(self.cache, max_sessions=config.max_seqs,
                                  max_session_tokens=config.capacity)
        self.device = next(model.parameters()).device
        #: decoder layer -> cache layers (`layermap.LayerMap`), as `config` was laid out
        self.layers = model_layer_map(text_config(model.config), state_specs(model))
        if self.layers.n_layers != config.n_layers:
            raise ConfigError(f"the cache config has {config.n_layers} layers; the model's "
                              f"decoder layers take {self.layers.n_layers} (make the config "
                              f"with kvnumba.hf.cache_config)")
        # cache layer -> the mixer module computing through it
        self.mixers = {self.layers.mixers[layer]: module
                       for layer, module in mixer_layers(model).items()}
        self.shared = shared_attention(model)
        # per page group: (its ring rows, 0 for the layers paged by position; the pages its
        # pool hands out at most: all it can give while the cache holds nothing)
        self.groups = [(pool.rows, pool.free) for pool in self.cache.pool_pages()]

    def pages_for(self, positions: int, n: int) -> list:
        """Per page group, the most pages `n` sequences of up to `positions` positions
        hold (no sharing counted: forks may hold fewer)."""
        return [n * pages for pages in self.cache.config.sequence_pages(positions)]

    def need(self, request) -> list:
        """Per page group, the most pages `request`'s sequences come to hold."""
        return self.pages_for(request.n_prompt + request.max_new, request.n)

    def reserved(self, requests) -> list:
        """Per page group, what `requests` may come to hold together."""
        return [sum(column) for column in zip([0] * len(self.groups),
                                              *map(self.need, requests))]

    def fits(self, reserved: list, request) -> bool:
        """Whether `request`'s sequences fit the pools beside `reserved` pages."""
        return all(r + n <= bound for r, n, (_, bound) in
                   zip(reserved, self.need(request), self.groups))

    def indexed(self, prompt: list, extra: bytes = b"") -> int:
        """Positions of `prompt` its prefix index holds, in whole pages and never all of
        it: where a session opened from `prompt` starts, at most (a match may be shortened
        where a ring pool cannot spare its rows). Changes nothing."""
        size = self.cache.config.page_size
        return self.cache.prefix_match(page_keys(prompt[:-1], size, extra)) * size

    # the verbs that change the table (`TABLE_VERBS`)
    def open(self, prompt=None, extra: bytes = b"") -> int:
        """A session for a request: from the longest indexed prefix of `prompt`, or empty
        when `prompt` is None."""
        if prompt is None:
            return self.table.open()
        return self.table.open(prompt, extra_key=extra)

    def clone(self, sid: int) -> int:
        """A fork of session `sid` (all its positions)."""
        return self.table.clone(sid)

    def close(self, sid: int) -> None:
        """Free session `sid`'s sequence."""
        self.table.close(sid)

    def register(self, sid: int, tokens: list) -> None:
        """Offer session `sid`'s completed pages of `tokens` to the prefix index."""
        self.table.register(sid, tokens)

    @contextlib.contextmanager
    def kvnumba_attention(self):
        """The model's attention switched to kvnumba's (`ATTENTION`) inside the block, its
        mixers computing through the cache's state layers (`mixing.running`), and its
        latent layers' latents kept for the step (`latent.capturing`), attention shared
        by decoder layers told which one calls it (`layermap.sharing`): yields the
        keyword arguments a step's model call passes (`kvnumba_cache`, `kvnumba_layers`
        where a decoder layer is not its cache layer, and `kvnumba_latents` where the
        cache has latent layers)."""
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = ATTENTION
        layers = [i for i, kind in enumerate(self.cache.config.kinds) if kind.name == "latent"]
        try:
            with capturing(self.model, layers) as latents, \
                    running(self.mixers, self.cache), sharing(self.shared):
                yield dict(kvnumba_cache=self.cache,
                           **({} if self.layers.identity else
                              dict(kvnumba_layers=self.layers.attention)),
                           **(dict(kvnumba_latents=latents) if layers else {}))
        finally:
            config._attn_implementation = before

    def entering(self) -> None:
        """Called as each forward starts, its step prepared: nothing here (each rank of a
        split model meets the other ranks there, `lockstep.SplitModel`)."""

    def run(self, inputs, rows):
        """Run the model over `inputs` (`(sid, start, tokens)`, packed in this order) and
        return its logits `[len(rows), vocab]` at packed rows `rows` (one step of the
        step driver: any error aborts it)."""
        import torch

        def forward(packed, plan):
            ids = torch.as_tensor(np.asarray(packed.tokens, np.int64), device=self.device)[None]
            positions = torch.as_tensor(plan.positions.astype(np.int64), device=self.device)
            keep = torch.as_tensor(np.asarray(rows, np.int64), device=self.device)
            self.entering()
            with torch.inference_mode(), self.kvnumba_attention() as step:
                return self.model(input_ids=ids, position_ids=positions[None],
                                  use_cache=False, logits_to_keep=keep, **step).logits[0]
        return run_inputs(self.table, inputs, forward)

