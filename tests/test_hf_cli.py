"""`python -m kvnumba generate`: a saved model directory served and printed (ids, text,
forks, eos, a draft's acceptance), checked against references that run without
kvnumba (`model.generate()`, the replayed sampler); the progress bar only on a
terminal; each user error one line and exit status 2; the self-check's runs. The
models are `test_hf`'s tiny ones and the runs a few tokens (the CUDA simulator runs
every step's kernels thread by thread)."""
import ast
import io
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kvnumba.hf import cli, selfcheck  # noqa: E402
from kvnumba.hf.progress import ProgressBar  # noqa: E402
from hfmodels import PROMPTS, generated, tiny  # noqa: E402

VOCAB = 64          # test_hf's models


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def char_tokenizer():
    """A tokenizer of one token per character `chr(0)` to `chr(63)` (control characters,
    space, digits, punctuation): text in, text out, no special tokens."""
    model = tokenizers.models.BPE(vocab={chr(i): i for i in range(VOCAB)}, merges=[])
    backend = tokenizers.Tokenizer(model)
    backend.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def printed(out: str) -> list:
    """The token ids of each output line (`  -> [...]`, the self-check's `  1.2 -> [...]`),
    in order."""
    lines = (re.match(r"  (?:[\d.]+ )?-> (\[[\d, ]*\])", line) for line in out.splitlines())
    return [ast.literal_eval(line.group(1)) for line in lines if line]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """test_hf's tiny Llama saved (config.json, safetensors, generation_config with eos 2;
    no tokenizer)."""
    path = tmp_path_factory.mktemp("llama")
    tiny("llama").save_pretrained(path, safe_serialization=True)
    return path


def test_generate_serves_a_saved_model_directory(tmp_path, capsys):
    """A model directory with a tokenizer: a text prompt and an ids prompt, each printed
    as ids and as text with control characters escaped, the outputs `model.generate()`'s
    with the directory as its own draft (every draft accepted); stderr is not a
    terminal, so no progress bar."""
    model = tiny("qwen2")
    model.save_pretrained(tmp_path, safe_serialization=True)
    char_tokenizer().save_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)   # as the CLI loads it
    text, ids = "1+2=", [5, 9, 3, 0]
    capsys.readouterr()                         # saving's own progress bars
    code = cli.main(["--model", str(tmp_path), "--prompt", text, "--ids", "5,9,3,0",
                     "--max-new-tokens", "3", "--dtype", "float32", "--ignore-eos",
                     "--draft", str(tmp_path), "--draft-len", "2"])
    out, err = capsys.readouterr()
    assert code == 0
    prompts = [tokenizer(text)["input_ids"], ids]
    for i, prompt in enumerate(prompts, 1):
        want = generated(model, prompt, 3)
        assert (f"prompt {i}: {prompt} {tokenizer.decode(prompt)!r}\n"
                f"  -> {want} {tokenizer.decode(want)!r}\n") in out
    assert "'1+2='" in out and r"'\x05\t\x03\x00'" in out
    assert not any(c < " " for c in out.replace("\n", ""))     # control characters escaped
    assert "draft acceptance: 100%" in out and "eos none (--ignore-eos)" in out
    n_prompt = sum(map(len, prompts))           # nothing shared: nothing from the index
    assert f"prefix cache: 0 of {n_prompt} prompt tokens from the index (0%)" in out
    assert "\r" not in err and "tokens/s" not in err


