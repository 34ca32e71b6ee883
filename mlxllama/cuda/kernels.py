"""The contract between Python and the kernel files, in one place.

The kernels' constants are read from the .cu files themselves, so the two sides cannot disagree.
Each kernel's parameters are listed here by name in the order of its C++ signature: MLX passes a
kernel's inputs under their names, and an entry that is not an input is a value MLX provides
(an input's shape) or the output. The shared-memory sizes mirror how the kernels carve theirs.
"""

from __future__ import annotations

import hashlib
import os
import re
from functools import cache
from pathlib import Path

import mlx.core as mx

from ..cache import KVQuantization
from ..models import ModelConfig


def _read(name: str) -> str:
    return Path(__file__).with_name(name).read_text()


def _stripped(text: str) -> str:
    """A kernel file without comments and blank lines: MLX hashes the source at every launch. It
    ends with a line break, or its last line (decode_step.cu's #define) would run on into the code
    MLX writes after it."""
    return "".join(line + "\n" for line in text.splitlines() if line.strip() and not line.lstrip().startswith("//"))


def _constant(text: str, name: str) -> int:
    match = re.search(rf"\bconstexpr int (?:\w+ = \w+, )*{name} = (\d+)\b", text)
    if match is None:
        raise RuntimeError(f"no `constexpr int {name}` in the kernel source")
    return int(match.group(1))


_STEP_SOURCE, _BATCH_SOURCE, _Q6_K_SOURCE = _read("decode_step.cu"), _read("decode_batch.cu"), _read("q6_k.cu")
HEADER = _stripped(_STEP_SOURCE)
BATCH_HEADER = HEADER + _stripped(_BATCH_SOURCE)
Q6_K_HEADER = HEADER + _stripped(_Q6_K_SOURCE)

GROUP = _constant(_STEP_SOURCE, "GROUP")  # values that share a scale and bias
GROUP_STRIDE = _constant(_STEP_SOURCE, "GROUP_STRIDE")  # shared-memory floats a staged group takes
HEAD_THREADS = _constant(_STEP_SOURCE, "THREADS")  # a block of head_kernel
LAYER_THREADS = _constant(_STEP_SOURCE, "LAYER_THREADS")  # a block of layer_kernel and batch_layer_kernel
SEQ_TILE = _constant(_BATCH_SOURCE, "SEQ_TILE")  # sequences of one tensor-core product
MAX_QUERY_HEADS = _constant(_STEP_SOURCE, "MAX_QUERY_HEADS")  # query heads an attention warp takes at most
MAX_QUERY_HEADS_QUANTIZED = _constant(_STEP_SOURCE, "MAX_QUERY_HEADS_QUANTIZED")  # off tensor cores, quantized
# Heads layer_kernel attends on tensor cores (decode_step.cu's tensor_attention_run).
TENSOR_RUNS_MAX_HEAD_DIM = _constant(_STEP_SOURCE, "TENSOR_RUNS_MAX_HEAD_DIM")
# Sequences batch_layer_kernel takes at once: two tiles of 8 (its shared memory holds all their inputs).
MAX_BATCH = 2 * SEQ_TILE
FFN_ROWS = 4  # rows of the gate or up projection a warp takes at once in layer_kernel (1, 2 and 8: no faster)
# Runs a head group's attention is cut into at most in batch_layer_kernel: shorter runs, but more of
# them to combine (128 measured faster than 64 at depth 8,192: docs/benchmarks.md, "Attention at
# depth"). layer_kernel's teams a group are fewer (a block a group at most: max_runs).
RUNS_LIMIT = 128

# Values MLX passes with the inputs: the cache's capacity in slots, and the number of sequences.
CAPACITY, ROWS = "keys_shape[2]", "x_shape[0]"
# A cache's arrays: keys and values (a quantized cache's packed words), and a quantized cache's scales and biases.
CACHE = ("keys", "values", "key_scales", "key_biases", "value_scales", "value_biases")
_ATTENTION = ("attn_norm", "eps", "w_q", "s_q", "b_q", "w_k", "s_k", "b_k", "w_v", "s_v", "b_v", "bias_q",
              "bias_k", "bias_v", "position", "inv_freq", "attn_factor", *CACHE, CAPACITY)
_FEED_FORWARD = ("w_o", "s_o", "b_o", "ffn_norm", "w_gate", "s_gate", "b_gate", "w_up", "s_up", "b_up", "w_down",
                 "s_down", "b_down", "sync", "scratch", "y")
