"""Record llama.cpp's perplexity on tests/fixtures/perplexity-corpus.txt for the chat-tiny models.

Run with a Python that has llama-cpp-python installed:

    python scripts/make_perplexity_reference.py ../shared/fixtures/models/chat-tiny-*.gguf

llama-cpp-python's wheel ships libllama but not the `llama-perplexity` tool, so this script
repeats that tool's default computation (tools/perplexity/perplexity.cpp, `perplexity()`) through
the library: the text as `-f` reads it (one trailing newline dropped), tokenized whole with BOS
and without parsing control tokens; chunks of n_ctx tokens from an empty KV cache, each chunk's
first token replaced by BOS; the second half of each chunk scored (the logits at positions
n_ctx/2 ... n_ctx-2 against the next token), with log-softmax as the tool computes it (float
logits, the sum of exponentials in double); the final "PPL = x +/- y" from the mean negative
log-likelihood and its standard error. It writes tests/reference/perplexity.json.
"""

import json
import math
import sys
from pathlib import Path

import llama_cpp
import llama_cpp_cpu  # noqa: F401  (must come before any Llama is created)
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "fixtures" / "perplexity-corpus.txt"
OUT = ROOT / "tests" / "reference" / "perplexity.json"
CONTEXTS = (128, 512)


def negative_log_likelihood(logits: np.ndarray, token: int) -> float:
    """As perplexity.cpp's log_softmax: float32 differences and exponentials, summed in double."""
    peak = logits.max()
    sum_exp = np.exp(logits - peak, dtype=np.float32).astype(np.float64).sum()
    return -(float(logits[token] - peak) - math.log(sum_exp))


def perplexity(path: Path, text: str, n_ctx: int) -> dict:
    llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=2, verbose=False)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model))
    n_chunks, first = len(tokens) // n_ctx, n_ctx // 2
    assert n_chunks >= 2, f"{len(tokens)} tokens is less than two chunks of {n_ctx}"
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if add_bos:
            chunk = [llm.token_bos()] + chunk[1:]
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float32)
        for j in range(first, n_ctx - 1):
            v = negative_log_likelihood(logits[j], chunk[j + 1])
            nll, nll2, count = nll + v, nll2 + v * v, count + 1
        running.append(math.exp(nll / count))
    mean, mean2 = nll / count, nll2 / count
    ppl = math.exp(mean)
    return {"ppl": ppl, "uncertainty": math.sqrt((mean2 - mean * mean) / (count - 1)) * ppl, "n_tokens": len(tokens),
            "n_chunks": n_chunks, "n_scored": count, "running": running}


def main(paths):
    text = TEXT.read_text(encoding="utf-8")
    text = text[:-1] if text.endswith("\n") else text
    record = {"text": TEXT.name, "llama_cpp_python": llama_cpp.__version__, "models": {}}
    for path in map(Path, sorted(paths)):
        record["models"][path.stem] = {str(n_ctx): perplexity(path, text, n_ctx) for n_ctx in CONTEXTS}
        print(path.stem, {n: round(r["ppl"], 4) for n, r in record["models"][path.stem].items()})
    OUT.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1:])