def test_forks_and_eos_reach_the_engine_and_the_bar_closes_at_the_tokens_generated(
        llama_dir, capsys, monkeypatch):
    """`--n 2` sampled forks and two `--eos` ids, each fork's tokens those the reference
    sampler draws replaying the engine's generators with the plain model; eos ends a
    fork early, and the progress bar (stderr a terminal) ends at the tokens generated,
    not at the 16 asked for."""
    model = tiny("llama")
    prompts, new, seed = [PROMPTS[0], PROMPTS[1][:4]], 4, 5

    def reference(eos):
        return [selfcheck.sampled_reference(model, p, n=2, max_new_tokens=new, seed=seed + i,
                                            temperature=1.0, eos_token_id=eos)
                for i, p in enumerate(prompts)]
    endless = reference(None)
    eos = [endless[0][0][1], endless[1][1][2]]     # end fork 1.1 at its 2nd token at most
    want = reference(eos)
    assert len(want[0][0]) <= 2 and all(len(set(map(tuple, w))) == 2 for w in want)
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = cli.main(["--model", str(llama_dir), *(f"--ids={','.join(map(str, p))}"
                                                  for p in prompts),
                     "--n", "2", "--temperature", "1", "--seed", str(seed), "--max-new-tokens",
                     str(new), "--eos", *map(str, eos), "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0
    assert printed(out) == [seq for sequences in want for seq in sequences]
    assert f"eos {eos} (--eos)" in out
    total = sum(len(seq) for sequences in want for seq in sequences)
    assert total < 2 * 2 * new
    # the bar's frames (on a terminal, transformers draws its loading bars there too)
    frames = [f for f in terminal.getvalue().split("\r") if "tokens/s" in f]
    assert frames and all("/16 tokens" in f for f in frames[:-1])
    assert re.match(rf"\[#{{30}}\] {total} tokens, [\d.]+ tokens/s *\n$", frames[-1])


def test_the_progress_bar_is_drawn_only_on_a_terminal():
    bar = ProgressBar(8, Terminal())
    bar.update(3)
    bar.close(5)
    frames = bar.stream.getvalue().split("\r")[1:]
    assert [f.split(" tokens")[0] for f in frames] == [f"[{'#' * 11}{' ' * 19}] 3/8",
                                                      f"[{'#' * 30}] 5"]
    assert len(frames[1].rstrip("\n")) >= len(frames[0])    # blanks the longer frame
    piped = io.StringIO()
    bar = ProgressBar(8, piped)
    bar.update(3)
    bar.close(5)
    assert piped.getvalue() == ""


def test_the_default_eos_is_the_generation_configs_else_the_tokenizers():
    args = SimpleNamespace(ignore_eos=False, eos=None)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7]))
    bare = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None))
    tokenizer = SimpleNamespace(eos_token_id=9)
    assert cli.eos_ids(args, model, tokenizer)[0] == [2, 7]
    assert cli.eos_ids(args, bare, tokenizer)[0] == 9
    assert cli.eos_ids(args, bare, None)[0] is None
    assert cli.eos_ids(SimpleNamespace(ignore_eos=False, eos=[4]), model, tokenizer)[0] == [4]
    assert cli.eos_ids(SimpleNamespace(ignore_eos=True, eos=None), model, tokenizer)[0] is None


@pytest.fixture(scope="module")
def broken_dirs(tmp_path_factory, llama_dir):
    """Directories `--model` must refuse, by name."""
    root = tmp_path_factory.mktemp("broken")
    (root / "a_file").write_text("")
    config_json = (llama_dir / "config.json").read_text()
    for name, config in (("no_config", None), ("no_weights", config_json),
                         ("bad_json", "{bad"), ("corrupt", config_json)):
        (root / name).mkdir()
        if config is not None:
            (root / name / "config.json").write_text(config)
    for name in ("no_config", "bad_json", "corrupt"):
        (root / name / "model.safetensors").write_bytes(b"not safetensors")
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=1, n_head=4))
    bloom.save_pretrained(root / "bloom", safe_serialization=True)
    tiny("llama").to(torch.bfloat16).save_pretrained(root / "bf16", safe_serialization=True)
    tiny("llama", vocab_size=32).save_pretrained(root / "vocab32", safe_serialization=True)
    return root


