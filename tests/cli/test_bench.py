"""`mlxllama bench` and the synthetic real-size files it can generate (no timing assertions)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace
from importlib.resources import files

import numpy as np
from click.testing import CliRunner
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT

import mlxllama
from mlx.utils import tree_flatten

from conftest import find_fixture_model
from mlxllama import synthetic
from mlxllama.gguf_file import open_gguf, tensor_shape
from mlxllama.cli import main
from mlxllama.cli_options import default_model_path


def run_bench(*args: str) -> dict:
    result = CliRunner().invoke(main, ["bench", "-p", "16", "-n", "4", "-r", "1", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_bench_json_reports_each_test_and_memory():
    report = run_bench("-b", "1,2")
    assert report["mode"] == "native"
    assert [(t["name"], t["batch"]) for t in report["tests"]] == [("pp16", 1), ("tg4", 1), ("tg4", 2)]
    for test in report["tests"]:
        assert len(test["samples"]) == 1 and test["tokens_per_second"] > 0
        assert test["min"] <= test["tokens_per_second"] <= test["max"]
    assert report["load_seconds"] > 0 and report["params"] > 0
    assert 0 < report["tensor_bytes"] <= report["file_bytes"]
    # The bundled Q4_K_M model, run quantized: Q4_K at 5 bits, Q6_K at 8.5 bits, the embedding as stored.
    assert 1.0 < report["weight_ratio"] < 1.25
    assert report["run_peak_bytes"] >= report["weight_bytes"] * 0.9


def test_bench_reports_what_a_decode_step_costs():
    report = run_bench("-b", "1,2", "-r", "2")
    runtime = mlxllama.load(default_model_path())
    layers = runtime.config.n_layers
    pp, tg1, tg2 = report["tests"]
    assert "launches_per_step" not in pp and pp["launches"] == {}
    for tg in (tg1, tg2):
        # Counted from the step's graph: its products are the model's projections, stacked as
        # fusion.py stacks them (chat-tiny: Q/K/V or Q/K, gate/up, the output and down: 4 or 5 a
        # layer), and the head's.
        assert tg["launches_per_step"] == sum(tg["launches"].values())
        assert 4 * layers + 1 <= tg["launches"]["QuantizedMatmul"] <= 5 * layers + 1
        assert len(tg["host_us"]) == 2 and all(us > 0 for us in tg["host_us"])
    # Every weight but the untied token table's, which a step only looks up.
    held = sum(a.nbytes for name, a in tree_flatten(runtime.model.parameters()) if not name.startswith("token_embd"))
    assert report["step_weight_bytes"] == held


def test_bench_dequantize_holds_float_weights():
    report = run_bench("--dequantize", "-n", "0")
    assert report["mode"] == "dequantize" and [t["name"] for t in report["tests"]] == ["pp16"]
    assert report["dtype"] == "float32" and report["weight_ratio"] > 4  # float32 on the CPU


def test_bench_dtype_bfloat16_holds_half_the_float32_weights():
    half = run_bench("--dequantize", "--dtype", "bfloat16", "-n", "0")
    full = run_bench("--dequantize", "--dtype", "float32", "-n", "0")
    assert (half["dtype"], full["dtype"]) == ("bfloat16", "float32")
    assert abs(half["weight_bytes"] - full["weight_bytes"] / 2) < 0.001 * full["weight_bytes"]


def test_bench_rejects_bad_batch_list():
    result = CliRunner().invoke(main, ["bench", "-b", "1,x"])
    assert result.exit_code == 2 and "--batch" in result.output


def test_tinyllama_layout_is_the_published_q4_k_m():
    layout = synthetic.tensor_types(synthetic.SHAPES["tinyllama-1.1b"])
    assert len(layout) == 2 + 22 * 9 + 1
    assert layout["token_embd.weight"] == ((32000, 2048), QT.Q4_K)
    assert layout["output.weight"] == ((32000, 2048), QT.Q6_K)
    assert layout["blk.0.attn_k.weight"] == ((256, 2048), QT.Q4_K)
    assert layout["blk.3.ffn_down.weight"] == ((2048, 5632), QT.Q4_K)
    q6_layers = sorted(int(n.split(".")[1]) for n, (_, t) in layout.items() if t == QT.Q6_K and "ffn_down" in n)
    assert q6_layers == [0, 1, 4, 7, 10, 13, 16, 19, 20, 21]
    # What llama.cpp logs loading the published file: f32 45, q4_K 135, q6_K 21 tensors.
    assert Counter(t for _, t in layout.values()) == {QT.Q4_K: 135, QT.Q6_K: 21, QT.F32: 45}
    size = sum(np.prod(s) // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for s, t in layout.values())
    assert size == 667_078_656  # ~636 MiB of tensors, like the published 669 MB file


def test_qwen3_layout_is_qwen3_0_6b_in_q4_k_m():
    shape = synthetic.SHAPES["qwen3-0.6b"]
    layout = synthetic.tensor_types(shape)
    assert "output.weight" not in layout and layout["token_embd.weight"] == ((151936, 1024), QT.Q6_K)
    assert layout["blk.0.attn_q.weight"] == ((2048, 1024), QT.Q4_K) and layout["blk.0.attn_k.weight"] == ((1024, 1024), QT.Q4_K)
    assert layout["blk.0.attn_output.weight"] == ((1024, 2048), QT.Q4_K)
    assert layout["blk.5.attn_q_norm.weight"] == ((128,), QT.F32)
    # Qwen3-0.6B: 0.6B parameters, 0.44B of them outside the embedding.
    params = sum(int(np.prod(s)) for s, _ in layout.values())
    assert params == 596_049_920 and params - 151936 * 1024 == 440_467_456


def test_llama3_8b_layout_is_the_published_q4_k_m():
    layout = synthetic.tensor_types(synthetic.SHAPES["llama-3-8b"])
    assert layout["token_embd.weight"] == ((128256, 4096), QT.Q4_K) and layout["output.weight"] == ((128256, 4096), QT.Q6_K)
    assert layout["blk.0.attn_k.weight"] == ((1024, 4096), QT.Q4_K) and layout["blk.0.ffn_gate.weight"] == ((14336, 4096), QT.Q4_K)
    # What llama.cpp logs loading Meta-Llama-3-8B-Instruct Q4_K_M: f32 65, q4_K 193, q6_K 33 tensors.
    assert Counter(t for _, t in layout.values()) == {QT.Q4_K: 193, QT.Q6_K: 33, QT.F32: 65}
    assert sum(int(np.prod(s)) for s, _ in layout.values()) == 8_030_261_248  # Llama 3 8B's parameters
    size = sum(np.prod(s) // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for s, t in layout.values())
    assert size == 4_912_898_048


def test_chat_tiny_layout_is_the_fixtures_and_its_file_loads_for_a_longer_context(tmp_path):
    """"chat-tiny": the chat-tiny fixture's tensors (names, shapes) and configuration, with random
    weights, in a file written for 16k positions, which the fixture's 512 do not allow."""
    fixture = find_fixture_model("chat-tiny-Q4_K_M.gguf")
    layout = synthetic.tensor_types(synthetic.SHAPES["chat-tiny"])
    shapes = {name: tensor_shape(t) for name, t in open_gguf(fixture).tensors.items()}
    assert {name: shape for name, (shape, _) in layout.items()} == shapes
    path = tmp_path / "chat-tiny-16k.gguf"
    synthetic.write(path, "chat-tiny", context=16384)
    runtime = mlxllama.load(path, context_length=16384)
    assert runtime.config == replace(mlxllama.load(fixture).config, context_length=16384)


