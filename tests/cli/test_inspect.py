"""`mlxllama inspect`: exact values on fixtures, JSON and text output, errors."""

import json

import gguf
import numpy as np
from click.testing import CliRunner

from mlxllama.cli import main
from mlxllama.model_info import describe, format_text

from conftest import find_fixture_model


def llama3_parameters(vocab=3011, hidden=256, kv=128, ffn=512, layers=2, rope_pairs=32) -> int:
    per_layer = 2 * hidden + 2 * hidden * hidden + 2 * kv * hidden + 3 * ffn * hidden  # norms, q+o, k+v, ffn
    return vocab * hidden + layers * per_layer + hidden + rope_pairs  # tied: no output.weight


def test_llama3_fixture():
    info = describe(find_fixture_model("llama3-tiny-Q6_K.gguf"))
    assert (info["architecture"], info["supported"], info["layers"], info["context_length"]) == ("llama", True, 2, 131072)
    assert info["parameters"] == llama3_parameters() == 1_951_776
    assert info["tensor_types"] == {"F32": 6, "Q6_K": 15}  # 5 norms + rope_freqs; every matrix Q6_K
    assert info["tensors"] == 21
    assert info["tensor_bytes"] < info["file_bytes"]
    tok = info["tokenizer"]
    assert (tok["model"], tok["kind"], tok["pre"], tok["tokens"]) == ("gpt2", "byte-level BPE", "llama-bpe", 3011)
    assert tok["bos"] == {"id": 3000, "text": "<|begin_of_text|>"} and tok["add_bos"]
    assert tok["eos"] == tok["eot"] == {"id": 3009, "text": "<|eot_id|>"}
    assert info["chat_template"]["builtin"] == "llama3"


def test_phi3_and_qwen2_fixtures():
    phi3 = describe(find_fixture_model("phi3-tiny-Q5_K_M.gguf"))
    assert phi3["architecture"] == "phi3" and phi3["tokenizer"]["kind"] == "SentencePiece"
    assert phi3["chat_template"]["builtin"] == "phi3"
    assert phi3["tokenizer"]["eot"] == {"id": 3007, "text": "<|end|>"}
    qwen2 = describe(find_fixture_model("qwen2-tiny-Q8_0.gguf"))
    assert qwen2["architecture"] == "qwen2" and qwen2["tokenizer"]["pre"] == "qwen2"
    assert qwen2["chat_template"]["builtin"] == "chatml"
    assert qwen2["tensor_types"] == {"F32": 11, "Q8_0": 15}  # norms and Q/K/V biases stay F32


def test_qwen3_and_gemma3_fixtures_show_heads_norms_and_windows():
    qwen3 = describe(find_fixture_model("qwen3-tiny-Q4_K_M.gguf"))
    assert qwen3["attention"] == {"heads": 4, "kv_heads": 2, "head_dim": 128, "qk_norm": True, "sliding_window": None,
                                  "sliding_layers": 0, "global_layers": None, "experts": None, "experts_used": None,
                                  "expert_ffn": None}
    gemma3 = describe(find_fixture_model("gemma3-tiny-Q8_0.gguf"))
    assert gemma3["attention"] == {"heads": 4, "kv_heads": 1, "head_dim": 64, "qk_norm": True, "sliding_window": 32,
                                   "sliding_layers": 5, "global_layers": [5], "experts": None, "experts_used": None,
                                   "expert_ffn": None}
    assert gemma3["tokenizer"]["eot"] == {"id": 3001, "text": "<end_of_turn>"} and gemma3["tokenizer"]["stop_ids"] == [2, 3001]
    text = format_text(gemma3)
    assert "attention      4 heads (1 KV) of 64, Q/K norms\n" in text
    assert "sliding window 32 on 5 of 6 layers (global: 5)\n" in text


def test_mixture_fixtures_show_their_experts():
    qwen3moe = describe(find_fixture_model("qwen3moe-tiny-Q8_0.gguf"))
    assert (qwen3moe["architecture"], qwen3moe["attention"]["experts"], qwen3moe["attention"]["experts_used"],
            qwen3moe["attention"]["expert_ffn"]) == ("qwen3moe", 4, 2, 256)
    mixtral = describe(find_fixture_model("mixtral-tiny-Q4_K_M.gguf"))
    assert "experts        2 of 4 a token, FFNs of 512\n" in format_text(mixtral)


def test_cli_text_and_json():
    path = str(find_fixture_model("llama3-tiny-Q6_K.gguf"))
    runner = CliRunner()
    text = runner.invoke(main, ["inspect", path])
    assert text.exit_code == 0, text.output
    assert "llama (supported)" in text.output and "1.95M (1,951,776)" in text.output
    assert "pre-tokenizer llama-bpe" in text.output and "matches built-in 'llama3'" in text.output
    as_json = runner.invoke(main, ["inspect", path, "--json"])
    assert json.loads(as_json.output)["parameters"] == 1_951_776


def test_rope_scaling_of_phi3_longrope_fixture():
    path = str(find_fixture_model("phi3-longrope-tiny-Q8_0.gguf"))
    info = describe(path)
    assert (info["context_length"], info["rope_scaling"]) == (4096, {"type": None, "original_context_length": 256})
    text = CliRunner().invoke(main, ["inspect", path])
    assert text.exit_code == 0, text.output
    assert "context length 4096\nrope scaling   original context length 256\nlayers         2\n" in text.output
    as_json = CliRunner().invoke(main, ["inspect", path, "--json"])
    assert json.loads(as_json.output)["rope_scaling"] == {"type": None, "original_context_length": 256}
    # A file with neither key shows no rope scaling line.
    llama3 = str(find_fixture_model("llama3-tiny-Q6_K.gguf"))
    assert describe(llama3)["rope_scaling"] is None
    assert "rope scaling" not in CliRunner().invoke(main, ["inspect", llama3]).output


def test_rope_scaling_type(tmp_path):
    path = tmp_path / "linear.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(8192)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_orig_ctx_len(2048)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    info = describe(path)
    assert info["rope_scaling"] == {"type": "linear", "original_context_length": 2048}
    assert "\nrope scaling   type linear, original context length 2048\n" in format_text(info)
    info["rope_scaling"]["original_context_length"] = None
    assert "\nrope scaling   type linear\n" in format_text(info)


def test_cli_errors(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 2 and "not a GGUF file" in result.output
