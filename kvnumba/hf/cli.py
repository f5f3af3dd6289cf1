"""`python -m kvnumba generate`: serve prompts through `kvnumba.hf.Engine`.

With `--model DIR` (a local `transformers` model directory: `config.json`, safetensors
weights and, if present, a tokenizer), it serves the prompts given (`--prompt TEXT`
needs the tokenizer; `--ids 1,2,3` does not) and prints each output and tokens/s.
Without `--model`, it builds a small random Llama-shaped model in process, serves
several prompts with continuous batching, a fork (`n = 2`) and a speculative draft
model, and checks every sequence against `model.generate()`: exit status 1 on any
difference.
"""
from __future__ import annotations

import argparse
import sys
import time
from importlib.util import find_spec

from .. import device


def progress(done: int, total: int, started: float) -> None:
    """A one-line progress bar on stderr: tokens generated of those asked, tokens/s."""
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - started, 1e-9)
    print(f"\r[{'#' * filled}{' ' * (width - filled)}] {done}/{total} tokens, "
          f"{rate:.1f} tokens/s", end="" if done < total else "\n", file=sys.stderr,
          flush=True)


def serve(engine, prompts, options, n=1) -> tuple[list, float]:
    """Serve `prompts` by `submit` / `step` with a progress bar: (outputs in prompt
    order, seconds)."""
    started = time.perf_counter()
    rids = [engine.submit(p, n=n, **options) for p in prompts]
    total = len(prompts) * n * options["max_new_tokens"]
    results, done = {}, 0
    while engine.busy:
        for rid, tokens in engine.step():
            results[rid] = tokens
            done += sum(map(len, tokens)) if n > 1 else len(tokens)
        progress(done, total, started)
    if done < total:            # eos ended some early: close the bar
        progress(total, total, started)
    return [results[r] for r in rids], time.perf_counter() - started


def random_model(seed: int, layers: int):
    """A small random Llama-shaped causal LM (float32)."""
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config).eval()


def self_check(args) -> int:
    """Serve a random model three ways and compare every sequence with generate()."""
    import torch
    from . import Engine
    model, draft = random_model(args.seed, 2), random_model(args.seed + 1, 1)
    prompts = [[(7 * i + 3 * j) % 128 for j in range(4 + 3 * i)] for i in range(3)]
    new = args.max_new_tokens
    want = []
    for prompt in prompts:
        ids = torch.tensor([prompt])     # every token real: an explicit mask, no padding
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    options = dict(max_new_tokens=new)
    failures = 0
    runs = (("continuous batching", {}, 1), ("fork n = 2", {}, 2),
            (f"speculative, draft_len {args.draft_len}",
             {"draft_model": draft, "draft_len": args.draft_len}, 1))
    for name, extra, n in runs:
        engine = Engine(model, max_seqs=len(prompts) * n, capacity=64, max_write=8,
                        dtype=args.dtype or "float32", **extra)
        got, seconds = serve(engine, prompts, options, n)
        expected = [w for w in want for _ in range(n)]
        flat = [seq for out in got for seq in (out if n > 1 else [out])]
        same = flat == expected
        failures += not same
        rate = engine.acceptance_rate
        rate = ("" if not extra else ", no drafts proposed" if rate is None else
                f", draft acceptance {rate:.0%}")
        print(f"{name:<28} {len(flat)} sequences, {sum(map(len, flat)) / seconds:7.1f} "
              f"tokens/s{rate}: {'same as' if same else 'DIFFERENT from'} model.generate()")
    print("OK: every sequence matches model.generate()" if not failures else
          f"FAILED: {failures} of {len(runs)} runs differ from model.generate()")
    return 1 if failures else 0


def serve_directory(args) -> int:
    """Serve the prompts given with the model in `args.model`."""
    import transformers
    from . import Engine
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model).eval()
    tokenizer = None
    if args.prompt:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(p)["input_ids"] for p in args.prompt]
    prompts += [[int(t) for t in ids.split(",")] for ids in args.ids]
    if not prompts:
        print("python -m kvnumba generate: give --prompt TEXT or --ids 1,2,3",
              file=sys.stderr)
        return 2
    draft = (transformers.AutoModelForCausalLM.from_pretrained(args.draft).eval()
             if args.draft else None)
    engine = Engine(model, max_seqs=len(prompts), capacity=args.capacity, dtype=args.dtype,
                    draft_model=draft, draft_len=args.draft_len)
    outs, seconds = serve(engine, prompts, dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
        seed=args.seed, eos_token_id=model.generation_config.eos_token_id))
    for prompt, out in zip(prompts, outs):
        shown = tokenizer.decode(out) if tokenizer else out
        print(f"{prompt} -> {shown}")
    print(f"{sum(map(len, outs))} tokens in {seconds:.2f} s: "
          f"{sum(map(len, outs)) / seconds:.1f} tokens/s")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvnumba generate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local transformers model directory (default: a "
                                        "small random Llama, checked against generate())")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt")
    parser.add_argument("--ids", action="append", default=[],
                        help="a prompt as comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                        help="storage dtype (default: the model's)")
    parser.add_argument("--draft", help="a draft model directory (speculative decoding)")
    parser.add_argument("--draft-len", type=int, default=3)
    args = parser.parse_args(argv)
    missing = [name for name in ("torch", "transformers") if find_spec(name) is None]
    if missing:
        print(f"python -m kvnumba generate: needs the hf extra ({' and '.join(missing)} "
              f"not installed): python -m pip install 'kvnumba[hf]' (in a checkout: "
              f"python -m pip install -e '.[hf]')", file=sys.stderr)
        return 2
    with device.simulator_pace():
        return serve_directory(args) if args.model else self_check(args)
