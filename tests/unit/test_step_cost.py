"""What a decode step costs (mlxllama.step_cost), and the shape of the plain step that keeps its
launches few: one RoPE kernel for a layer's queries and keys, norms that read the residual stream
as the residual add already cast it."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlxllama
from conftest import find_fixture_model
from mlxllama.models.transformer import residual_add
from mlxllama.runtime import CUDA_KERNELS_ENV
from mlxllama.step_cost import launches, weight_bytes_per_step


@pytest.fixture
def plain_step(monkeypatch):
    """Models loaded with the plain MLX step, the one a Mac runs: on CUDA the kernels would take it."""
    monkeypatch.setenv(CUDA_KERNELS_ENV, "0")


def test_launches_count_the_primitives_that_run_and_leave_views_out():
    a = mx.arange(6, dtype=mx.float32)
    mx.eval(a)
    out = (a.reshape(2, 3) * 2).T[None] + 1
    assert launches([out]) == Counter({"Multiply": 1, "Add": 1})
    mx.eval(out)
    assert launches([out]) == Counter()  # evaluated: nothing left to run


def test_the_residual_add_and_its_cast_are_one_launch():
    x, y = mx.ones((1, 1, 8)), mx.full((1, 1, 8), 0.5, mx.float16)
    mx.eval(x, y)
    h, h_compute = residual_add(x, y)
    assert sum(launches([h, h_compute]).values()) == 1
    assert (h.dtype, h_compute.dtype) == (mx.float32, mx.float16)
    assert h.tolist() == [[[1.5] * 8]] and h_compute.tolist() == [[[1.5] * 8]]


@pytest.mark.parametrize("name", ["qwen3moe-tiny-Q8_0", "mixtral-tiny-Q4_K_M"])
def test_weight_bytes_count_the_experts_a_token_uses_and_an_untied_table_not_at_all(name):
    runtime = mlxllama.load(find_fixture_model(f"{name}.gguf"))
    c = runtime.config
    assert c.n_experts_used < c.n_experts
    params = dict(tree_flatten(runtime.model.parameters()))
    experts = sum(a.nbytes for name, a in params.items() if "_exps." in name)
    table = sum(a.nbytes for name, a in params.items() if name.startswith("token_embd."))
    rest = sum(a.nbytes for name, a in params.items() if "_exps." not in name) - (0 if c.tied_output else table)
    assert experts > 0 and table > 0
    assert weight_bytes_per_step(runtime.model) == pytest.approx(rest + experts * c.n_experts_used / c.n_experts, abs=64)


def step_calls(monkeypatch, runtime, function: str) -> list[mx.array]:
    """The first argument of every call of mx.fast.<function> during one decode step."""
    cache = runtime.model.make_cache()
    mx.eval(runtime.model(mx.array([[1, 5, 9]]), cache))
    seen, real = [], getattr(mx.fast, function)

    def recorded(x, *args, **kwargs):
        seen.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(mx.fast, function, recorded)
    mx.eval(runtime.model.step(mx.array([[7]]), cache))
    return seen


@pytest.mark.parametrize("name, ropes_a_layer", [("chat-tiny-Q4_K_M", 1), ("mistral-tiny-Q4_K_M", 1),
                                                  ("qwen3-tiny-Q4_K_M", 2)])
def test_one_rope_kernel_turns_a_layers_queries_and_keys_unless_each_has_its_own_norm(monkeypatch, plain_step, name,
                                                                                       ropes_a_layer):
    runtime = mlxllama.load(find_fixture_model(f"{name}.gguf"))
    c = runtime.config
    ropes = step_calls(monkeypatch, runtime, "rope")
    assert len(ropes) == ropes_a_layer * c.n_layers
    if ropes_a_layer == 1:  # the queries' heads, then the keys'
        assert all(x.shape[1] == c.n_heads + c.n_kv_heads for x in ropes)


def test_a_block_norm_reads_the_stream_as_the_residual_add_cast_it(monkeypatch, plain_step):
    runtime = mlxllama.load(find_fixture_model("chat-tiny-Q4_K_M.gguf"), dtype=mx.float16)
    norms = step_calls(monkeypatch, runtime, "rms_norm")
    # The first block's attention norm reads the embedding, the output norm the float32 stream
    # (the same values the CUDA kernels and trace read); every other norm reads the float16 copy.
    assert len(norms) == 2 * runtime.config.n_layers + 1
    assert [x.dtype for x in norms] == [mx.float32] + [mx.float16] * (2 * runtime.config.n_layers - 1) + [mx.float32]
    weights = [m.weight.dtype for _, m in runtime.model.named_modules() if isinstance(m, mlxllama.models.transformer.RMSNorm)]
    assert set(weights) == {mx.float16}
