"""Prompt caches on disk: `cache-prompt` saves a prefix's keys and values, `--prompt-cache`
reuses them on generate, chat and batch with the same output as without, and a file that does not
belong to the run is a one-line error."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from click.testing import CliRunner

import mlxllama.runtime
from mlxllama.cli import main

from conftest import PACKAGE_DATA, REPO_FIXTURES

DOC = "The capital of Japan is Tokyo. The capital of Italy is Rome. " * 12
QUESTION = DOC + "What is the capital of Japan?"


def run(*args, input=None):
    return CliRunner().invoke(main, list(args), input=input)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "doc.safetensors"
    result = run("cache-prompt", "-p", DOC, "-o", str(path))
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("cached ") and "(template: gguf (zephyr))" in result.stderr
    return path


def generate(*args) -> dict:
    result = run("generate", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_generate_from_a_saved_prefix_gives_the_same_output_and_prefills_only_the_rest(saved):
    fresh = generate("-p", QUESTION)
    cached = generate("-p", QUESTION, "--prompt-cache", str(saved))
    assert cached["token_ids"] == fresh["token_ids"] and cached["text"] == fresh["text"]
    assert cached["prompt_ids"] == fresh["prompt_ids"]
    assert fresh["cached_tokens"] == 0 and 0 < cached["cached_tokens"] < len(cached["prompt_ids"])
    # The prefix is the rendered prompt up to the end of the text, less its last token.
    assert cached["cached_tokens"] >= len(fresh["prompt_ids"]) - 30


@pytest.mark.parametrize("model", ["gemma3-tiny-Q8_0.gguf", "qwen2-tiny-Q8_0.gguf"])
def test_an_arch_fixture_with_sliding_layers_or_bpe_reuses_it_too(tmp_path, model):
    path, file = tmp_path / "p.safetensors", str(REPO_FIXTURES / model)
    assert run("cache-prompt", "-m", file, "--no-template", "-p", DOC * 3, "-o", str(path)).exit_code == 0
    args = ("-m", file, "--no-template", "-p", DOC * 3 + " And", "-n", "12")
    fresh, cached = generate(*args), generate(*args, "--prompt-cache", str(path))
    assert cached["token_ids"] == fresh["token_ids"] and cached["cached_tokens"] > 300


def test_chat_reuses_a_cached_system_prompt(tmp_path):
    path, system = tmp_path / "system.safetensors", "You answer questions about capitals. " * 10
    assert run("cache-prompt", "--system", system, "-o", str(path)).exit_code == 0
    messages = "What is the capital of Japan?\nWhat is 17 plus 25?\n"
    fresh = run("chat", "--system", system, input=messages)
    cached = run("chat", "--system", system, "--prompt-cache", str(path), input=messages)
    assert cached.exit_code == 0 and cached.stdout == fresh.stdout
    other = run("chat", "--system", "Be brief.", "--prompt-cache", str(path), input=messages)
    assert other.exit_code == 2 and "does not start with the cached prefix" in other.stderr


def test_batch_lines_start_from_it_and_a_line_that_does_not_is_reported(saved):
    lines = [{"id": "q", "prompt": QUESTION}, {"id": "other", "prompt": "What is 17 plus 25?"}]
    result = run("batch", "-", "--prompt-cache", str(saved), input="".join(json.dumps(x) + "\n" for x in lines))
    assert result.exit_code == 2
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in records] == ["q"] and records[0]["text"] == generate("-p", QUESTION)["text"]
    assert "<stdin>:2: " in result.stderr and "does not start with the cached prefix" in result.stderr


def test_a_file_that_does_not_belong_is_a_one_line_error(saved, tmp_path):
    def error(*args) -> str:
        result = run("generate", "-p", QUESTION, "--prompt-cache", *args)
        assert result.exit_code == 2 and result.stdout == "" and result.stderr.count("\n") == 1, result.output
        return result.stderr

    assert "made for another model (chat-tiny-Q4_K_M.gguf)" in error(str(saved), "-m", str(REPO_FIXTURES / "types-tiny-Q8_0.gguf"))
    # a file of the same layout whose tensor data differs: a fine-tune, to the cache
    tuned = tmp_path / "tuned.gguf"
    data = bytearray((PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf").read_bytes())
    data[-4096:-2048] = bytes(2048)
    tuned.write_bytes(bytes(data))
    assert "made for another model" in error(str(saved), "-m", str(tuned))
    assert "made with the template 'gguf (zephyr)', this run has 'none'" in error(str(saved), "--no-template")
    assert "made with --ctx '512', this run has '256'" in error(str(saved), "-c", "256")
    # The CPU's exact K-types; on a GPU the kernels' groups of 32, or MLX's products' wide Q6_K.
    held = ("native, sub-blocks" if mx.default_device() == mx.cpu
            else "native" if mlxllama.runtime.cuda_kernels_wanted() else "native, wide Q6_K")
    assert f"made with native or --dequantize weights '{held}', this run has 'dequantized'" in error(
        str(saved), "--dequantize")
    # Made in MLX's affine form (on a GPU, or on the CPU before its sub-block form): other values.
    arrays, metadata = mx.load(str(saved), return_metadata=True)
    other = "native" if held != "native" else "native, sub-blocks"
    metadata["settings"] = json.dumps({**json.loads(metadata["settings"]), "weights": other})
    affine = tmp_path / "affine.safetensors"
    mx.save_safetensors(str(affine), arrays, metadata)
    assert f"made with native or --dequantize weights '{other}', this run has '{held}'" in error(str(affine))
    assert "the prompt does not start with the cached prefix" in run(
        "generate", "-p", "Hello", "--prompt-cache", str(saved)).stderr
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(saved.read_bytes()[:-1000])
    assert "not a readable prompt cache" in error(str(truncated))
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray(saved.read_bytes())
    data[-500] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    assert "corrupt (its arrays do not match the checksum" in error(str(corrupt))
    not_one = tmp_path / "not.safetensors"
    not_one.write_text("hello")
    assert "not a readable prompt cache" in error(str(not_one))
    assert "no such file" in error(str(tmp_path / "missing.safetensors"))


def test_cache_prompt_needs_its_text_and_writes_nothing_half(tmp_path):
    result = run("cache-prompt", "-o", str(tmp_path / "x.safetensors"))
    assert result.exit_code == 2 and "give the text to cache" in result.stderr
    result = run("cache-prompt", "-p", DOC, "-o", str(tmp_path))
    assert result.exit_code == 2 and "is a directory" in result.stderr
    target = tmp_path / "kept.safetensors"
    target.write_text("old")
    result = run("cache-prompt", "-p", DOC, "-o", str(target), "--template", "nope")
    assert result.exit_code == 2 and target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.safetensors"]
