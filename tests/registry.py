"""Every causal-LM architecture the installed `transformers` ships, built tiny and random
from its own config class (`AutoConfig.for_model`) with every kind of layer its default
config holds (`with_every_kind`: a hybrid's mixer layers beside its attention layers)
and every special token id inside the tiny vocabulary (`in_vocabulary`), and what
`kvnumba.hf` does with it:

- **served**: an engine is built (the probe passes) and its greedy tokens equal the
  model's own `generate()` (float32 storage, a 10-token prompt, 3 new tokens);
- **refused**: the engine's construction raises a `ConfigError` (its message says why);
- **not built**: `transformers` itself cannot build the tiny model or generate from it,
  in `SHAPE` nor with the config's own heads (`LOOSE`), with every kind of layer (the
  error is the first way's second try's): nothing to serve;
- **failing**: anything else (another exception, or tokens that differ): a defect;
- **not run**: the sweep's process for it ran out of time (150 s) or memory before any
  outcome (the shell loop of the module's usage records it).

`python tests/registry.py [model_type ...]` prints one JSON line per architecture (the
sweep runs each in a process of its own: `for m in $(...); do timeout 150 python
tests/registry.py $m || echo '{..."outcome": "not run"...}'; done`);
`python tests/registry.py --table FILE` prints the markdown table of a file of such
lines, the table docs/transformers.md carries between its registry markers. Imports
kvnumba only through `kvnumba.hf`'s public face.
"""
import json
import os
import sys
import time
import warnings

os.environ.setdefault("KVNUMBA_DEVICE", "simulator")

#: the tiny shape every architecture is asked for (its config maps the names it spells
#: otherwise through `attribute_map`; a field its config class lacks is left out:
#: `known_fields`)
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)
#: where `transformers` cannot build that shape, it is asked again with the config's own
#: head layout (no kv-head count or head dim of ours)
LOOSE = {name: value for name, value in SHAPE.items()
         if name not in ("num_key_value_heads", "head_dim")}
#: an encoder-decoder config's decoder (its causal-LM class is the decoder alone) takes
#: the same shape: `num_hidden_layers` names its encoder's layers (`attribute_map`)
DECODER = dict(decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64)
#: fields an architecture needs besides `SHAPE` to be built tiny and coherent: Gemma 3n's
#: shared layer the last of three, after a layer of its type (sliding, full, full), and
#: its per-layer embeddings small; LongCat-Flash's
#: one decoder layer (two latent attention sublayers: `num_hidden_layers` is twice
#: `num_layers`, not a field of its config), its latent and experts small (its rotary
#: head dim is `head_dim`); Mamba-2's heads, GPT-Neo's layer pattern and XLNet's head
#: dim fitting `SHAPE`; Zamba's shared block tied across two hybrid layers (three
#: layers); DeepSeek-V2's and dots.llm3's kv heads all their query heads, their experts
#: few; the hybrids of `HYBRIDS`. They win over `with_every_kind`'s layers
FIELDS = {
    "gemma3n_text": dict(num_kv_shared_layers=1, vocab_size_per_layer_input=64,
                         hidden_size_per_layer_input=8, laurel_rank=4, num_hidden_layers=3,
                         layer_types=["sliding_attention", "full_attention",
                                      "full_attention"]),
    "mamba2": dict(num_heads=4, head_dim=16, state_size=16, n_groups=1, chunk_size=16),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "xlnet": dict(d_head=8),
    "kolibri1_1": dict(index_num_heads=2),
    "zamba": dict(num_hidden_layers=3,
                  layers_block_type=["linear_attention", "hybrid", "hybrid"]),
    "deepseek_v2": dict(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=16),
    "dots3_note": dict(num_key_value_heads=4),
    "dots3_note_text": dict(num_key_value_heads=4),
    "longcat_flash": dict(num_layers=1, num_key_value_heads=4, n_routed_experts=4, moe_topk=2,
                          zero_expert_num=2, expert_ffn_hidden_size=16, kv_lora_rank=8,
                          q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16,
                          v_head_dim=8, qk_head_dim=24),
}
#: the hybrids whose default config holds one kind of layer where their released
#: checkpoints mix two (LFM2's short convolutions beside attention, Bamba's and
#: Granite-4's Mamba-2 mixers beside attention): a mixer layer, then an attention layer,
#: their mixers small (part of `FIELDS`)
HYBRIDS = {
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_experts=4,
                     num_experts_per_tok=2, moe_intermediate_size=16, num_dense_layers=1),
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                  mamba_chunk_size=16),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"],
                             mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                             mamba_chunk_size=16),
}
#: the gated-delta-rule, KDA and Mamba hybrids' linear layers small (their defaults are
#: the released models' 32 heads of 128, or 128 Mamba-2 heads: minutes a step on the
#: simulator; Jamba's Mamba1 layers one head per inner channel), Nemotron-H's experts few
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
           linear_value_head_dim=16)