LAYER_PARAMETERS = ("x", *_ATTENTION, *_FEED_FORWARD)  # decode_step.cu's layer_kernel
BATCH_LAYER_PARAMETERS = ("x", ROWS, "cache_rows", *_ATTENTION, *_FEED_FORWARD)  # decode_batch.cu's batch_layer_kernel
HEAD_PARAMETERS = ("x", "norm_w", "eps", "w", "scales", "biases", "ROWS", "y")  # decode_step.cu's head_kernel
# Template parameters both layer kernels take, in their order (batch_layer_kernel has NT first, and
# layer_kernel FFN_ROWS before MAX_RUNS; both end with MAX_RUNS and STAGED_KEYS). KEY_BITS,
# VALUE_BITS and KV_GROUP describe a quantized cache (decode_step.cu's LayerCache), all 0 for a plain one.
LAYER_TEMPLATE = ("Q_BITS", "Q_BIASES", "K_BITS", "K_BIASES", "V_BITS", "V_BIASES", "BIAS", "HEADS", "KV_HEADS",
                  "HEAD_DIM", "ROPE_DIM", "TRADITIONAL", "HIDDEN", "O_BITS", "O_BIASES", "GATE_BITS", "GATE_BIASES",
                  "UP_BITS", "UP_BIASES", "DOWN_BITS", "DOWN_BIASES", "FFN", "KEY_BITS", "VALUE_BITS", "KV_GROUP")
HEAD_TEMPLATE = ("BITS", "STORED_BIASES", "K", "R")
Q6_K_PRODUCT_PARAMETERS = ("x", "w", "ROWS", "y")  # q6_k.cu's q6_k_product_kernel
Q6_K_HEAD_PARAMETERS = ("x", "norm_w", "eps", "w", "ROWS", "y")  # q6_k.cu's q6_k_head_kernel
Q6_K_MAX_INPUTS = _constant(_Q6_K_SOURCE, "Q6_K_MAX_INPUTS")  # input rows q6_k_product_kernel takes at once


def inputs_of(parameters: tuple[str, ...], outputs: tuple[str, ...] = ("y",)) -> tuple[str, ...]:
    """The parameters that are kernel inputs: not values MLX provides, outputs or template
    constants (upper case, as ROWS of head_kernel)."""
    return tuple(p for p in parameters if p not in (CAPACITY, ROWS, *outputs) and not p.isupper())


@cache
def kernel(function: str, parameters: tuple[str, ...], template: tuple[str, ...], shared_floats: int,
           header: str = "step", outputs: tuple[str, ...] = ("y",)):
    """The MLX kernel whose body calls `function` with `parameters`, its template arguments named
    `template`, after the header of its file: "step" (decode_step.cu), "batch" (decode_batch.cu) or
    "q6_k" (q6_k.cu)."""
    text = {"step": HEADER, "batch": BATCH_HEADER, "q6_k": Q6_K_HEADER}[header]
    call = f"{function}<{', '.join(template)}>({', '.join(parameters)});"
    return mx.fast.cuda_kernel(name=function.removesuffix("_kernel"), input_names=list(inputs_of(parameters, outputs)),
                               output_names=list(outputs), source=call,
                               header=included(text), shared_memory=4 * shared_floats)


def included(header: str) -> str:
    """`header` as one #include line of a file named by a hash of its text (written once, in the
    user's cache), or as it is where no such file can be written.

    Why: MLX hashes a kernel's whole source at every launch. Behind the 36,579-character header a
    launch cost 24 µs of host time against 10 µs without one (H100, benchmarks/op_cost.py), and
    a one-sequence step, which the host bounds, launches 23. The file's name changes with its text,
    so MLX's compiled kernels, which it keys by the source it sees, never outlive the text.
    """
    directory = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mlxllama" / "cuda"
    path = directory / f"kernels-{hashlib.sha256(header.encode()).hexdigest()[:32]}.cuh"
    if '"' in str(path) or "\\" in str(path):
        return header
    try:
        if not path.is_file() or path.read_text() != header:
            directory.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(header)
            os.replace(partial, path)  # whole or not at all, for other processes compiling from it
    except OSError:
        return header
    return f'#include "{path}"\n'


def staged_floats(k: int) -> int:
    """decode_step.cu's shared memory for an input of k values: staged values, group sums, scratch."""
    return k // GROUP * GROUP_STRIDE + k // GROUP + GROUP + 1


# kv_group, below: the group size of the cache that layer_kernel attends over, 0 for a plain cache
# (and for batch_layer_kernel, whose attention is the same over every cache).

def tensor_runs(c: ModelConfig, kv_group: int = 0) -> bool:
    """decode_step.cu's tensor_runs_take: whether layer_kernel attends on tensor cores, which read
    keys straight into registers (no keys staged in shared memory), over a plain cache or one
    quantized in groups of 32."""
    return c.head_dim % 32 == 0 and c.head_dim <= TENSOR_RUNS_MAX_HEAD_DIM and kv_group in (0, 32)


def query_heads(c: ModelConfig, kv_group: int = 0) -> int:
    """decode_step.cu's query_heads: the query heads of one KV head that an attention warp takes at
    once; fewer (MAX_QUERY_HEADS_QUANTIZED) in layer_kernel over a quantized cache that
    attention_run reads (FEWER_HEADS), not one on tensor cores."""
    fewer = kv_group > 0 and not tensor_runs(c, kv_group)
    per_kv_head, n = c.n_heads // c.n_kv_heads, 1
    while n < (MAX_QUERY_HEADS_QUANTIZED if fewer else MAX_QUERY_HEADS) and per_kv_head % (2 * n) == 0:
        n *= 2
    return n