USER_ERRORS = {
    "ids-parse": (["--ids", "1,x"], r"argument --ids: '1,x': expected comma-separated token "
                                    r"ids .* e\.g\. --ids 1,2,3"),
    "zero-tokens": (["--max-new-tokens", "0"], r"--max-new-tokens: '0': expected a whole "
                                               r"number of at least 1"),
    "temperature-nan": (["--temperature", "nan"], r"--temperature: 'nan': expected a number"),
    "top-p": (["--top-p", "1.5"], r"--top-p: '1.5': expected a number above 0 and at most 1"),
    "eos-negative": (["--eos", "-1"], r"--eos: '-1': expected a token id"),
    "unknown-option": (["--top-k", "3"], r"unrecognized arguments: --top-k 3 \(see .*--help\)"),
    "model-only": (["--n", "2"], r"--n applies with --model only"),
    "no-prompt": (["--model", "{llama}"], r"add --prompt TEXT or --ids 1,2,3"),
    "eos-both": (["--model", "{llama}", "--ids", "1", "--eos", "2", "--ignore-eos"],
                 r"--eos and --ignore-eos contradict each other"),
    "missing-dir": (["--model", "{broken}/nowhere", "--ids", "1"], r"no such directory"),
    "not-a-dir": (["--model", "{broken}/a_file", "--ids", "1"], r"a_file: not a directory"),
    "no-config": (["--model", "{broken}/no_config", "--ids", "1"], r"no config\.json"),
    "no-weights": (["--model", "{broken}/no_weights", "--ids", "1"],
                   r"no weights \(\*\.safetensors or pytorch_model\.bin\)"),
    "bad-json": (["--model", "{broken}/bad_json", "--ids", "1"],
                 r"bad_json: transformers cannot load it: .*not a valid JSON file"),
    "corrupt-weights": (["--model", "{broken}/corrupt", "--ids", "1"],
                        r"corrupt: transformers cannot load it"),
    "no-tokenizer": (["--model", "{llama}", "--prompt", "hi"],
                     r"--prompt needs a tokenizer, and .* has none .* give the prompt as "
                     r"--ids"),
    "outside-vocab": (["--model", "{llama}", "--ids", "1,64"],
                      r"--ids 1,64: token id 64 is outside the model's vocabulary of 64 "
                      r"tokens; give ids from 0 to 63"),
    "capacity": (["--model", "{llama}", "--ids", "1,2,3", "--capacity", "8"],
                 r"--ids 1,2,3: 3 tokens and --max-new-tokens 8 need 11 positions, more than "
                 r"--capacity 8; raise --capacity to 11"),
    "draft-vocab": (["--model", "{llama}", "--ids", "1", "--draft", "{broken}/vocab32"],
                    r"--draft .*vocab32: a vocabulary of 32 tokens, the model's has 64; a "
                    r"draft model shares the model's vocabulary"),
    "refused-model": (["--model", "{broken}/bloom", "--ids", "1"],
                      r"bloom: its attention does not go through transformers' "
                      r"AttentionInterface"),
}


@pytest.mark.parametrize("case", sorted(USER_ERRORS))
def test_each_user_error_is_one_line_and_exit_status_2(case, llama_dir, broken_dirs, capsys):
    argv, message = USER_ERRORS[case]
    argv = [a.format(llama=llama_dir, broken=broken_dirs) for a in argv]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("kvnumba: no CUDA")]
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("python -m kvnumba generate: ")
    assert re.search(message, lines[0]), lines[0]


