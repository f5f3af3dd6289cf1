"""`python -m kvnumba generate`: serve prompts through `kvnumba.hf.Engine`.

With `--model DIR` (a local `transformers` model directory: `config.json`, safetensors
weights and, if present, a tokenizer), it serves the prompts given (`--prompt TEXT`
needs the tokenizer; `--ids 1,2,3` does not) and prints each prompt and output as ids
and, with a tokenizer, as text, then tokens/s. Without `--model`, it runs the
self-check of `kvnumba.hf.selfcheck`: a small random Llama served with continuous
batching, sampled forks and a partly accepted draft, each run checked against a
reference without kvnumba; exit status 1 on any difference.

A mistake of the user's (a bad option, a missing directory, a prompt that does not fit,
a model kvnumba refuses) is one line on stderr and exit status 2; the options and the
model directory are checked before the model is loaded.

Under torchrun (`torchrun --nproc-per-node N -m kvnumba generate ...`) the model, its
draft and the self-check's random models are split over the N ranks by their
tensor-parallel plan and every rank serves its share of the heads in step with rank 0.
Only rank 0 prints the output; another rank prints only its own errors, its rank named.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from importlib.util import find_spec
from pathlib import Path

from .. import device
from ..config import DTYPES
from ..errors import KVCacheError
from .speculative import DRAFT_LEN
from .sharding import launched_rank, launched_ranks, split_loading

PROG = "python -m kvnumba generate"
#: the options that apply to a model directory only (the self-check fixes its own)
MODEL_ONLY = ("prompt", "ids", "draft", "n", "eos", "ignore_eos", "temperature", "top_p",
              "capacity")
WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
EPILOG = """\
with --model: prints each prompt and output as ids (and, with a tokenizer, as text),
tokens/s, the prefix cache's hit rate and, with --draft, the draft acceptance rate.
without --model: the self-check (--max-new-tokens, --seed, --dtype, --draft-len apply):
a random 2-layer Llama served with continuous batching, sampled forks and a partly
accepted draft, each run checked against a reference without kvnumba; exit status 1 on
a difference. Exit status 2: a user error, named on one line."""


class UsageError(Exception):
    """A mistake on the command line or in the files it names; the message names the
    problem and the fix."""


class Parser(argparse.ArgumentParser):
    """argparse whose errors are a `UsageError` (one line), not usage text and exit."""

    def error(self, message):
        raise UsageError(f"{message} (see {PROG} --help)")


def _number(convert, rule: str, holds):
    """An argparse type: `convert(text)` where `holds` of it, else an error citing
    `rule`."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not holds(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {rule}")
        return value
    return parse


count = _number(int, "a whole number of at least 1", lambda v: v >= 1)
token_id = _number(int, "a token id (a whole number of at least 0)", lambda v: v >= 0)
temperature = _number(float, "a number of at least 0 (0 is greedy)",
                      lambda v: math.isfinite(v) and v >= 0)
top_p = _number(float, "a number above 0 and at most 1", lambda v: 0 < v <= 1)
seed = _number(int, "a whole number of at least 0", lambda v: v >= 0)


def token_ids(text: str) -> list:
    """`--ids 1,2,3` as a list of token ids."""
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        ids = []
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token ids "
                                         f"(whole numbers of at least 0), e.g. --ids 1,2,3")
    return ids


def parser() -> Parser:
    """The options of `python -m kvnumba generate`."""
    p = Parser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
               description="Serve prompts through kvnumba.hf.Engine.", epilog=EPILOG)
    p.add_argument("--model", metavar="DIR",
                   help="a local transformers model directory (config.json, safetensors "
                        "weights, a tokenizer for --prompt); without it, the self-check")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a text prompt, tokenized with the model's tokenizer (repeatable)")
    p.add_argument("--ids", action="append", type=token_ids, metavar="1,2,3",
                   help="a prompt as comma-separated token ids (repeatable)")
    p.add_argument("--max-new-tokens", type=count, default=8, metavar="N",
                   help="the most tokens generated per sequence (default 8)")
    p.add_argument("--n", type=count, metavar="N",
                   help="sequences per prompt, forked after one prefill (default 1)")
    p.add_argument("--eos", nargs="+", type=token_id, metavar="ID",
                   help="token ids that end a sequence, kept as its last token (default: "
                        "the model's generation_config eos, else the tokenizer's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="stop at no token: every sequence gets --max-new-tokens tokens")
    p.add_argument("--capacity", type=count, metavar="N",
                   help="the most positions of one sequence, prompt and new tokens "
                        "(default 2048)")
    p.add_argument("--temperature", type=temperature, metavar="T",
                   help="sampling temperature; 0 (the default) is greedy")
    p.add_argument("--top-p", type=top_p, metavar="P",
                   help="sample from the most likely tokens whose probability reaches P "
                        "(default 1: all)")
    p.add_argument("--seed", type=seed, default=0,
                   help="the random seed: prompt i samples with seed + i; the self-check's "
                        "random model too (default 0)")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="K/V storage dtype (default: the model's)")
    p.add_argument("--draft", metavar="DIR",
                   help="a draft model directory with the model's vocabulary "
                        "(speculative decoding); its acceptance rate is printed")
    p.add_argument("--draft-len", type=count, default=DRAFT_LEN, metavar="K",
                   help=f"draft tokens proposed per step (default {DRAFT_LEN}, as "
                        f"Engine's)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full (default: prompt prefixes another "
                        "request computed are reused; the hit rate is printed)")
    return p


