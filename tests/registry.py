"""Every causal-LM architecture the installed `transformers` ships, built tiny and random
from its own config class (`AutoConfig.for_model`), and what `kvnumba.hf` does with it:

- **served**: an engine is built (the probe passes) and its greedy tokens equal the
  model's own `generate()` (float32 storage, a 10-token prompt, 3 new tokens);
- **refused**: the engine's construction raises a `ConfigError` (its message says why);
- **not built**: `transformers` itself cannot build the tiny model or generate from it,
  in `SHAPE` nor with the config's own heads (`LOOSE`; the error is the second try's):
  nothing to serve;
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
#: shared layers fewer than its two and its per-layer embeddings small; LongCat-Flash's
#: one decoder layer (two latent attention sublayers: `num_hidden_layers` is twice
#: `num_layers`, not a field of its config), its latent and experts small (its rotary
#: head dim is `head_dim`)
FIELDS = {
    "gemma3n_text": dict(num_kv_shared_layers=1, vocab_size_per_layer_input=64,
                         hidden_size_per_layer_input=8, laurel_rank=4),
    "longcat_flash": dict(num_layers=1, num_key_value_heads=4, n_routed_experts=4, moe_topk=2,
                          zero_expert_num=2, expert_ffn_hidden_size=16, kv_lora_rank=8,
                          q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=16,
                          v_head_dim=8, qk_head_dim=24),
}
#: special token ids a config gives past the tiny vocabulary (Phi-3's pad 32000) become
#: these (the embedding's padding row must lie inside it)
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
NEW_TOKENS = 3
#: the short list CI sweeps: chunked and sliding layers and latent attention (MiniCPM3)
#: served, and each kind of refusal (no attention interface, a recurrent model, the
#: probe, indexed sparse attention) (Llama, gpt-oss, Gemma 4 and DeepSeek-V3 are served in
#: tests of their own)
SHORT = ("gemma3_text", "llama4_text", "minicpm3", "bloom", "mamba", "bert", "deepseek_v32")


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


def in_vocabulary(config) -> None:
    """`config`'s special token ids past its vocabulary set to `TOKEN_IDS`'."""
    for name, inside in TOKEN_IDS.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and value >= config.vocab_size:
            setattr(config, name, inside)


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:200]


def sweep_one(model_type: str) -> dict:
    """The outcome of `model_type` (module doc): `{"model_type", "outcome", "why",
    "seconds"}`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import kvnumba as kv
    import kvnumba.hf as kvhf

    start = time.perf_counter()

    def outcome(name, why=""):
        return {"model_type": model_type, "outcome": name, "why": why,
                "seconds": round(time.perf_counter() - start, 1)}

    def build(shape):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fields = known_fields(model_type, {**shape, **DECODER})
            config = AutoConfig.for_model(model_type, **{**fields,
                                                         **FIELDS.get(model_type, {})})
            if config.get_text_config() is not config:      # a composite: its text part too
                config = AutoConfig.for_model(model_type, **shape, text_config=shape)
            in_vocabulary(config.get_text_config())
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).float().eval()
            ids = torch.tensor([PROMPT])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
            return model, out[0, len(PROMPT):].tolist()

    try:
        try:
            model, want = build(SHAPE)
        except Exception:                       # noqa: BLE001 (try the config's own heads)
            model, want = build(LOOSE)
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
