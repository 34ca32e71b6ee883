"""The architecture registry, the one weight loader and the lazily imported CUDA backend."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlxllama
from mlxllama import tensors as tensor_conversion
from mlxllama.errors import MlxLlamaError
from mlxllama.gguf_file import open_gguf, tensor_shape
from mlxllama.models import ARCHITECTURES, architecture_of, gemma3, llama, phi3, qwen2, qwen3, qwen3moe
from mlxllama.quantized_layers import NativeLinear

from conftest import PACKAGE_DATA, find_fixture_model

FAMILY_FIXTURES = {"llama": "llama3-tiny-Q6_K.gguf", "qwen2": "qwen2-tiny-Q8_0.gguf", "phi3": "phi3-tiny-Q5_K_M.gguf",
                   "qwen3": "qwen3-tiny-Q4_K_M.gguf", "gemma3": "gemma3-tiny-Q8_0.gguf",
                   "qwen3moe": "qwen3moe-tiny-Q8_0.gguf"}
ROPE_FACTORS = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}


def test_registry_maps_each_gguf_architecture_to_its_family_file():
    assert {name: type(arch) for name, arch in ARCHITECTURES.items()} == {
        "llama": llama.Llama, "qwen2": qwen2.Qwen2, "qwen3": qwen3.Qwen3, "qwen3moe": qwen3moe.Qwen3Moe,
        "phi3": phi3.Phi3, "gemma3": gemma3.Gemma3}
    # The RoPE convention comes from the family: llama.cpp permutes Q/K of `llama` only.
    assert [ARCHITECTURES[n].rope_traditional for n in ("llama", "qwen2", "qwen3", "phi3", "gemma3")] == [
        True, False, False, False, False]


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_each_family_reads_every_tensor_of_its_file(family):
    gguf = open_gguf(find_fixture_model(FAMILY_FIXTURES[family]))
    arch = architecture_of(gguf)
    table = arch.tensors(arch.read_config(gguf))
    assert arch.name == family
    assert set(table) == set(gguf.tensors) - ROPE_FACTORS
    assert all(shape == tensor_shape(gguf.tensors[name]) for name, (_, shape) in table.items())


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import gguf as gguf_writer

    path = tmp_path / "gemma.gguf"
    writer = gguf_writer.GGUFWriter(str(path), "gemma9")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(MlxLlamaError, match=r"unsupported architecture 'gemma9' \(supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma3\)$"):
        mlxllama.load(path)


@pytest.mark.parametrize("dequantize", [False, True])
def test_a_file_fused_tensor_loads_once_into_the_fused_layer(dequantize, monkeypatch):
    """Phi-3's attn_qkv and [gate; up] ffn_up load as they are, one conversion each, in both modes."""
    path = find_fixture_model("phi3-tiny-Q5_K_M.gguf")
    converted = []
    convert = tensor_conversion.convert

    def counting(path, tensor, *args, **kwargs):
        converted.append(tensor.name)
        return convert(path, tensor, *args, **kwargs)

    monkeypatch.setattr("mlxllama.weights.convert", counting)
    runtime = mlxllama.load(path, dequantize=dequantize)
    gguf = open_gguf(path)
    assert sorted(converted) == sorted(set(gguf.tensors) - ROPE_FACTORS)
    block = runtime.model.blk[0]
    assert "attn_qkv" in block and "ffn_gate_up" in block
    assert not {"attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"} & set(block)
    assert isinstance(block.attn_qkv, NativeLinear) != dequantize
    if dequantize:
        want = tensor_conversion.tensor_to_mlx(path, gguf.tensors["blk.0.attn_qkv.weight"], runtime.model.compute_dtype)
        np.testing.assert_array_equal(np.array(block.attn_qkv.weight), np.array(want))


