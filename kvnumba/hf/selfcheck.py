"""The self-check of `python -m kvnumba generate` (no `--model`).

A small random Llama built in process is served through `Engine` three ways, each
checked against a reference that runs without kvnumba:

* continuous batching, greedy: every sequence against `model.generate()`;
* forks that diverge by sampling (`n = 2`, temperature 1, seeded): every fork against
  `sampled_reference`, which replays the engine's random draws with the plain model
  (no cache) computing each step's logits over the sequence so far; the forks of a
  prompt must differ, or the check proves nothing about forking;
* speculative decoding with a draft the model partly accepts (the model without its
  last layer): the output against `model.generate()`, and the acceptance rate strictly
  between 0 and 1, so both the accepted and the rejected draft paths ran.

Under torchrun the engines serve the random models split over the ranks by their
tensor-parallel plan (each rank saves its copy, built from the same seed, and loads it
split), and the references run the models whole: the check of the ranks in lockstep.

Exit status 1 on any difference.
"""
from __future__ import annotations

import os
import tempfile

import torch
import transformers

from . import Engine
from .progress import serve
from .sampling import Sampling
from .sharding import launched_ranks, split_loading

#: the random model: small enough for the CUDA simulator, grouped kv heads
SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
#: prompts of 4, 7 and 10 tokens: the longest is prefilled in two chunks (max_write 8)
PROMPTS = [[(7 * i + 3 * j) % SHAPE["vocab_size"] for j in range(4 + 3 * i)]
           for i in range(3)]
MAX_WRITE = 8
FORKS, FORK_PROMPTS, FORK_TEMPERATURE = 2, 2, 1.0


def random_model(seed: int, layers: int = 2):
    """A random Llama-shaped causal LM of `SHAPE` (float32, eval mode)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SHAPE, num_hidden_layers=layers)
    return transformers.LlamaForCausalLM(config).eval()


def without_last_layer(model):
    """A draft for `model`: the same weights without its last decoder layer. It agrees
    with the model's argmax on part of the tokens (on the random models, about a
    third to a half), so greedy speculative decoding accepts some drafts, not all."""
    config = transformers.LlamaConfig(**SHAPE, num_hidden_layers=
                                      model.config.num_hidden_layers - 1)
    draft = transformers.LlamaForCausalLM(config).eval()
    missing, _ = draft.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing          # every weight of the draft is the model's
    return draft


def split_over_ranks(model):
    """`model` split over the torchrun job's ranks by its tensor-parallel plan: saved to a
    temporary directory of this rank and loaded from it split (`split_loading`). Saved
    by safetensors itself: once a process group is open, `save_pretrained` writes on
    rank 0 alone."""
    from safetensors.torch import save_model
    with tempfile.TemporaryDirectory() as where:
        model.config.save_pretrained(where)
        save_model(model, os.path.join(where, "model.safetensors"), metadata={"format": "pt"})
        return type(model).from_pretrained(where, **split_loading()).eval()


def greedy_reference(model, prompt, max_new_tokens: int) -> list:
    """`model.generate()`'s greedy new tokens (no eos; every prompt token attended)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _next_logits(model, tokens):
    """The plain model's logits `[1, vocab]` for the token after `tokens` (no cache)."""
    with torch.inference_mode():
        ids = torch.tensor([tokens], device=model.device)
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, -1:]