def head_groups(c: ModelConfig, kv_group: int = 0) -> int:
    """decode_step.cu's head_groups: the groups of query_heads heads that a layer's attention is cut into."""
    return c.n_heads // query_heads(c, kv_group)


def staged_key_floats(head_dim: int) -> int:
    """decode_step.cu's staged keys of one warp (staged_key_units): a chunk's 32 keys, a row of
    head_dim float16 values and 16 bytes of padding each."""
    return 32 * (head_dim // 2 + 4)


def _group_query_floats(c: ModelConfig) -> int:
    """A head group's scaled queries and their sums over each group of a quantized cache (32 values
    at least), as many as the larger groups of a plain cache need."""
    return query_heads(c) * (c.head_dim + c.head_dim // 32)


def attention_floats(c: ModelConfig, staged_keys: bool) -> int:
    """batch_layer_kernel's attention (decode_step.cu's attention_items): every warp's head group's
    queries (_group_query_floats), then, with `staged_keys`, every warp's staged keys."""
    return LAYER_THREADS // 32 * (_group_query_floats(c) + (staged_key_floats(c.head_dim) if staged_keys else 0))


def takes_quantized_cache(c: ModelConfig, quantization: KVQuantization) -> bool:
    """Whether the kernels read and write a cache quantized so (decode_step.cu's QuantizedSlots and
    LayerCache): a lane's HEAD_DIM / 32 dims of a key and of a value in whole bytes. The group sizes
    KVQuantization allows (32 to 128, dividing the head) and head sizes the kernels take (multiples
    of 32) need nothing more. Keys stored by channel they do not read: the plain step does."""
    return (not quantization.keys_by_channel
            and c.head_dim // 32 * min(quantization.bits, quantization.bits_of_keys) % 8 == 0)


def team_attention_floats(c: ModelConfig, staged_keys: bool) -> int:
    """decode_step.cu's team_attention: one head group's queries (_group_query_floats) rounded up to 16
    bytes; every warp's run results [query heads][head_dim + 2]; then, with `staged_keys`, every
    warp's staged keys."""
    queries = -(-_group_query_floats(c) // 4) * 4
    results = query_heads(c) * (c.head_dim + 2)
    return queries + LAYER_THREADS // 32 * (results + (staged_key_floats(c.head_dim) if staged_keys else 0))


def layer_shared_floats(c: ModelConfig, staged_keys: bool) -> int:
    """layer_kernel's shared memory: the largest staged input, or the attention's (team_attention_floats)."""
    return max(staged_floats(c.hidden_size), staged_floats(c.ffn_size), staged_floats(c.n_heads * c.head_dim),
               team_attention_floats(c, staged_keys))


def batch_stride(k: int) -> int:
    """decode_batch.cu's batch_stride."""
    return k + (32 if k % 64 == 0 else 0)


def batch_shared_floats(c: ModelConfig, tiles: int, staged_keys: bool) -> int:
    """batch_layer_kernel's shared memory for `tiles` * 8 sequences: two matrices' fragments of
    every warp, then the largest staged input (float16 values, float32 group sums) or the
    attention's queries (and keys)."""
    seqs = tiles * SEQ_TILE
    staged = max(seqs * batch_stride(k) // 2 + seqs * k // GROUP
                 for k in (c.hidden_size, c.n_heads * c.head_dim, c.ffn_size))
    return 2 * LAYER_THREADS * tiles * 4 + max(staged, attention_floats(c, staged_keys))


def max_runs(blocks: int, c: ModelConfig, seqs: int = 1, kv_group: int = 0) -> int:
    """MAX_RUNS of both layer kernels: few enough (up to RUNS_LIMIT) that every (sequence, head
    group, run) item of `seqs` sequences has a warp of its own, as batch_layer_kernel's
    attention_items needs where a group has several runs. layer_kernel's team_attention takes it
    as the rows of partial results a head (a team's each), which its teams, at most a block a group
    of them, never exceed. Over a quantized cache that attention_run reads (kv_group) a layer's
    head groups are smaller (query_heads), and more."""
    per_group = blocks * (LAYER_THREADS // 32) // (seqs * head_groups(c, kv_group))
    return min(RUNS_LIMIT, max(1, per_group))


def layer_scratch_floats(c: ModelConfig, runs: int) -> int:
    """layer_kernel's scratch input for a plain cache's `runs` (max_runs): q, partials, attn, h, gate,
    up, and a quantized cache's fresh key and value."""
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return 2 * q_dim + c.n_heads * runs * (c.head_dim + 2) + c.hidden_size + 2 * c.ffn_size + 2 * kv_dim


def batch_scratch_floats(c: ModelConfig, tiles: int, runs: int) -> int:
    """batch_layer_kernel's scratch input: q, partials, attn, h, act (float16, two a float), and a
    quantized cache's fresh keys and values."""
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    return tiles * SEQ_TILE * (2 * q_dim + c.n_heads * runs * (c.head_dim + 2) + c.hidden_size + c.ffn_size // 2
                               + 2 * kv_dim)
