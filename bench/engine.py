"""The Hugging Face engine against `model.generate()` with the same model, on a GPU.

A random Llama-shaped model of about 100M parameters (float16), a batch of 32 prompts
of 128 tokens, 128 new tokens each, greedy: `kvnumba.hf.Engine.generate` against
`model.generate()` (transformers' own cache and SDPA attention, the batch as one
tensor). Reported: tokens/s of both and their ratio. Needs PyTorch with CUDA and
`transformers` (`kvnumba[hf]`); elsewhere the row says why it was not run.

    python -m kvnumba.bench.engine [--quick]
"""
from __future__ import annotations

import argparse
import time

BATCH, PROMPT, NEW = 32, 128, 128


def skip_reason() -> str | None:
    """Why the engine row cannot run here, or None."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"needs kvnumba[hf] ({exc.name} missing)"
    if not torch.cuda.is_available():
        return "needs PyTorch with CUDA and a GPU"
    return None


def model_of_100m():
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=8, num_attention_heads=12,
                                      num_key_value_heads=4, max_position_embeddings=1024)
    return transformers.LlamaForCausalLM(config).to("cuda", torch.float16).eval()


def run(quick: bool = False) -> dict:
    """`{"skipped": reason}` or the figures."""
    reason = skip_reason()
    if reason:
        return {"skipped": reason}
    import torch
    from kvnumba.hf import Engine
    new = 16 if quick else NEW
    model = model_of_100m()
    params = sum(p.numel() for p in model.parameters())
    prompts = torch.randint(0, model.config.vocab_size, (BATCH, PROMPT), device="cuda")
    model.generate(prompts[:2], max_new_tokens=2, do_sample=False)     # warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    torch.cuda.synchronize()
    peer = BATCH * new / (time.perf_counter() - start)
    engine = Engine(model, max_seqs=BATCH, capacity=PROMPT + new, max_write=PROMPT,
                    max_step=BATCH * PROMPT)
    engine.generate(prompts[:2].tolist(), max_new_tokens=2)          # compile, warm up
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.generate(prompts.tolist(), max_new_tokens=new)
    torch.cuda.synchronize()
    ours = BATCH * new / (time.perf_counter() - start)
    return dict(params=params, batch=BATCH, prompt=PROMPT, new_tokens=new,
                engine_tokens_per_s=ours, generate_tokens_per_s=peer, ratio=ours / peer)


def report(result: dict) -> str:
    if "skipped" in result:
        return f"engine vs model.generate(): not run ({result['skipped']})"
    return (f"engine vs model.generate(): Llama {result['params'] / 1e6:.0f}M float16, "
            f"{result['batch']} prompts x {result['prompt']} tokens, {result['new_tokens']} "
            f"new each: {result['engine_tokens_per_s']:.0f} tokens/s against "
            f"{result['generate_tokens_per_s']:.0f} ({result['ratio']:.2f}x)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvnumba.bench.engine",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 new tokens, not 128")
    print(report(run(parser.parse_args(argv).quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