def sampled_reference(model, prompt, *, n: int, max_new_tokens: int, temperature: float,
                      top_p: float = 1.0, seed: int, eos_token_id=None) -> list:
    """The `n` sequences `Engine.submit(prompt, n=n, seed=seed, ...)` samples, replayed
    with the plain model: the first sequence's generator is seeded with `seed` and
    draws its first token; each fork's generator is seeded from
    `torch.randint(2**62, (), generator=first)` and draws the fork's first token from
    the same logits; then every sequence draws each next token with its own generator
    (`Sampling.choose`). A sequence ends after `max_new_tokens` or an eos token (kept)."""
    sampling = Sampling(temperature, top_p)
    eos = set([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id or ())
    first = torch.Generator(device=model.device).manual_seed(seed)
    logits = _next_logits(model, prompt)
    starts = [(first, int(sampling.choose(logits, first)[0]))]
    for _ in range(n - 1):
        fork = torch.Generator(device=model.device)
        fork.manual_seed(int(torch.randint(2**62, (), generator=first)))
        starts.append((fork, int(sampling.choose(logits, fork)[0])))
    sequences = []
    for generator, token in starts:
        new = [token]
        while len(new) < max_new_tokens and new[-1] not in eos:
            new.append(int(sampling.choose(_next_logits(model, prompt + new), generator)[0]))
        sequences.append(new)
    return sequences


def _report(name: str, detail: str, outputs, seconds: float, verdict: str) -> None:
    """One run's line, then its sequences (`p -> ids`, `p.k -> ids` for forks)."""
    tokens = sum(len(seq) for sequences in outputs for seq in sequences)
    print(f"{name}: {detail}; {tokens} tokens, {tokens / seconds:.1f} tokens/s: {verdict}")
    for i, sequences in enumerate(outputs, 1):
        for k, seq in enumerate(sequences, 1):
            print(f"  {i if len(sequences) == 1 else f'{i}.{k}'} -> {seq}")


def self_check(args) -> int:
    """Serve the random model three ways (see the module's doc) and report each run,
    its sequences and its verdict: 0 when every check holds, else 1."""
    model, new = random_model(args.seed), args.max_new_tokens
    draft = without_last_layer(model)
    served, served_draft = model, draft
    ranks = launched_ranks()
    if ranks > 1:
        served, served_draft = split_over_ranks(model), split_over_ranks(draft)
    config = model.config
    print(f"model: random Llama (seed {args.seed}): {config.num_hidden_layers} layers, "
          f"{config.num_attention_heads} heads, {config.num_key_value_heads} kv heads, "
          f"head_dim {config.head_dim}, vocab {config.vocab_size}; storage "
          f"{args.dtype or 'float32'}" + (f"; served split over {ranks} ranks, checked "
                                          f"against the whole model" if ranks > 1 else ""))
    for i, prompt in enumerate(PROMPTS, 1):
        print(f"prompt {i}: {prompt}")
    max_write = max(MAX_WRITE, args.draft_len + 1)
    capacity = max(max(map(len, PROMPTS)) + new, max_write)

    def engine(max_seqs, **extra):
        return Engine(served, max_seqs=max_seqs, capacity=capacity, max_write=max_write,
                      dtype=args.dtype or "float32", **extra)

    def verdict(same: bool, reference: str) -> str:
        return f"{'same as' if same else 'DIFFERENT from'} {reference}"

    failures = []
    greedy = [[greedy_reference(model, p, new)] for p in PROMPTS]

    got, seconds = serve(engine(len(PROMPTS)), PROMPTS, max_new_tokens=new)
    _report("continuous batching", f"greedy, {len(PROMPTS)} prompts", got, seconds,
            verdict(got == greedy, "model.generate()"))
    if got != greedy:
        failures.append("continuous batching")

    forked = PROMPTS[:FORK_PROMPTS]
    sampled = [sampled_reference(model, p, n=FORKS, max_new_tokens=new,
                                 temperature=FORK_TEMPERATURE, seed=args.seed + i)
               for i, p in enumerate(forked)]
    got, seconds = serve(engine(len(forked) * FORKS), forked, n=FORKS, seed=args.seed,
                         max_new_tokens=new, temperature=FORK_TEMPERATURE)
    diverged = sum(len(set(map(tuple, sequences))) > 1 for sequences in got)
    _report("forks", f"n = {FORKS}, temperature {FORK_TEMPERATURE:g}, seed {args.seed}; "
            f"the forks differ for {diverged} of {len(forked)} prompts", got, seconds,
            verdict(got == sampled, "the reference sampler"))
    if got != sampled:
        failures.append("forks")
    if diverged < len(forked):
        print("  the forks of every prompt must differ, or forking is not checked; try "
              "another --seed or more --max-new-tokens")
        failures.append("forks: identical")

    speculative = engine(len(PROMPTS), draft_model=served_draft, draft_len=args.draft_len)
    got, seconds = serve(speculative, PROMPTS, max_new_tokens=new)
    rate = speculative.acceptance_rate
    shown = "no drafts proposed" if rate is None else f"draft acceptance {rate:.0%}"
    _report("speculative", f"greedy, draft_len {args.draft_len}, the draft is the model "
            f"without its last layer, {shown}", got, seconds,
            verdict(got == greedy, "model.generate()"))
    if got != greedy:
        failures.append("speculative")
    if rate is None or not 0 < rate < 1:
        print("  the draft must be partly accepted (strictly between 0% and 100%) to run "
              "both the accept and the reject paths; try another --seed or more "
              "--max-new-tokens")
        failures.append("speculative: acceptance")

    print("OK: every run matches its reference" if not failures else
          f"FAILED: {', '.join(failures)}")
    return 1 if failures else 0