SMALL_MIXERS = {**{name: GDN for name in ("qwen3_next", "qwen3_5", "qwen3_5_text",
                                          "qwen3_5_moe", "qwen3_5_moe_text")},
                "kimi_linear": dict(linear_head_dim=8, linear_num_heads=4),
                "bailing_hybrid": dict(head_dim=8),
                "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
                                   n_groups=1, chunk_size=16, n_routed_experts=4,
                                   num_experts_per_tok=2, moe_intermediate_size=16,
                                   moe_shared_expert_intermediate_size=16),
                "falcon_h1": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                                  mamba_n_groups=1, mamba_d_ssm=64, mamba_chunk_size=16),
                "zamba2": dict(n_mamba_heads=4, mamba_headdim=16, mamba_d_state=16,
                               mamba_ngroups=1, chunk_size=16),
                "jamba": dict(mamba_expand=1, mamba_d_state=8)}
for _name, _fields in {**HYBRIDS, **SMALL_MIXERS}.items():
    FIELDS[_name] = {**FIELDS.get(_name, {}), **_fields}
#: the per-layer fields whose values are the kinds of a config's layers (mixers, attention
#: kinds, dense or sparse MLPs), read as attributes (a config's property or
#: `attribute_map` name counts)
LAYER_FIELDS = ("layer_types", "layers_block_type", "mlp_layer_types")
#: special token ids a config gives past the tiny vocabulary (Phi-3's pad 32000) become
#: these (the embedding's padding row must lie inside it); any other `*_token_id` past it
#: (a list's entries too) the vocabulary's last ids, from its top down
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
NEW_TOKENS = 3
#: the short list CI sweeps: chunked and sliding layers and latent attention (MiniCPM3)
#: served, and each kind of refusal (no attention interface, a recurrent model's mixers,
#: the probe, indexed sparse attention) (Llama, gpt-oss, Gemma 4 and DeepSeek-V3 are served in
#: tests of their own)
SHORT = ("gemma3_text", "llama4_text", "minicpm3", "bloom", "rwkv", "bert", "deepseek_v32")


def architectures() -> list:
    """Every model type with a causal-LM class, in the registry's order."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def known_fields(model_type: str, shape: dict) -> dict:
    """The fields of `shape` that `model_type`'s config class has (its defaults' fields
    and `attribute_map`'s names): a field the class lacks would only sit on the config
    unread by the model (GPT-2 has no `head_dim`) and mislead what reads the config."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    config_class = CONFIG_MAPPING[model_type]
    try:
        names = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    except Exception:                           # noqa: BLE001 (no defaults: keep them all)
        return dict(shape)
    return {name: value for name, value in shape.items() if name in names}


def in_vocabulary(config, vocab_size: int) -> None:
    """`config`'s special token ids (`*_token_id`, an int or a list of them) past
    `vocab_size` moved inside it: `TOKEN_IDS`' where it names one, else the vocabulary's
    last ids, from its top down."""
    spare = iter(range(vocab_size - 1, max(TOKEN_IDS.values()), -1))
    names = sorted(name for name in set(config.to_dict()) | set(vars(config))
                   if name.endswith("_token_id"))
    for name in names:
        value = getattr(config, name, None)

        def inside(token, name=name):
            if isinstance(token, int) and not isinstance(token, bool) and token >= vocab_size:
                return TOKEN_IDS[name] if name in TOKEN_IDS else next(spare)
            return token
        moved = [inside(x) for x in value] if isinstance(value, (list, tuple)) else inside(value)
        if moved != (list(value) if isinstance(value, (list, tuple)) else value):
            setattr(config, name, moved)


def layer_kinds(config) -> dict:
    """`LAYER_FIELDS` name -> the kind of each of `config`'s layers, where it gives them
    (a list of strings)."""
    found = {}
    for name in LAYER_FIELDS:
        try:
            value = getattr(config, name, None)
        except Exception:                       # noqa: BLE001 (a property that cannot say)
            continue
        if isinstance(value, (list, tuple)) and value and all(isinstance(x, str) for x in value):
            found[name] = list(value)
    return found


def kinds(config) -> set:
    """`(field, kind)` for every kind of layer `config` holds (`layer_kinds`)."""
    return {(name, kind) for name, values in layer_kinds(config).items() for kind in values}