def test_bench_writes_a_synthetic_file_for_the_deepest_test(tmp_path):
    # chat-tiny's own context is 512: a depth of 600 gets a file written for 600 + tg4's 5 positions.
    assert synthetic.context_for("chat-tiny", 512) is None and synthetic.context_for("chat-tiny", 605) == 605
    assert synthetic.context_for("no-such-model", 10**6) is None  # write names the unknown model
    path = tmp_path / "deep.gguf"
    report = run_bench("--synthetic", "chat-tiny", "-m", str(path), "-p", "0", "-d", "0,600")
    assert [(t["name"], t["depth"]) for t in report["tests"]] == [("tg4", 0), ("tg4 @ d600", 600)]
    assert mlxllama.load(path).config.context_length == 605


def test_synthetic_file_loads_and_generates(tmp_path, monkeypatch):
    """A scaled-down shape through the same writer: the file is valid GGUF and runs in both modes."""
    small = synthetic.Shape(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=32000, context=256,
                            rope_base=10000.0, rms_eps=1e-5)
    monkeypatch.setitem(synthetic.SHAPES, "small", small)
    path = tmp_path / "small.gguf"
    synthetic.write(path, "small", "Q4_K_M")
    native, dense = mlxllama.load(path), mlxllama.load(path, dequantize=True)
    ids = [1, 450, 7483, 310]
    ours, ref = native.logits(ids), dense.logits(ids)
    assert np.isfinite(ours).all() and np.abs(ours - ref).max() < 0.05 * np.abs(ref).max()
    assert len(native.generate(ids, max_tokens=3).token_ids) == 3


def test_synthetic_qwen3_file_has_its_architecture_and_padded_vocabulary(tmp_path, monkeypatch):
    small = synthetic.Shape(n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=512, vocab=32256, context=256,
                            rope_base=1e6, rms_eps=1e-6, architecture="qwen3", head_dim=128, qk_norm=True,
                            tied_output=True)
    monkeypatch.setitem(synthetic.SHAPES, "small-qwen3", small)
    path = tmp_path / "small.gguf"
    synthetic.write(path, "small-qwen3", "Q4_K_M")
    m = mlxllama.load(path)
    c = m.config
    assert (c.head_dim, c.n_heads, c.n_kv_heads, c.vocab_size, c.tied_output) == (128, 4, 2, 32256, True)
    assert "attn_q_norm" in m.model.blk[0]
    # The Llama-2 pieces as they were; the padding never comes out of text.
    llama2 = mlxllama.load_tokenizer(files("mlxllama.data") / "chat-tiny-Q4_K_M.gguf")
    assert m.tokenize("Hello <unused32000>") == llama2.encode("Hello <unused32000>")
    assert m.tokenizer.decode([32000]) == ""  # an unused piece renders as nothing, as in llama.cpp
    logits = m.logits([1, 450, 7483])
    assert logits.shape == (3, 32256) and np.isfinite(logits).all()


def test_bench_with_a_constraint_times_the_loop_with_and_without_it():
    report = run_bench("-p", "0", "-n", "8", "--json-schema", "benchmarks/long-array.schema.json")
    assert [(t["name"], t["batch"]) for t in report["tests"]] == [("tg8", 1), ("tg8 loop", 1), ("tg8 constrained", 1)]
    assert all(t["tokens_per_second"] > 0 for t in report["tests"])
    result = CliRunner().invoke(main, ["bench", "-n", "4", "--regex", "("])
    assert result.exit_code == 2 and "regex: " in result.stderr