def check(args) -> None:
    """Refuse (`UsageError`) option combinations and model directories that cannot
    work, before anything is loaded; fill the model-only defaults."""
    if not args.model:
        given = [name for name in MODEL_ONLY if getattr(args, name) not in (None, False)]
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise UsageError(f"{flag} applies with --model only; without --model the "
                             f"self-check serves its own prompts and models")
    else:
        if not args.prompt and not args.ids:
            raise UsageError("--model serves the prompts given: add --prompt TEXT or "
                             "--ids 1,2,3")
        if args.eos and args.ignore_eos:
            raise UsageError("--eos and --ignore-eos contradict each other: give one")
        check_directory(args.model, "--model", tokenizer=bool(args.prompt))
        if args.draft:
            check_directory(args.draft, "--draft")
    defaults = dict(prompt=[], ids=[], n=1, capacity=2048, temperature=0.0, top_p=1.0)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def check_directory(path: str, flag: str, tokenizer: bool = False) -> None:
    """A model directory: readable, with a config.json, weights and, if `tokenizer`,
    tokenizer files."""
    where = Path(path)
    if not where.is_dir():
        problem = "not a directory" if where.exists() else "no such directory"
        raise UsageError(f"{flag} {path}: {problem}; give a local model directory (one "
                         f"model.save_pretrained(DIR) wrote)")
    if not os.access(where, os.R_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: the directory cannot be read; check its "
                         f"permissions")
    if not (where / "config.json").is_file():
        raise UsageError(f"{flag} {path}: no config.json; a transformers model directory "
                         f"has one (model.save_pretrained(DIR) writes it)")
    if not any(next(where.glob(pattern), None) for pattern in WEIGHTS):
        raise UsageError(f"{flag} {path}: no weights (*.safetensors or pytorch_model.bin); "
                         f"save them with model.save_pretrained(DIR)")
    if tokenizer and not has_tokenizer(path):
        raise UsageError(f"--prompt needs a tokenizer, and {path} has none "
                         f"({', '.join(TOKENIZER_FILES)}); give the prompt as --ids 1,2,3 "
                         f"or save the tokenizer into the directory")


def has_tokenizer(path: str) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def load(loader, path: str, flag: str, **options):
    """`loader.from_pretrained(path, **options)`, or a `UsageError` naming the directory
    and what transformers said."""
    from safetensors import SafetensorError
    try:
        return loader.from_pretrained(path, **options)
    except (OSError, ValueError, SafetensorError) as exc:   # unreadable, unknown, corrupt
        raise UsageError(f"{flag} {path}: transformers cannot load it: {one_line(exc)}") \
            from exc


def check_prompts(prompts, labels, vocab: int, args) -> None:
    """Each prompt: not empty, ids inside the vocabulary, room for --max-new-tokens."""
    for prompt, label in zip(prompts, labels):
        if not prompt:
            raise UsageError(f"{label}: no tokens; give a prompt of at least one token")
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise UsageError(f"{label}: token id {bad[0]} is outside the model's vocabulary "
                             f"of {vocab} tokens; give ids from 0 to {vocab - 1}")
        need = len(prompt) + args.max_new_tokens
        if need > args.capacity:
            raise UsageError(f"{label}: {len(prompt)} tokens and --max-new-tokens "
                             f"{args.max_new_tokens} need {need} positions, more than "
                             f"--capacity {args.capacity}; raise --capacity to {need} or "
                             f"lower --max-new-tokens")


def eos_ids(args, model, tokenizer) -> tuple:
    """The eos ids to stop at and where they come from."""
    if args.ignore_eos:
        return None, "--ignore-eos"
    if args.eos:
        return args.eos, "--eos"
    ids = model.generation_config.eos_token_id
    if ids is not None:
        return ids, "the model's generation_config"
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id, "the tokenizer's"
    return None, "the model and its tokenizer name none"


def shown(ids, tokenizer) -> str:
    """Token ids and, with a tokenizer, their text (quoted, control characters escaped)."""
    return f"{ids} {tokenizer.decode(ids)!r}" if tokenizer is not None else f"{ids}"