def test_separate_projections_are_fused_after_loading():
    runtime = mlxllama.load(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf", dequantize=True)
    assert all("attn_qkv" in block and "ffn_gate_up" in block for block in runtime.model.blk)


def test_importing_and_running_on_the_cpu_never_touches_the_cuda_backend():
    """A Metal or CPU user pays nothing for the CUDA backend: no .cu file read, no driver loaded."""
    script = f"""
import sys
opened, loaded = [], []
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event == "open" else
                 loaded.append(str(args[0])) if event == "ctypes.dlopen" else None)
import mlxllama
runtime = mlxllama.load({str(PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf")!r})
assert runtime.generate("The capital of Italy is", 3).text == " Rome."
print([m for m in sys.modules if m.startswith("mlxllama.cuda")], [p for p in opened if p.endswith(".cu")],
      [p for p in loaded if "cuda" in p])
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] [] []"


@pytest.mark.parametrize("name", ["chat-tiny-Q4_K_M.gguf", "qwen2-tiny-Q8_0.gguf", "phi3-tiny-Q5_K_M.gguf"])
def test_explicit_prefill_attention_gives_the_fused_kernels_logits(name):
    """What CUDA prefills with (matrix products and a softmax) against MLX's fused attention, on a
    fresh prompt and on a prompt after cached tokens."""
    import mlx.core as mx

    runtime = mlxllama.load(find_fixture_model(name), dtype=mx.float32)  # the same bar on any device
    model, ids = runtime.model, runtime.tokenize("The capital of Italy is Rome. The capital of Japan is Tokyo.")

    def runs():
        cache = model.make_cache()
        first = model(mx.array([ids[:9]]), cache)
        later = model(mx.array([ids[9:]]), cache)
        return [np.array(x) for x in (first, later)]

    fused = runs()
    model.attend_prefill("explicit")
    explicit = runs()
    for a, b in zip(fused, explicit):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-4)


def test_cudas_prefill_attends_a_shape_explicitly_when_first_met_and_fused_when_met_again(monkeypatch):
    """EXPLICIT_FIRST, what runtime.load chooses on CUDA: explicit products for a shape of (rows, new
    tokens, cached tokens) the layers have not met (the latest SHAPES_REMEMBERED) or of fewer than
    FUSED_WHEN_MET_AGAIN_MIN_LENGTH new tokens, the fused kernel for one met before, and for one
    past EXPLICIT_PREFILL_MAX_SCORES; the same logits either way."""
    import mlx.core as mx

    from mlxllama.models import transformer

    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dtype=mx.float32)
    model, ids = runtime.model, runtime.tokenize("The capital of Italy is Rome. The capital of Japan is Tokyo.")
    model.attend_prefill(transformer.EXPLICIT_FIRST)
    explicit, calls = transformer.explicit_attention, []
    monkeypatch.setattr(transformer, "explicit_attention", lambda *args: (calls.append(1), explicit(*args))[1])

    def explicit_layers(*pieces: int) -> tuple[int, np.ndarray]:
        """How many layers attended explicitly, feeding ids in pieces of these lengths to a fresh cache."""
        calls.clear()
        cache, start = model.make_cache(), 0
        for n in pieces:
            logits = model(mx.array([ids[start : start + n]]), cache)
            start += n
        return len(calls), np.array(logits)

    layers = len(model.blk)
    assert [explicit_layers(9)[0], explicit_layers(9)[0]] == [layers, layers]  # fewer new tokens than 512
    monkeypatch.setattr(transformer, "FUSED_WHEN_MET_AGAIN_MIN_LENGTH", 5)  # short prompts (a context of 512 ids)
    first, logits = explicit_layers(10)
    assert first == layers
    again, logits_again = explicit_layers(10)
    assert again == 0  # met before: fused
    np.testing.assert_allclose(logits_again, logits, rtol=0, atol=2e-4)
    assert explicit_layers(10, 6)[0] == layers  # (1, 10, 10) met, then (1, 6, 16) new
    assert explicit_layers(10, 4)[0] == layers  # (1, 4, 14): fewer new tokens than 5
    assert explicit_layers(7)[0] == layers
    monkeypatch.setattr(transformer, "SHAPES_REMEMBERED", 2)
    # 6 met again (so 8 is the least recently met), then 9 new: 8 is forgotten
    assert [explicit_layers(n)[0] for n in (6, 8, 6, 9, 8)] == [layers, layers, 0, layers, layers]
    monkeypatch.setattr(transformer, "EXPLICIT_PREFILL_MAX_SCORES", model.config.n_heads * 5 * 5)  # 5 new x 5 keys
    assert explicit_layers(5)[0] == layers and explicit_layers(6)[0] == 0
    with pytest.raises(ValueError, match="'explicit-first'"):
        model.attend_prefill("sometimes")
    # For a block only (benchmarks, tests): the model's choice back after it, however it ends.
    with pytest.raises(RuntimeError), model.attending_prefill(transformer.FUSED):
        assert model.prefill_attention == transformer.FUSED
        raise RuntimeError
    assert model.prefill_attention == transformer.EXPLICIT_FIRST


def test_explicit_attention_is_five_operations_in_the_compute_type():
    """CUDA's prefill attention, float16 queries over cached keys: the causal mask a view of one
    table (no operation of its own), scores and weights in float16 with a float32 softmax, which is
    how MLX attends without its fused kernel, so on the CPU the two agree to the bit."""
    import mlx.core as mx

    from mlxllama.models.transformer import explicit_attention, grouped_mask
    from mlxllama.step_cost import launches

    q = mx.random.normal((1, 8, 5, 64), key=mx.random.key(0)).astype(mx.float16)
    k, v = (mx.random.normal((1, 2, 12, 64), key=mx.random.key(i)).astype(mx.float16) for i in (1, 2))
    mx.eval(q, k, v)
    out = explicit_attention(q, k, v, 0.125, "causal")
    assert launches([out]) == {"Matmul": 2, "Multiply": 1, "Select": 1, "Softmax": 1}
    assert out.dtype == mx.float16
    with mx.stream(mx.cpu):  # both on the CPU (on CUDA the fused kernel is cuDNN's, not the same sums)
        fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
        assert mx.array_equal(explicit_attention(q, k, v, 0.125, "causal"), fused).item()
    # 5 new positions after 7 cached: position 7 + i sees keys 0 .. 7 + i
    np.testing.assert_array_equal(np.array(grouped_mask("causal", 2, 4, 5, 12)), np.tri(12, dtype=bool)[7:])


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_a_blocks_children_are_all_layers(family):
    """The CUDA kernels take a model whose blocks hold norms and projections only: a container
    attribute (a dict of RoPE settings, say) is taken for a child and turned them off once."""
    import mlx.nn as nn

    block = mlxllama.load(find_fixture_model(FAMILY_FIXTURES[family])).model.blk[0]
    assert block.children() and all(isinstance(child, nn.Module) for child in block.children().values())


def test_the_cuda_kernels_take_only_the_blocks_they_compute():
    """Decided at load: Qwen3's and Gemma 3's blocks go to the plain MLX step (on CUDA as elsewhere)."""
    from mlxllama.cuda import implemented

    taken = {name: implemented(mlxllama.load(find_fixture_model(f"{name}.gguf")).config)
             for name in ("llama3-tiny-Q6_K", "qwen2-tiny-Q8_0", "phi3-tiny-Q5_K_M", "qwen3-tiny-Q4_K_M", "gemma3-tiny-Q8_0",
                          "mixtral-tiny-Q4_K_M")}
    assert taken == {"llama3-tiny-Q6_K": True, "qwen2-tiny-Q8_0": True, "phi3-tiny-Q5_K_M": True,
                     "qwen3-tiny-Q4_K_M": False, "gemma3-tiny-Q8_0": False, "mixtral-tiny-Q4_K_M": False}


@pytest.mark.parametrize("name", ["qwen3moe-tiny-Q8_0.gguf", "mixtral-tiny-Q4_K_M.gguf"])
def test_a_mixture_keeps_its_experts_quantized_and_batches(name):
    """Natively the experts stay quantized as stacked tensors (never one float copy of them all);
    rows of a batch each take their own experts, and greedy ids equal each prompt run alone."""
    from mlxllama.quantized_layers import NativeExperts

    rt = mlxllama.load(find_fixture_model(name))
    block = rt.model.blk[0]
    assert all(isinstance(block[p], NativeExperts) for p in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    assert block.ffn_gate_exps.weight.shape[0] == rt.config.n_experts and block.ffn_gate_exps.weight.dtype == mx.uint32
    prompts = ["The capital of Italy is", "Once upon a time", "1, 2, 3"]
    batched = mlxllama.batch_generate(rt, prompts, max_tokens=12, batch_size=3)
    assert [r.token_ids for r in batched] == [rt.generate(p, 12).token_ids for p in prompts]
