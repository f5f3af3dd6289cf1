"""The tiny `transformers` models the hf tests serve (built from their config classes,
random weights; one layer, Gemma-2 two: a sliding and a full one), their prompts, and
`model.generate()`'s greedy tokens to compare with. Importing it skips the importing
test module without torch, transformers or kvnumba.hf."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvhf = pytest.importorskip("kvnumba.hf")

WINDOW = 4          # smaller than every prompt
SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=64)
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=WINDOW),
    "gemma2": lambda: transformers.Gemma2Config(**{**SHAPE, "num_hidden_layers": 2},
                                                sliding_window=WINDOW,
                                                query_pre_attn_scalar=12,
                                                attn_logit_softcapping=0.5,
                                                final_logit_softcapping=None),
}
PROMPTS = [[1, 5, 9, 3, 7], [4, 2, 8, 8, 1, 6, 3, 2, 9]]
#: a shared system prompt: 17 tokens, 2 pages of 8 and one more
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2]


def built(model_type, shape, seed=0, **fields):
    """A tiny random model of `model_type` built from `transformers`' own config class
    with `shape` and `fields` (eval mode, weights drawn after `torch.manual_seed(seed)`)."""
    config = transformers.AutoConfig.for_model(model_type, **{**shape, **fields})
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def tiny(arch, seed=0, **fields):
    torch.manual_seed(seed)
    config = ARCHITECTURES[arch]()
    for name, value in fields.items():
        setattr(config, name, value)
    model = getattr(transformers, f"{type(config).__name__[:-6]}ForCausalLM")(config)
    return model.eval()


def generated(model, prompt, max_new_tokens):
    """`model.generate()`'s greedy new tokens (no eos; every prompt token attended)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


#: every logit's distance from float32 storage's a prefill over each storage dtype may
#: have (the test models' logits are O(0.3); bfloat16 keeps 8 bits, fp8 3 or 2)
STORAGE_TOLERANCE = {"bfloat16": 0.05, "float16": 0.05, "float8_e4m3": 0.05,
                     "float8_e5m2": 0.1}


def prefill_logits(model, dtype, prompt, **options):
    """The logits of one prefill of `prompt` served over `dtype` storage (no probe), the
    cache's other `options` given."""
    engine = kvhf.Engine(model, verify=False, max_seqs=1, capacity=24, max_write=24,
                         dtype=dtype, **options)
    sid = engine.target.table.open()
    return engine.target.run([(sid, 0, prompt)], list(range(len(prompt))))
