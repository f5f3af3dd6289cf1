"""The demo's options and what they imply: the prompts, the cache config and the model.

Each `Options` field that is also a command-line flag says so with `flag(...)`; the
CLI (`cli.parser`) is built from those fields, so a flag's name, default and help are
written once.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

import numpy as np

import kvnumba as kv
from kvnumba.reference import DemoModel

#: tolerances of the per-step comparison, by storage dtype: (atol, rtol) for attention
#: outputs; logits get 10x (the storage dtypes `--dtype` takes). bfloat16's are 8x
#: float16's: its unit roundoff is 2**-8 against 2**-11.
TOLERANCE = {"float32": (1e-4, 1e-4), "float16": (2e-2, 2e-2),
             "bfloat16": (1.6e-1, 1.6e-1)}
#: positions one session may hold: the cache's `capacity` and the session table's
#: `max_session_tokens`, well above what the scenario writes
CAPACITY = 256
#: positions per page of the cache's pools: small, so the flat pool grows during the run
PAGE_SIZE = 8
#: pages each pool starts with (it grows by doubling)
INITIAL_PAGES = 2
#: padded steps are prepared at widths that are multiples of this
PAD_BUCKET = 8
#: the window of `ring` written without `:W` in `--layers`
DEFAULT_WINDOW = 6


def parse_layers(text: str) -> tuple:
    """`"flat,ring:6"` -> `(None, 6)`: one entry per layer, None for flat, else the ring's
    window W; `ring` alone means `ring:6`."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "flat":
            out.append(None)
        elif part == "ring":
            out.append(DEFAULT_WINDOW)
        elif part.startswith("ring:") and part[5:].isdigit() and int(part[5:]) >= 1:
            out.append(int(part[5:]))
        else:
            raise argparse.ArgumentTypeError(f"layer {part!r}: use flat or ring:W (W >= 1)")
    if not out:
        raise argparse.ArgumentTypeError("--layers needs at least one layer")
    return tuple(out)


def spell_layers(layers: tuple) -> str:
    """`(None, 6)` -> `"flat,ring:6"`, as `--layers` takes it (`parse_layers`' inverse)."""
    return ",".join("flat" if w is None else f"ring:{w}" for w in layers)


def flag(default, text: str = "", *, spell=str, note: str = "", **argparse_kw):
    """An `Options` field that is also the flag `--name-with-dashes`: its help reads
    `text (default D[: note])` (`D` = `spell(default)`), or `default D` without `text`;
    `argparse_kw` (`type`, default the default's type; `choices`, `metavar`) go to
    `add_argument`."""
    shown = spell(default) + (f": {note}" if note else "")
    help_text = f"{text} (default {shown})" if text else f"default {shown}"
    argparse_kw.setdefault("type", type(default))
    return field(default=default, metadata={"flag": dict(help=help_text, **argparse_kw)})


@dataclass
class Options:
    """One run of the demo: the model's shape, the scenario's lengths, the storage dtype.

    `layers` has one entry per layer: None for a flat layer, W for `ring(window=W)`.
    """

    seed: int = flag(0, "weights and prompts")
    sessions: int = flag(3, "sessions opened with a prompt; one fork is added")
    layers: tuple = flag((None, DEFAULT_WINDOW), "comma-separated flat | ring:W",
                         spell=spell_layers, type=parse_layers, metavar="SPEC")
    decode_steps: int = flag(3, "plain decode steps at the end")
    draft: int = flag(4, "speculative draft length")
    accept: int = flag(2, "draft tokens that are right by construction")
    block: int = flag(4, "draft block length")
    max_write: int = flag(8, "the cache's max_write, also the prefill chunk")
    vocab: int = flag(64)
    d_model: int = 32
    q_heads: int = flag(4)
    kv_heads: int = flag(2)
    head_dim: int = flag(8)
    dtype: str = flag("float32", "storage dtype", note="greedy tokens stay stable",
                      choices=sorted(TOLERANCE))

    def validate(self) -> None:
        """Raise `ValueError` naming the flag of the first option out of range."""
        checks = [
            (self.sessions >= 1, "--sessions must be >= 1"),
            (self.decode_steps >= 0, "--decode-steps must be >= 0"),
            (1 <= self.draft and self.draft + 1 <= self.max_write,
             "--draft N needs 1 <= N and N + 1 <= --max-write"),
            (0 <= self.accept <= self.draft, "--accept must be in [0, --draft]"),
            (2 <= self.block <= self.max_write, "--block must be in [2, --max-write]"),
            (self.max_write >= 2, "--max-write must be >= 2"),
            (self.vocab >= 4, "--vocab must be >= 4"),
            (self.kv_heads >= 1 and self.q_heads % self.kv_heads == 0,
             "--q-heads must be a multiple of --kv-heads"),
            (self.head_dim >= 2 and self.head_dim % 2 == 0, "--head-dim must be even"),
            (self.dtype in TOLERANCE, f"--dtype must be one of {sorted(TOLERANCE)}"),
            (len(self.layers) >= 1, "--layers needs at least one layer"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def mask_token(self) -> int:
        """The token the draft block's placeholder positions carry (never sampled as a prompt)."""
        return self.vocab - 1


def flag_fields() -> list:
    """The `Options` fields that are command-line flags, in declaration order."""
    return [f for f in fields(Options) if "flag" in f.metadata]


def prompts_for(opts: Options) -> list:
    """Prompt token lists (ints below `mask_token`) of different lengths, one per session:
    the first fits one step, the second (or only) is longer than max_write."""
    rng = np.random.default_rng(opts.seed + 1)
    m = opts.max_write
    lengths = rng.integers(3, 2 * m, size=opts.sessions)
    lengths[0] = min(int(lengths[0]), m)            # fits one step: fed as two abutting chunks
    lengths[1 % opts.sessions] = max(int(lengths[1 % opts.sessions]), m + 3)  # over two steps
    return [rng.integers(0, opts.vocab - 1, size=int(n)).tolist() for n in lengths]


def padded_width(n_tokens: int) -> int:
    """The static width a padded step of `n_tokens` is prepared at: the next multiple of
    `PAD_BUCKET` above it, so that it has at least one padding row."""
    return (n_tokens // PAD_BUCKET + 1) * PAD_BUCKET


def max_step_for(opts: Options) -> int:
    """The cache's `max_step`: room for every session and the fork writing `max_write`
    tokens and a bucket of padding, rounded up to a whole bucket (so at least
    `padded_width` of any step the scenario runs)."""
    most = opts.max_write * (opts.sessions + 1) + PAD_BUCKET
    return -(-most // PAD_BUCKET) * PAD_BUCKET


def cache_config(opts: Options) -> kv.CacheConfig:
    """The cache the options imply: one slot per session and the fork."""
    layers = [kv.flat() if w is None else kv.ring(window=w) for w in opts.layers]
    return kv.CacheConfig(layers=layers, n_kv_heads=opts.kv_heads, head_dim=opts.head_dim,
                          capacity=CAPACITY, max_seqs=opts.sessions + 1,
                          max_write=opts.max_write, max_step=max_step_for(opts),
                          dtype=opts.dtype, page_size=PAGE_SIZE, initial_pages=INITIAL_PAGES)


def build_model(opts: Options) -> DemoModel:
    """The random-weight decoder the options describe (weights from `opts.seed`)."""
    return DemoModel.random(opts.seed, vocab=opts.vocab, d_model=opts.d_model,
                            n_q_heads=opts.q_heads, n_kv_heads=opts.kv_heads,
                            head_dim=opts.head_dim, windows=tuple(opts.layers))