def with_every_kind(model_type: str) -> tuple:
    """`(ways, wanted)`: the ways to ask for a tiny `model_type` holding every kind of
    layer its default config holds, fewest layers first, and those kinds (`kinds`).
    `[{}]` (`SHAPE`'s layers) where its first two layers hold them all; else its
    per-layer fields cut to the first layer of each kind (as few layers as keep every
    kind, at least two), then as many layers as the default's first ones that hold every
    kind (a config that makes its pattern from a period or from indices)."""
    from transformers import AutoConfig
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            default = AutoConfig.for_model(model_type).get_text_config()
    except Exception:                           # noqa: BLE001 (no default to read)
        return [{}], set()
    per_layer = layer_kinds(default)
    wanted = kinds(default)
    if not per_layer:
        return [{}], wanted
    length = min(len(values) for values in per_layer.values())
    seen, first, prefix = set(), [], None
    for layer in range(length):
        new = {(name, values[layer]) for name, values in per_layer.items()} - seen
        if new:
            first.append(layer)
            seen |= new
        if seen == wanted and prefix is None:
            prefix = layer + 1
    if prefix is None or prefix <= SHAPE["num_hidden_layers"]:
        return [{}], wanted
    while len(first) < min(SHAPE["num_hidden_layers"], length):    # at least as many as SHAPE's
        first = sorted(first + [next(i for i in range(length) if i not in first)])
    own = set(default.to_dict())
    cut = {name: [values[layer] for layer in first] for name, values in per_layer.items()
           if name in own}
    ways = []
    if cut:
        ways.append({**cut, "num_hidden_layers": len(first)})
    ways.append({"num_hidden_layers": prefix})
    return ways, wanted


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def tiny(model_type: str, shape: dict, way: dict, wanted: set = frozenset()):
    """A tiny random `model_type` of `shape` and `way` (`with_every_kind`) and its own
    greedy tokens: `(model, generate()'s new tokens)`; raises what `transformers` raises,
    and `ValueError` where the config lacks a kind of layer of `wanted`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fields = known_fields(model_type, {**shape, **DECODER})
        config = AutoConfig.for_model(model_type, **{**fields, **way,
                                                     **FIELDS.get(model_type, {})})
        if config.get_text_config() is not config:      # a composite: its text part too
            config = AutoConfig.for_model(model_type, **shape, text_config={
                **shape, **way, **FIELDS.get(model_type, {})})
        text = config.get_text_config()
        lacking = wanted - kinds(text)
        if lacking:
            raise ValueError(f"the tiny config lacks the default's layers of {sorted(lacking)}")
        for part in {id(config): config, id(text): text}.values():
            in_vocabulary(part, text.vocab_size)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).float().eval()
        ids = torch.tensor([PROMPT])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        return model, out[0, len(PROMPT):].tolist()


def built(model_type: str):
    """`tiny(model_type, ...)` of the first way (`with_every_kind`) and shape (`SHAPE`, then
    `LOOSE`) `transformers` builds and generates from; else the first way's last error."""
    ways, wanted = with_every_kind(model_type)
    error = None
    for way in ways:
        for shape in (SHAPE, LOOSE):
            try:
                return tiny(model_type, shape, way, wanted)
            except Exception as failed:         # noqa: BLE001 (transformers' own failure)
                if way is ways[0]:
                    error = failed
    raise error


def sweep_one(model_type: str) -> dict:
    """The outcome of `model_type` (module doc): `{"model_type", "outcome", "why",
    "seconds"}`."""
    import kvnumba as kv
    import kvnumba.hf as kvhf

    start = time.perf_counter()

    def outcome(name, why=""):
        return {"model_type": model_type, "outcome": name, "why": why,
                "seconds": round(time.perf_counter() - start, 1)}

    try:
        model, want = built(model_type)
    except Exception as error:                  # noqa: BLE001 (transformers' own failure)
        return outcome("not built", first_line(error))
    try:
        engine = kvhf.Engine(model, max_seqs=1, capacity=24, dtype="float32")
    except kv.ConfigError as error:
        return outcome("refused", str(error).splitlines()[0][:300])
    except Exception as error:                  # noqa: BLE001 (a defect: named, not raised)
        return outcome("failing", f"at construction: {first_line(error)}")
    try:
        got = engine.generate([PROMPT], max_new_tokens=NEW_TOKENS)[0]
    except Exception as error:                  # noqa: BLE001
        return outcome("failing", f"serving: {first_line(error)}")
    if got != want:
        return outcome("failing", f"tokens {got}, generate() gives {want}")
    return outcome("served")


def table(lines: list) -> str:
    """The markdown table of sweep outcomes `lines` (dicts), with the counts above it."""
    counts = {}
    for line in lines:
        counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
    import transformers
    head = ", ".join(f"{counts.get(name, 0)} {name}"
                     for name in ("served", "refused", "not built", "not run", "failing"))
    rows = ["| model type | outcome | why |", "|---|---|---|"]
    for line in sorted(lines, key=lambda x: x["model_type"]):
        why = line["why"].replace("|", "\\|")
        rows.append(f"| `{line['model_type']}` | {line['outcome']} | {why} |")
    return (f"transformers {transformers.__version__}, {len(lines)} architectures: {head}."
            f"\n\n" + "\n".join(rows) + "\n")


def main(argv: list) -> None:
    if argv[:1] == ["--table"]:
        with open(argv[1]) as f:
            print(table([json.loads(x) for x in f if x.strip()]), end="")
        return
    for model_type in argv or architectures():
        print(json.dumps(sweep_one(model_type)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
