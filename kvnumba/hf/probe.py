"""The check that needs no list of architectures: before an engine serves a model, a short
probe runs it through its own attention and through kvnumba and compares them.

The probe feeds `PROMPT_TOKENS` prompt tokens and then one decode token: once through the
model as it is (its own attention implementation, no kvnumba, one forward over all the
tokens), and once through a kvnumba cache of its own (one sequence; a prompt step, then a
decode step), each run's hidden states after every decoder layer kept (in whatever shape
a layer returns them; kvnumba's two steps joined along their token dimension, `joined`:
a layer output they cannot be compared in is refused, naming its shapes). Where the two
differ beyond the storage dtype's tolerance (`TOLERANCE`, relative to the layer's largest
value), the model is refused with a `ConfigError` naming the first decoder layer that
differs and by how much; a probe step that raises refuses it too, naming the error, and so does the model's own forward
raising (the model itself fails: `verify=False` would not help). The
engine's own caches are not touched.

Cost: two forwards of `PROMPT_TOKENS + 1` tokens (one of them in two kvnumba steps) per
served model, at construction: milliseconds on a GPU; on Numba's CUDA simulator about a
second per layer. `Engine(..., verify=False)` skips it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .. import run_inputs
from ..errors import ConfigError, KVCacheError
from .config import text_config
from .served import ServedModel

#: prompt tokens of the probe (then one decode token): more than a small sliding window
PROMPT_TOKENS = 6
#: the largest relative difference accepted, by the storage dtype and by the model's own
#: dtype (the larger of the two applies): what rounding K/V to the storage dtype, and
#: computing the model's layers in its dtype, may move a layer's output
TOLERANCE = {"float32": 1e-3, "float16": 3e-2, "bfloat16": 1e-1, "float8_e4m3": 0.3,
             "float8_e5m2": 0.6}


def probe_tokens(vocab: int) -> list:
    """The probe's `PROMPT_TOKENS + 1` token ids: distinct where the vocabulary allows."""
    return [(7 * i + 3) % vocab for i in range(PROMPT_TOKENS + 1)]


def verify(model, config) -> None:
    """Refuse (`ConfigError`) `model` unless its hidden states through kvnumba, with a
    cache of `config`'s layers and storage, match its own within the tolerance (module
    doc). Changes nothing of the model's."""
    import torch
    text = text_config(model.config)
    tokens = probe_tokens(text.vocab_size)
    device = next(model.parameters()).device
    ids = torch.as_tensor([tokens], device=device)
    try:
        with torch.inference_mode():
            own = model(input_ids=ids, use_cache=False,
                        output_hidden_states=True).hidden_states
    except Exception as exc:                # noqa: BLE001  (any failure of the model itself)
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"{text.model_type}: the model's own forward failed during the "
                          f"construction probe, before kvnumba ran it ({type(exc).__name__}: "
                          f"{first}): check that the model runs on its own, "
                          f"model(input_ids) with a [1, {len(tokens)}] tensor of token ids; "
                          f"verify=False does not help, serving runs the same "
                          f"forward") from exc
    try:
        served = kvnumba_hidden(model, config, tokens)
    except KVCacheError as exc:
        raise ConfigError(f"{text.model_type}: kvnumba cannot serve it exactly (its probe "
                          f"step through kvnumba was refused: {exc})") from exc
    except Exception as exc:                # noqa: BLE001  (any failure of the probe step)
        raise ConfigError(f"{text.model_type}: the probe step through kvnumba raised "
                          f"{type(exc).__name__}: {exc}") from exc
    tolerance = max(TOLERANCE[config.dtype],
                    TOLERANCE.get(str(model.dtype).removeprefix("torch."), 0.0))
    for layer, (steps, b) in enumerate(zip(served[1:], own[1:])):
        a = joined(text.model_type, layer, steps, b)
        expected = b.double()
        difference = float((a.double() - expected).abs().max())
        scale = max(float(expected.abs().max()), 1e-30)
        if not difference <= tolerance * scale:
            raise ConfigError(
                f"{text.model_type}: through kvnumba, decoder layer {layer}'s output differs "
                f"from the model's own by {difference:.3g} ({difference / scale:.3g} of its "
                f"largest value; {config.dtype} storage allows {tolerance:g}) on a probe "
                f"of {len(tokens)} tokens: its attention computes something kvnumba does "
                f"not; pass verify=False to serve it anyway")


def joined(model_type: str, layer: int, steps: tuple, own):
    """Decoder layer `layer`'s output over the probe's tokens through kvnumba: its prompt
    step's and decode step's outputs (`steps`) joined along their token dimension, the
    one dimension where they differ (a layer may return more than `[batch, T, hidden]`:
    Gemma 3n's are `[streams, batch, T, hidden]`). `ConfigError` naming the shapes where
    no such dimension joins them into the shape of the model's own output `own`."""
    import torch
    prompt, last = steps
    shapes = [tuple(getattr(x, "shape", ())) for x in (prompt, last, own)]
    if all(isinstance(x, torch.Tensor) for x in (prompt, last, own)) and \
            len({len(shape) for shape in shapes}) == 1:
        differ = [d for d, (p, q) in enumerate(zip(shapes[0], shapes[1])) if p != q]
        if len(differ) == 1:
            made = torch.cat([prompt, last], dim=differ[0])
            if made.shape == own.shape:
                return made
    raise ConfigError(f"{model_type}: decoder layer {layer}'s output cannot be compared with "
                      f"the model's own: shapes {list(shapes[0])} (prompt step) and "
                      f"{list(shapes[1])} (decode step) through kvnumba do not join along one "
                      f"token dimension into its own {list(shapes[2])}; pass verify=False to "
                      f"serve it unchecked")


def kvnumba_hidden(model, config, tokens: list) -> tuple:
    """The model's hidden states per layer (embeddings first) over `tokens` through a
    cache of `config`'s layers and storage sized for them, as `(prompt step's, decode
    step's)` pairs: the prompt in one step, the last token in a decode step."""
    import torch
    small = replace(config, max_seqs=1, capacity=len(tokens), max_write=len(tokens),
                    max_step=len(tokens), initial_pages=None, max_pages=None)
    served = ServedModel(model, small)
    sid = served.table.open()

    def forward(packed, plan):
        ids = torch.as_tensor(np.asarray(packed.tokens, np.int64), device=served.device)[None]
        positions = torch.as_tensor(plan.positions.astype(np.int64), device=served.device)
        with torch.inference_mode(), served.kvnumba_attention() as step:
            return model(input_ids=ids, position_ids=positions[None], use_cache=False,
                         output_hidden_states=True, **step).hidden_states
    prompt = run_inputs(served.table, [(sid, 0, tokens[:-1])], forward)
    last = run_inputs(served.table, [(sid, len(tokens) - 1, tokens[-1:])], forward)
    return tuple(zip(prompt, last))