def serve_directory(args) -> int:
    """Serve the prompts given with the model in `args.model` and print them, their
    outputs, tokens/s and (with `--draft`) the draft acceptance rate."""
    import transformers

    from . import Engine
    from .config import text_config
    from .progress import serve
    config = load(transformers.AutoConfig, args.model, "--model")
    vocab = text_config(config).vocab_size
    tokenizer = None
    if has_tokenizer(args.model):
        tokenizer = load(transformers.AutoTokenizer, args.model, "--model")
    prompts = [tokenizer(text)["input_ids"] for text in args.prompt] + args.ids
    labels = ([f"--prompt {text!r}" for text in args.prompt] +
              [f"--ids {','.join(map(str, ids))}" for ids in args.ids])
    check_prompts(prompts, labels, vocab, args)
    if args.draft:
        draft_vocab = text_config(load(transformers.AutoConfig, args.draft,
                                       "--draft")).vocab_size
        if draft_vocab != vocab:
            raise UsageError(f"--draft {args.draft}: a vocabulary of {draft_vocab} tokens, "
                             f"the model's has {vocab}; a draft model shares the model's "
                             f"vocabulary")
    split = split_loading() if launched_ranks() > 1 else {}
    model = load(transformers.AutoModelForCausalLM, args.model, "--model", **split).eval()
    draft = (load(transformers.AutoModelForCausalLM, args.draft, "--draft", **split).eval()
             if args.draft else None)
    eos, source = eos_ids(args, model, tokenizer)
    engine = Engine(model, max_seqs=len(prompts) * args.n, capacity=args.capacity,
                    dtype=args.dtype, draft_model=draft, draft_len=args.draft_len,
                    prefix_cache=not args.no_prefix_cache)
    print(f"model {args.model}: {config.model_type}, vocab {vocab}; eos "
          f"{'none' if eos is None else eos} ({source}){split_over(engine)}")
    outputs, seconds = serve(engine, prompts, n=args.n, seed=args.seed,
                             max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p,
                             eos_token_id=eos)
    for i, (prompt, sequences) in enumerate(zip(prompts, outputs), 1):
        print(f"prompt {i}: {shown(prompt, tokenizer)}")
        for sequence in sequences:
            print(f"  -> {shown(sequence, tokenizer)}")
    tokens = sum(len(seq) for sequences in outputs for seq in sequences)
    print(f"{tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")
    stats = engine.stats
    print(f"prefix cache: {stats.cached_tokens} of {stats.prompt_tokens} prompt tokens from "
          f"the index ({stats.hit_rate:.0%})" if engine.prefix_cache else "prefix cache: off")
    if args.draft:
        rate = engine.acceptance_rate
        print("draft acceptance: " + ("no drafts proposed" if rate is None else
                                      f"{rate:.0%} of the proposed tokens"))
    return 0


def split_over(engine) -> str:
    """"; split over N ranks, K of H kv heads each" for an engine of a split model."""
    if engine.lockstep is None:
        return ""
    ranks, heads = engine.lockstep.sharding.ranks, engine.config.n_kv_heads
    return f"; split over {ranks} ranks, {heads} of {heads * ranks} kv heads each"


class NotATerminal:
    """`stream`, saying it is not a terminal (so no progress bar is drawn on it)."""

    def __init__(self, stream):
        self.stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def printing_on_rank_zero():
    """Under torchrun, the ranks other than 0 print no output (it would be rank 0's) and
    no progress bars; their errors still reach stderr."""
    if launched_rank() == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), \
            contextlib.redirect_stderr(NotATerminal(sys.stderr)):
        yield


def split_needs() -> tuple:
    """The packages loading a model split over torchrun's ranks needs beyond one
    process's: `accelerate`, with which transformers splits it (none without torchrun)."""
    return ("accelerate",) if launched_ranks() > 1 else ()


def refused(prog: str, exc: BaseException) -> int:
    """Print a user error as one line on stderr, naming this rank under torchrun (rank 0
    and one process: unnamed); returns exit status 2."""
    rank = launched_rank()
    print(f"{prog}{f' (rank {rank})' if rank else ''}: {one_line(exc)}", file=sys.stderr)
    return 2


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (transformers' span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv=None) -> int:
    """`python -m kvnumba generate [options]`: the exit status (0 done, 1 a self-check
    difference, 2 a user error, printed as one line on stderr). Under torchrun, only rank
    0 prints the output."""
    with printing_on_rank_zero():
        return _main(argv)


def _main(argv) -> int:
    try:
        args = parser().parse_args(argv)
        needed = ("torch", "transformers") + split_needs()
        missing = [name for name in needed if find_spec(name) is None]
        if missing:
            raise UsageError(f"needs the hf extra ({' and '.join(missing)} not installed): "
                             f"python -m pip install -e '.[hf]' in a "
                             f"kvnumba checkout")
        check(args)
        if not sys.stderr.isatty():     # transformers' loading bars would log \r frames
            import transformers
            transformers.utils.logging.disable_progress_bar()
        with device.simulator_pace():
            if args.model:
                return serve_directory(args)
            from .selfcheck import self_check
            return self_check(args)
    except (UsageError, KVCacheError, OSError) as exc:
        return refused(PROG, exc)
