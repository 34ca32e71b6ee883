"""What each rank of a split model holds (sharding.py) and how its pieces are read (tensors.cut):
a piece read from the file alone equals the same slice of the whole tensor's conversion, for
every form a weight takes, and the plan picks a pipeline, saying why, where heads do not divide."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from conftest import REPO_FIXTURES, PACKAGE_DATA
from mlxllama.errors import MlxLlamaError
from mlxllama.gguf_file import open_gguf
from mlxllama.models import architecture_of
from mlxllama.quants import AffineWeight
from mlxllama.sharding import plan_shard, tensor_split_problem
from mlxllama.tensors import Piece, convert

CHAT_TINY = PACKAGE_DATA / "chat-tiny-Q4_K_M.gguf"


def dense(weight) -> np.ndarray:
    if isinstance(weight, AffineWeight):
        weight = mx.dequantize(weight.weight, weight.scales, weight.full_biases(), group_size=weight.group_size,
                               bits=weight.bits)
    return np.array(weight.astype(mx.float32))


def whole_and_piece(path, name: str, piece: Piece, native: bool = True, wide: bool = False):
    gguf = open_gguf(path)
    architecture = architecture_of(gguf)
    config = architecture.read_config(gguf)
    _, shape = architecture.tensors(config)[name]
    tensor = gguf.tensors[name]
    return (dense(convert(gguf.path, tensor, shape, mx.float32, native, wide=wide)),
            dense(convert(gguf.path, tensor, shape, mx.float32, native, piece=piece, wide=wide)))


# Wide: Q6_K's wide form (groups of 64) whole, its values in groups of 32 in a piece (quants.narrowed).
@pytest.mark.parametrize("native, wide", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("name, piece, rows, columns", [
    # Q4_K rows of 256 values, one block: the halves of attn_output and ffn_down start inside a block.
    ("blk.0.attn_q.weight", Piece(rows=((128, 256),)), slice(128, 256), slice(None)),
    ("blk.0.attn_output.weight", Piece(columns=(128, 256)), slice(None), slice(128, 256)),
    ("blk.0.ffn_down.weight", Piece(columns=(0, 384)), slice(None), slice(0, 384)),
    ("blk.0.ffn_down.weight", Piece(columns=(384, 768)), slice(None), slice(384, 768)),
    ("blk.2.ffn_down.weight", Piece(columns=(416, 768)), slice(None), slice(416, 768)),  # Q6_K
    ("blk.5.attn_v.weight", Piece(rows=((0, 32),)), slice(0, 32), slice(None)),
    ("blk.0.attn_norm.weight", Piece(rows=((64, 192),)), slice(64, 192), None),
])
def test_a_piece_is_the_slice_of_the_whole(name, piece, rows, columns, native, wide):
    whole, part = whole_and_piece(CHAT_TINY, name, piece, native, wide)
    expected = whole[rows] if columns is None else whole[rows, columns]
    assert part.shape == expected.shape
    np.testing.assert_array_equal(part, expected)


def test_a_wide_q6_k_piece_holds_the_wide_values_in_groups_of_32():
    gguf = open_gguf(CHAT_TINY)
    tensor = gguf.tensors["blk.2.ffn_down.weight"]
    assert tensor.tensor_type == QT.Q6_K
    shape = architecture_of(gguf).tensors(architecture_of(gguf).read_config(gguf))["blk.2.ffn_down.weight"][1]
    whole = convert(gguf.path, tensor, shape, mx.float32, True, wide=True)
    piece = convert(gguf.path, tensor, shape, mx.float32, True, piece=Piece(columns=(32, 768)), wide=True)
    assert (whole.group_size, piece.group_size) == (64, 32) and piece.biases is None  # 8.5 bits, as whole
    np.testing.assert_array_equal(dense(piece), dense(whole)[:, 32:768])


def test_joined_row_ranges_of_a_fused_tensor():
    # Phi-3 stores gate and up as one ffn_up tensor: a rank takes its share of each.
    path = REPO_FIXTURES / "phi3-tiny-Q5_K_M.gguf"
    whole, part = whole_and_piece(path, "blk.0.ffn_up.weight", Piece(rows=((256, 512), (768, 1024))))
    np.testing.assert_array_equal(part, np.concatenate([whole[256:512], whole[768:1024]]))


def test_an_experts_piece_cuts_every_expert():
    path = REPO_FIXTURES / "mixtral-tiny-Q4_K_M.gguf"
    whole, part = whole_and_piece(path, "blk.0.ffn_down_exps.weight", Piece(columns=(256, 512)))
    assert part.shape == (4, 256, 256)
    np.testing.assert_array_equal(part, whole[..., 256:512])
    whole, part = whole_and_piece(path, "blk.1.ffn_gate_exps.weight", Piece(rows=((0, 256),)))
    np.testing.assert_array_equal(part, whole[:, 0:256])


def config_of(path):
    gguf = open_gguf(path)
    return architecture_of(gguf).read_config(gguf)


def test_tensor_split_gives_each_rank_whole_heads_and_an_equal_share():
    config = config_of(CHAT_TINY)  # 8 heads of 32, 2 KV heads, FFN 768
    shards = [plan_shard(config, rank, 2) for rank in range(2)]
    assert [s.mode for s in shards] == ["tensor", "tensor"]
    assert shards[1].piece("blk.3.attn_q.weight", config) == Piece(rows=((128, 256),))
    assert shards[1].piece("blk.3.attn_k.weight", config) == Piece(rows=((32, 64),))
    assert shards[0].piece("blk.3.attn_output.weight", config) == Piece(columns=(0, 128))
    assert shards[1].piece("blk.3.ffn_down.weight", config) == Piece(columns=(384, 768))
    assert shards[0].piece("token_embd.weight", config) is None
    assert shards[0].piece("blk.3.attn_norm.weight", config) is None
    local = shards[0].block_config(config)
    assert (local.n_heads, local.n_kv_heads, local.ffn_size, local.head_dim) == (4, 1, 384, 32)


def test_a_fused_qkv_tensor_gives_each_rank_its_q_k_and_v_rows():
    config = config_of(REPO_FIXTURES / "phi3-tiny-Q5_K_M.gguf")  # 4 heads of 64, 2 KV heads
    assert config.fused_qkv
    piece = plan_shard(config, 1, 2).piece("blk.0.attn_qkv.weight", config)
    assert piece == Piece(rows=((128, 256), (256 + 64, 256 + 128), (384 + 64, 384 + 128)))


def test_heads_that_do_not_divide_give_a_pipeline_and_say_why():
    config = config_of(REPO_FIXTURES / "gemma3-tiny-Q8_0.gguf")  # 4 heads, 1 KV head, 6 layers
    shards = [plan_shard(config, rank, 4) for rank in range(4)]
    assert [s.mode for s in shards] == ["pipeline"] * 4
    assert shards[0].reason == "its 1 KV heads do not divide among 4 ranks"
    assert [tuple(s.layers) for s in shards] == [(0, 1), (2, 3), (4,), (5,)]
    assert not shards[2].holds("blk.1.attn_q.weight") and shards[2].holds("blk.4.attn_q.weight")
    assert shards[2].holds("output_norm.weight")


def test_widths_are_cut_along_whole_groups_in_native_mode_only():
    config = config_of(CHAT_TINY)
    assert tensor_split_problem(config, 2, native=True) == ""
    # 768 / 8 = 96 values a rank: three groups of 32; 768 / 16 = 48 is not whole groups.
    assert "FFN width" in tensor_split_problem(config.__class__(**{**config.__dict__, "n_heads": 16, "n_kv_heads": 16}),
                                               16, native=True)
    assert tensor_split_problem(config.__class__(**{**config.__dict__, "n_heads": 16, "n_kv_heads": 16}),
                                16, native=False) == ""


def test_a_pipeline_needs_a_layer_a_rank():
    with pytest.raises(MlxLlamaError, match="at least as many layers"):
        plan_shard(config_of(REPO_FIXTURES / "qwen2-tiny-Q8_0.gguf"), 0, 3, pipeline=True)


@pytest.mark.parametrize("cuda, hand_over", [(False, "send"), (True, "sum")])
def test_pipeline_stages_hand_over_by_all_sums_on_cuda(monkeypatch, cuda, hand_over):
    # MLX 0.32 has no send or receive on CUDA (NCCL's stream): "Send has no CUDA implementation".
    from mlxllama import runtime
    from mlxllama.distributed import World

    monkeypatch.setattr(runtime, "world", lambda: World(None, 1, 2))
    monkeypatch.setattr(runtime, "on_cuda", lambda: cuda)
    shard = runtime.plan_parallel("pipeline", config_of(CHAT_TINY), native=True)
    assert (shard.mode, shard.rank, shard.layers, shard.hand_over) == ("pipeline", 1, range(3, 6), hand_over)