def test_a_bfloat16_checkpoint_is_served_without_ml_dtypes(broken_dirs, capsys, monkeypatch):
    """A bfloat16 model directory (storage bfloat16, the model's dtype) generates with
    ml_dtypes unimportable: only NumPy host copies of bfloat16 need it."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)      # `import ml_dtypes` raises
    assert cli.main(["--model", str(broken_dirs / "bf16"), "--ids", "1,2",
                     "--max-new-tokens", "2", "--ignore-eos"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"model {broken_dirs / 'bf16'}: llama, vocab {VOCAB}")
    new = ast.literal_eval(out[2].split("->")[1].strip())
    assert len(new) == 2 and all(0 <= t < VOCAB for t in new)


def test_a_user_error_from_the_shell_has_no_traceback():
    run = subprocess.run([sys.executable, "-m", "kvnumba", "generate", "--ids", "1,-2"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [
        "python -m kvnumba generate: argument --ids: '1,-2': expected comma-separated token "
        "ids (whole numbers of at least 0), e.g. --ids 1,2,3 (see python -m kvnumba "
        "generate --help)"]


def test_a_bug_keeps_its_traceback(llama_dir, monkeypatch):
    """Only user errors are caught: anything else propagates."""
    def broken(args):
        raise RuntimeError("a bug")
    monkeypatch.setattr(cli, "serve_directory", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["--model", str(llama_dir), "--ids", "1"])


def test_under_torchrun_another_rank_prints_only_its_errors_naming_its_rank(monkeypatch,
                                                                           capsys):
    """Rank 1 of a torchrun job: what rank 0 prints (here `--help`) it does not; a user
    error is still its one line on stderr, naming the rank."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "usage: python -m kvnumba generate" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert capsys.readouterr().out == ""
    assert cli.main(["--n", "2"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1] == (
        "python -m kvnumba generate (rank 1): --n applies with --model only; without "
        "--model the self-check serves its own prompts and models")


def test_generate_self_check_reports_each_run_and_fails_on_a_difference(monkeypatch, capsys):
    """The self-check (no `--model`) prints the model's shape, the prompts and each run's
    sequences: greedy continuous batching against `model.generate()`, sampled forks that
    differ against the reference sampler, a draft partly accepted against
    `model.generate()`. With the first run's last token changed, that run is reported
    different, the others the same, and the exit status is 1. (Two of its prompts, the
    shortest and the one prefilled in two chunks, keep the simulator's time down.)"""
    calls = []
    monkeypatch.setattr(selfcheck, "PROMPTS", [selfcheck.PROMPTS[0], selfcheck.PROMPTS[-1]])
    assert len(selfcheck.PROMPTS[-1]) > selfcheck.MAX_WRITE

    def serve_then_change_the_first_run(*args, **kwargs):
        outs, seconds = served(*args, **kwargs)
        if not calls:
            outs[0][0][-1] = (outs[0][0][-1] + 1) % selfcheck.SHAPE["vocab_size"]
        calls.append(outs)
        return outs, seconds

    served = selfcheck.serve
    monkeypatch.setattr(selfcheck, "serve", serve_then_change_the_first_run)
    assert cli.main(["--max-new-tokens", "3", "--draft-len", "1"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("model: random Llama (seed 0): 2 layers, 4 heads, 2 kv heads, "
                          "head_dim 16, vocab 128; storage float32\n")
    for i, prompt in enumerate(selfcheck.PROMPTS, 1):
        assert f"prompt {i}: {prompt}\n" in out
    runs = {line.partition(":")[0]: line for line in out.splitlines()
            if line.startswith(("continuous batching:", "forks:", "speculative:"))}
    assert runs["continuous batching"].endswith("DIFFERENT from model.generate()")
    assert runs["forks"].endswith("same as the reference sampler")
    assert "the forks differ for 2 of 2 prompts" in runs["forks"]
    assert runs["speculative"].endswith("same as model.generate()")
    rate = int(re.search(r"draft acceptance (\d+)%", runs["speculative"]).group(1))
    assert 0 < rate < 100
    assert out.endswith("FAILED: continuous batching\n")
    assert len(calls) == 3
    forks = calls[1]
    assert all(len(sequences) == 2 and sequences[0] != sequences[1] for sequences in forks)
    assert printed(out) == [seq for run in calls for sequences in run for seq in sequences]
