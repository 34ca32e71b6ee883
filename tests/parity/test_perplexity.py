"""`mlxllama perplexity` against llama.cpp's perplexity tool on the same files and text.

tests/reference/perplexity.json is made by scripts/make_perplexity_reference.py (llama.cpp through
llama-cpp-python), on tests/fixtures/perplexity-corpus.txt, which scripts/make_perplexity_corpus.py
sampled from chat-tiny F16.

tests/reference/perplexity-exact.json is made by scripts/exact_perplexity.py: the same computation
as a plain numpy float64 forward pass over the dequantized weights, with no rounding of
activations. At ctx 512 llama.cpp's CPU figures for the K-quants are off from it by 1.5-3.4%
(its quantized matmuls round activations to 8 bits; on F32 copies of the same weights it is within
0.1%), so ctx 512 is checked against the exact figures rather than llama.cpp's.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner

import mlxllama
from conftest import REFERENCE, REPO_FIXTURES, find_fixture_model
from mlxllama.cli import main
from mlxllama.errors import MlxLlamaError
from mlxllama.perplexity import perplexity, read_text

CORPUS = REPO_FIXTURES / "perplexity-corpus.txt"
LLAMA_CPP = json.loads((REFERENCE / "perplexity.json").read_text())
EXACT = json.loads((REFERENCE / "perplexity-exact.json").read_text())
N_CTX = 128
ORDER = ["F16", "Q8_0", "Q4_K_M", "Q2_K"]
# F16 and the K-quants whose ctx-512 figures llama.cpp gets 1.4-3.4% off (about 10 s each on 2 cores).
EXACT_512 = ["F16", "Q6_K", "Q5_K_M", "Q4_K_M", "Q3_K_M", "Q2_K"]


@lru_cache(maxsize=None)
def runtime(quant: str):
    return mlxllama.load(find_fixture_model(f"chat-tiny-{quant}.gguf"))


@lru_cache(maxsize=None)
def our_ppl(quant: str):
    m = runtime(quant)
    return perplexity(m.model, m.tokenize(read_text(str(CORPUS))), N_CTX, m.tokenizer.bos_id)


def exact(quant: str, n_ctx: int) -> dict:
    return EXACT["models"][f"chat-tiny-{quant}"][str(n_ctx)]


def llama_cpp(quant: str, n_ctx: int = N_CTX) -> dict:
    return LLAMA_CPP["models"][f"chat-tiny-{quant}"][str(n_ctx)]


@pytest.fixture
def cli_with_fixed_nll(monkeypatch):
    """The CLI with every scored token costing 2 nats, to check its output without computing."""
    monkeypatch.setattr("mlxllama.cli.load_model", lambda path, context_length=None: runtime("Q4_K_M"))
    monkeypatch.setattr("mlxllama.perplexity.chunk_nll",
                        lambda model, chunk, first: np.full(len(chunk) - first - 1, 2.0))
    return lambda *args: CliRunner().invoke(main, ["perplexity", str(CORPUS), *args])


def test_cli_prints_llama_cpps_lines(cli_with_fixed_nll):
    result = cli_with_fixed_nll("--ctx", "128")
    assert result.exit_code == 0, result.output
    # As llama.cpp prints: the running estimate after each chunk, then the final one.
    assert result.stderr.strip() == ",".join(f"[{i}]7.3891" for i in range(1, 11)) + ","
    assert result.stdout == "Final estimate: PPL = 7.3891 +/- 0.00000  (10 chunks of 128, 630 tokens scored)\n"


@pytest.mark.parametrize("quant", ORDER)
def test_within_one_percent_of_llama_cpp(quant):
    ours, reference = our_ppl(quant), llama_cpp(quant)
    assert (ours.n_tokens, ours.n_chunks, ours.n_scored) == (
        reference["n_tokens"], reference["n_chunks"], reference["n_scored"])
    assert ours.ppl == pytest.approx(reference["ppl"], rel=0.01)
    assert ours.uncertainty == pytest.approx(reference["uncertainty"], rel=0.05)


@pytest.mark.parametrize("quant", EXACT_512)
def test_ctx_512_within_one_percent_of_the_exact_figure(quant):
    """Against scripts/exact_perplexity.py's float64 computation: the issue asks 1%; on the CPU 0.04% is
    observed (Q5_K_M), 0.002% on the rest, and on an H100 in float16 under 0.5%."""
    m, reference = runtime(quant), exact(quant, 512)
    ours = perplexity(m.model, m.tokenize(read_text(str(CORPUS))), 512, m.tokenizer.bos_id)
    assert (ours.n_tokens, ours.n_chunks, ours.n_scored) == (
        reference["n_tokens"], reference["n_chunks"], reference["n_scored"])
    assert ours.ppl == pytest.approx(reference["ppl"], rel=0.005)
    assert ours.uncertainty == pytest.approx(reference["uncertainty"], rel=0.05)


def test_quantizations_are_ordered_as_their_exact_figures():
    """F16 lowest and Q2_K clearly highest, Q8_0 and Q4_K_M a near-tie, on text sampled from F16.

    On this model the mean KL divergence from F16 is about 6e-6 (Q8_0) and 7e-5 (Q4_K_M) nats per
    token, so the first three differ by hundredths of a percent. llama.cpp puts Q8_0 below Q4_K_M;
    the exact figures put it 0.02% above (6.773509 against 6.772305), as ours do on the CPU.
    """
    ours = dict(zip(ORDER, (our_ppl(q).ppl for q in ORDER)))
    assert ours["F16"] < min(ours["Q8_0"], ours["Q4_K_M"]) and ours["Q2_K"] > 1.01 * max(ours[q] for q in ORDER[:3])
    assert ours["Q8_0"] == pytest.approx(ours["Q4_K_M"], rel=1e-3)
    assert [llama_cpp(q)["ppl"] for q in ORDER] == sorted(llama_cpp(q)["ppl"] for q in ORDER)
    assert exact("Q4_K_M", N_CTX)["ppl"] < exact("Q8_0", N_CTX)["ppl"]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="float32 and the CPU's exact forms of the K-types")
@pytest.mark.parametrize("quant", ORDER)
def test_ctx_128_matches_the_exact_figure_on_the_cpu(quant):
    """Every weight at the file's value and float32 throughout: within 0.001% of the float64
    computation (before the K-types' sub-block form, Q4_K_M was 0.04% off and Q2_K 0.03%)."""
    assert our_ppl(quant).ppl == pytest.approx(exact(quant, N_CTX)["ppl"], rel=1e-5)


def test_the_computation_is_llama_cpps():
    """Against a direct computation: chunks from BOS, the second half of each scored, a partial chunk dropped."""
    m = runtime("Q4_K_M")
    n_ctx = 16
    tokens = m.tokenize(read_text(str(CORPUS)))[: 3 * n_ctx + 5]
    result = perplexity(m.model, tokens, n_ctx, m.tokenizer.bos_id)
    nll = []
    for start in range(0, 3 * n_ctx, n_ctx):
        chunk = [m.tokenizer.bos_id] + tokens[start + 1 : start + n_ctx]
        logits = m.logits(chunk).astype(np.float64)
        log_probs = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
            - logits.max(1, keepdims=True)
        nll += [-log_probs[j, chunk[j + 1]] for j in range(n_ctx // 2, n_ctx - 1)]
    assert (result.n_chunks, result.n_scored) == (3, 3 * 7)
    assert result.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
    assert result.uncertainty == pytest.approx(np.std(nll) / math.sqrt(len(nll) - 1) * result.ppl, rel=1e-4)
    assert len(result.running) == 3 and result.running[-1] == result.ppl


def test_text_too_short_and_context_too_long_are_clear_errors(tmp_path):
    m = runtime("Q4_K_M")
    with pytest.raises(MlxLlamaError, match="the text is 6 tokens; perplexity with --ctx 128 needs at least 256"):
        perplexity(m.model, m.tokenize("The capital of Italy is"), 128, 1)
    with pytest.raises(MlxLlamaError, match="more than the model's context of 512"):
        perplexity(m.model, list(range(2048)), 1024, 1)
    short = tmp_path / "short.txt"
    short.write_text("Hello.\n")
    result = CliRunner().invoke(main, ["perplexity", str(short)])
    assert result.exit_code == 2 and "needs at least 1024" in result.output


def test_read_text_drops_one_trailing_newline_as_llama_cpp(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("a\n\n")
    assert read_text(str(path)) == "a\n"


def test_json_output(cli_with_fixed_nll):
    result = cli_with_fixed_nll("--ctx", "256", "--json")
    payload = json.loads(result.stdout)
    assert payload["ppl"] == pytest.approx(math.exp(2.0)) and payload["uncertainty"] == 0.0
    assert (payload["n_ctx"], payload["n_tokens"], payload["n_chunks"], payload["n_scored"]) == (256, 1294, 5, 5 * 127)
    assert len(payload["running"]) == 5 and result.stderr == ""
