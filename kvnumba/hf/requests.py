"""A request's sequences (`Sequence`, each with its `Seat` in every served model) and
every check made of a request before anything is queued, drawn or seeded (contract
§13): prompts, counts, sampling options, the eos ids and the seed, each refused with a
typed error naming what to pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..args import as_count, describe, is_int
from ..errors import CapacityError, ConfigError, ShapeError
from ..arith.prefix_keys import extra_bytes
from .sampling import Sampling

#: seeds of a request's generator: what `torch.Generator.manual_seed` takes
SEED_END = 2**64


@dataclass
class Seat:
    """A sequence's place in one served model's cache: its session in the model's table,
    the positions the cache holds that stand, and those offered to the prefix index."""

    sid: int
    fed: int
    offered: int


@dataclass(kw_only=True)
class Sequence:
    """One sequence of a request being generated (a request with `n > 1` is `n` of them,
    forked from the first once its prompt is prefilled). `rid` and `generator` are set
    when the request is queued; `seed` is None where the engine draws one. `seats`: its
    `Seat` in each served model (the model's first, then the draft's), empty while it
    waits."""

    tokens: list            # prompt, then the tokens generated so far
    n_prompt: int
    max_new: int
    sampling: Sampling
    eos: frozenset
    seed: int | None = None
    n: int = 1              # forks still to make from this one after its prefill
    rid: int | None = None
    generator: object = None
    seats: list = field(default_factory=list)
    extra: bytes = b""      # the prefix index's extra key of its pages
    cached: int = 0         # prompt positions the prefix index served at admission
    done: bool = False
    group: list = field(default_factory=list)   # the request's sequences, in order (shared)

    @property
    def fed(self) -> int:
        """Positions the model's cache holds that stand (0 while waiting)."""
        return self.seats[0].fed if self.seats else 0

    @property
    def new(self) -> list:
        return self.tokens[self.n_prompt:]

    def finish_if_due(self) -> None:
        """Done at `max_new` tokens or at an eos token (kept, as the last one); tokens
        past either (accepted drafts beyond it) are dropped."""
        new = self.new
        limit = next((i + 1 for i, t in enumerate(new) if t in self.eos), self.max_new)
        limit = min(limit, self.max_new)
        if len(new) >= limit:
            del self.tokens[self.n_prompt + limit:]
            self.done = True


def checked_request(prompt, *, vocab: int, capacity: int, max_seqs: int, max_new_tokens,
                    temperature, top_p, seed, eos_token_id, n, extra_key=None) -> Sequence:
    """The first `Sequence` of a request for `prompt` once every option is checked
    (nothing drawn, nothing seeded): `ConfigError` or `CapacityError` naming the option
    and what to pass."""
    tokens = checked_prompt(prompt, vocab)
    max_new = as_count(max_new_tokens, "max_new_tokens", 1)
    n = as_count(n, "n", 1)
    sampling = Sampling(temperature, top_p)
    if len(tokens) + max_new > capacity:
        raise CapacityError(f"a prompt of {len(tokens)} tokens and max_new_tokens="
                            f"{max_new} need {len(tokens) + max_new} positions; capacity "
                            f"is {capacity}")
    if n > max_seqs:
        raise CapacityError(f"n={n} sequences: the engine holds max_seqs={max_seqs}")
    try:
        extra = extra_bytes(extra_key)
    except ShapeError as exc:
        raise ConfigError(str(exc)) from None
    return Sequence(tokens=tokens, n_prompt=len(tokens), max_new=max_new, sampling=sampling,
                    eos=checked_eos(eos_token_id, vocab), seed=checked_seed(seed), n=n,
                    extra=extra)


def checked_prompt(prompt, vocab: int) -> list:
    """A prompt as a list of token ids in `[0, vocab)`, or `ConfigError`."""
    try:
        array = np.asarray(prompt)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"prompt: expected a 1-D sequence of token ids ({exc})") from None
    if array.size == 0:
        raise ConfigError("prompt: empty; a request needs at least one token")
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise ConfigError(f"prompt: expected a 1-D sequence of int token ids (a list of "
                          f"ints), got {describe(prompt)} (shape {array.shape}, dtype "
                          f"{array.dtype})")
    bad = array[(array < 0) | (array >= vocab)]
    if bad.size:
        raise ConfigError(f"prompt: token ids {bad[:4].tolist()} outside the vocabulary "
                          f"[0, {vocab})")
    return array.tolist()


def checked_prompts(prompts) -> list:
    """`generate`'s prompts as a list (each one checked later, as `submit` checks it), or
    `ConfigError` saying what to pass: a list of prompts, each a list of token ids."""
    if hasattr(prompts, "keys") and "input_ids" in prompts:     # a tokenizer's BatchEncoding
        raise ConfigError("prompts: got a tokenizer's encoding; pass its token ids, "
                          "encoding['input_ids'] (a list of lists of ints)")
    if prompts is None or isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ConfigError(f"prompts: expected a list of prompts, each a list of token ids "
                          f"(e.g. [[1, 5, 9], [4, 2]]), got {describe(prompts)}")
    prompts = list(prompts)
    if not prompts:
        raise ConfigError("prompts: empty; pass at least one prompt")
    if all(is_int(p) for p in prompts):
        raise ConfigError(f"prompts: got a flat list of ints {describe(prompts)}; pass a list "
                          f"of prompts: [ids] for one prompt")
    return prompts


def checked_eos(eos_token_id, vocab: int) -> frozenset:
    """The eos ids: None (none), an int, or a list / tuple / 1-D int array of ints, each
    in `[0, vocab)`; else `ConfigError`."""
    if eos_token_id is None:
        return frozenset()
    if is_int(eos_token_id):
        ids = [eos_token_id]
    elif isinstance(eos_token_id, (list, tuple)) or \
            (isinstance(eos_token_id, np.ndarray) and eos_token_id.ndim == 1):
        ids = list(eos_token_id)
    else:
        ids = None
    if ids is None or not all(is_int(i) for i in ids):
        raise ConfigError(f"eos_token_id={describe(eos_token_id)}: an int, a list of ints or "
                          f"None")
    outside = [int(i) for i in ids if not 0 <= i < vocab]
    if outside:
        raise ConfigError(f"eos_token_id: {outside} outside the vocabulary [0, {vocab})")
    return frozenset(int(i) for i in ids)


def checked_seed(seed, last: int = 0) -> int | None:
    """`seed` (None, or an int with `seed + last` below `SEED_END`: the seeds of `last + 1`
    requests), or `ConfigError`."""
    if seed is None:
        return None
    if not is_int(seed):
        raise ConfigError(f"seed={describe(seed)}: must be an int or None")
    if not 0 <= seed or seed + last >= SEED_END:
        raise ConfigError(f"seed={seed}: requests take seeds in [0, 2**64)"
                          + (f"; {last + 1} prompts take seed .. seed + {last}" if last else ""))
    return int(seed)
