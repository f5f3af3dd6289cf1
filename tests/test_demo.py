"""The demo end to end: every feature, checked against the cache-free reference; and a
single corrupted cache byte makes it fail. Plus the reference's masks (the window's
off-by-one) against the tests' own oracle."""
import subprocess
import sys

import numpy as np
import pytest

from kvnumba import demo, reference

from oracle import dense_attention

FEATURES = {"chunked prefill", "speculative draft", "fork", "draft block", "padding",
            "ring wrap", "flat growth", "close"}


def test_demo_default_run_matches_the_reference():
    result = demo.run(out=None)
    assert result.ok and result.completed, result.mismatches
    assert not result.mismatches
    assert FEATURES <= set(result.features)
    assert all(r.ok for r in result.steps)
    # every feature really ran
    kinds = [r.kind for r in result.steps]
    for kind in ("prefill", "decode", "draft verify", "decode (fork)", "draft block",
                 "block verify"):
        assert any(k.startswith(kind) for k in kinds), kinds
    assert "abutting" in result.features["chunked prefill"]
    assert "over 2 steps" in result.features["chunked prefill"]
    assert "accepted 2, rewound 2" in result.features["speculative draft"]
    assert "holds 13 rows" in result.features["ring wrap"]        # W + max_write - 1 = 6 + 8 - 1
    assert any(r.width > r.n_tokens for r in result.steps)          # padded steps
    assert any(r.n_segments >= 4 for r in result.steps)             # the fork decodes too
    # the sessions: three prompts of different lengths and a fork, all generating
    assert [s.origin for s in result.sessions][:3] == ["prompt"] * 3
    assert result.sessions[3].origin.startswith("fork of")
    assert len({s.prompt_len for s in result.sessions[:3]}) == 3
    assert all(s.match and s.generated for s in result.sessions)
    assert result.sessions[0].generated == result.sessions[0].reference


def _flip_one_byte(cache, table):
    """Flip the lowest exponent bit of one V element of session 1, position 0, flat layer 0."""
    _, v = cache.layer_data(0)
    host = v.copy_to_host()
    raw = host.view(np.uint8).reshape(host.shape + (host.itemsize,))
    page = cache.page_table(table.seq(1), 0)[0]     # position 0 is slot 0 of its first page
    raw[page, 0, 0, 0, 2] ^= 0x80             # little-endian float32: byte 2 bit 7
    v.copy_to_device(host)


def test_one_wrong_cache_byte_makes_the_demo_fail(capsys):
    rc = demo.main(["--fail-fast", "--decode-steps", "0"], tamper=_flip_one_byte,
                   tamper_step=2)
    out = capsys.readouterr().out
    assert rc == 1
    assert "MISMATCH step 3: session 1: layer 0 attention" in out
    assert "FAILED" in out and "stopped early" in out


def test_tampered_run_reports_without_fail_fast():
    """Without --fail-fast the run goes on to the end and still reports the difference."""
    calls = []

    def tamper(cache, table):
        calls.append(1)
        _flip_one_byte(cache, table)

    result = demo.run(out=None, tamper=tamper, tamper_step=1, sessions=1, decode_steps=0)
    assert calls == [1]
    assert not result.ok and result.completed
    assert result.mismatches[0].startswith("step 2: session 1:")
    assert not result.sessions[0].match


def test_cli_help():
    out = subprocess.run([sys.executable, "-m", "kvnumba", "demo", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "--seed" in out.stdout and "--decode-steps" in out.stdout
    assert "{bfloat16,float16,float32}" in out.stdout        # --dtype, as the README says


def test_cli_flags_are_the_options():
    """The parser's defaults are `Options()`'s, and a flag's value reaches its field."""
    flags = vars(demo.parser().parse_args([]))
    del flags["fail_fast"], flags["quiet"]
    assert demo.Options(**flags) == demo.Options()
    flags = vars(demo.parser().parse_args(["--layers", "ring:3,flat", "--max-write", "5"]))
    assert (flags["layers"], flags["max_write"]) == ((3, None), 5)


@pytest.mark.parametrize("window", [None, 1, 3, 6])
@pytest.mark.parametrize("block", [False, True])
def test_reference_attention_agrees_with_the_test_oracle(window, block):
    rng = np.random.default_rng(0)
    n, pos_start = 11, 7                       # queries at positions 7..10 of 11 keys
    q = rng.standard_normal((4, 4, 8))
    k = rng.standard_normal((n, 2, 8))
    v = rng.standard_normal((n, 2, 8))
    blocks = [(pos_start, n)] if block else ()
    got = reference.attention(q, k, v, np.arange(pos_start, n), window=window, blocks=blocks)
    want = dense_attention(q, k, v, pos_start, window, block, scale=1 / np.sqrt(8))
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_reference_window_off_by_one():
    # W = 4: the query at 10 sees 7, 8, 9, 10 (FlashAttention window_size=(3, 0),
    # Hugging Face sliding_window=4)
    assert [j for j in range(12) if reference.visible(10, j, 4)] == [7, 8, 9, 10]
    assert [j for j in range(12) if reference.visible(10, j, None)] == list(range(11))
    # a draft block [9, 12): every block key, plus the history its window allows
    assert [j for j in range(12) if reference.visible(9, j, 4, (9, 12))] == [6, 7, 8, 9, 10, 11]
    assert [j for j in range(12) if reference.visible(11, j, 2, (9, 12))] == [9, 10, 11]
