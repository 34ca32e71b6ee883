"""Malformed GGUF files: each must end in one MlxLlamaError naming the file and the problem.

The files are the real Q4_0 fixture with bytes changed at offsets found by parsing its header
here, independently of the loader.
"""

from __future__ import annotations

import contextlib
import math
import resource
import signal
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mlxllama
from mlxllama.errors import MlxLlamaError
from mlxllama.gguf_file import open_gguf
from mlxllama.models import architecture_of, config as model_config, read_config
from mlxllama.weights import load_model

FIXTURE = "types-tiny-Q4_0.gguf"
UINT32, FLOAT32, STRING, ARRAY = 4, 6, 8, 9
SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
CASE_SECONDS = 2.0


# --- An independent reading of the header: where each field sits -------------------------------

@dataclass
class KV:
    key: str
    start: int  # the key's length field
    end: int
    vtype: int
    value_at: int  # the value, or an array's item type


@dataclass
class TensorInfo:
    name: str
    start: int
    end: int
    n_dims_at: int
    dims: list[int]
    type_at: int
    qtype: int
    offset_at: int
    offset: int

    @property
    def n_bytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(self.qtype)]
        return math.prod(self.dims) // block * type_size


@dataclass
class Header:
    kvs: dict[str, KV]
    tensors: list[TensorInfo]
    end: int  # the end of the last tensor info
    data_start: int
    # (offset, width in bytes) of every count, length, type and offset field: where absurd values go.
    slots: list[tuple[int, int]] = field(default_factory=list)


def parse(data: bytes) -> Header:
    slots = [(8, 8), (16, 8)]
    pos = 24

    def u32() -> int:
        nonlocal pos
        slots.append((pos, 4))
        pos += 4
        return struct.unpack_from("<I", data, pos - 4)[0]

    def u64() -> int:
        nonlocal pos
        slots.append((pos, 8))
        pos += 8
        return struct.unpack_from("<Q", data, pos - 8)[0]

    def string() -> str:
        nonlocal pos
        n = u64()
        pos += n
        return data[pos - n : pos].decode()

    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    kvs = {}
    for _ in range(n_kv):
        start = pos
        key = string()
        vtype = u32()
        value_at = pos
        if vtype == ARRAY:
            item_type, count = u32(), u64()
            for _ in range(count):
                if item_type == STRING:
                    string()
                else:
                    pos += SCALAR_SIZES[item_type]
        elif vtype == STRING:
            string()
        else:
            pos += SCALAR_SIZES[vtype]
        kvs[key] = KV(key, start, pos, vtype, value_at)
    tensors = []
    for _ in range(n_tensors):
        start = pos
        name = string()
        n_dims_at = pos
        dims = [u64() for _ in range(u32())]
        type_at = pos
        qtype = u32()
        offset_at = pos
        offset = u64()
        tensors.append(TensorInfo(name, start, pos, n_dims_at, dims, type_at, qtype, offset_at, offset))
    return Header(kvs, tensors, pos, -(-pos // 32) * 32, slots)


def build(kvs: list[bytes], infos: list[bytes], data: bytes) -> bytes:
    """A GGUF v3 file from raw key/value entries, tensor infos and the tensor data region."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(infos), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + bytes(-len(header) % 32) + data


def gguf_string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_entry(key: str, vtype: int, payload: bytes) -> bytes:
    return gguf_string(key.encode()) + struct.pack("<I", vtype) + payload


def rebuild(data: bytes, replace: dict[str, bytes | None]) -> bytes:
    """`data` with some key/value entries replaced by raw entries (None: dropped)."""
    h = parse(data)
    kvs = [replace.get(k, data[kv.start : kv.end]) for k, kv in h.kvs.items()]
    infos = [data[t.start : t.end] for t in h.tensors]
    return build([kv for kv in kvs if kv is not None], infos, data[h.data_start :])


def compact(data: bytes, items: int = 8) -> bytes:
    """The fixture made small enough to load ~2000 times quickly: tokenizer arrays cut to
    `items` entries (GGUFReader spends most of its time there) and all tensors sharing one
    data block (they keep their headers, so the loader checks them all the same)."""
    h = parse(data)
    kvs = []
    for kv in h.kvs.values():
        entry = data[kv.start : kv.end]
        if kv.vtype == ARRAY:
            item_type, count = struct.unpack_from("<IQ", data, kv.value_at)
            pos = kv.value_at + 12
            for _ in range(min(count, items)):
                pos += 8 + struct.unpack_from("<Q", data, pos)[0] if item_type == STRING else SCALAR_SIZES[item_type]
            entry = data[kv.start : kv.value_at] + struct.pack("<IQ", item_type, min(count, items))
            entry += data[kv.value_at + 12 : pos]
        kvs.append(entry)
    infos = [data[t.start : t.offset_at] + struct.pack("<Q", 0) for t in h.tensors]
    block = max(t.n_bytes for t in h.tensors)
    return build(kvs, infos, data[h.data_start : h.data_start + block])


@pytest.fixture
def fixture_bytes(fixture_model) -> bytes:
    return fixture_model(FIXTURE).read_bytes()


def write(tmp_path: Path, data: bytes, name: str = "model.gguf") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def load_weights(gguf, config):
    """The weights loaded as dequantized mode loads them (every tensor decoded)."""
    return load_model(gguf, architecture_of(gguf), config, mx.float32, native=False)


def load_error(path: str, weights: bool = False) -> str:
    with pytest.raises(MlxLlamaError) as info:
        gguf = open_gguf(path)
        config = read_config(gguf)
        if weights:
            load_weights(gguf, config)
    return str(info.value)


# --- Targeted cases, exact messages ---------------------------------------------------------------

def test_fixture_and_compact_copy_load(tmp_path, fixture_bytes):
    for data in (fixture_bytes, compact(fixture_bytes)):
        gguf = open_gguf(write(tmp_path, data))
        config = read_config(gguf)
        assert config.n_layers == 2 and config.vocab_size == 512
        assert len(architecture_of(gguf).tensors(config)) == 21 == len(gguf.tensors)
        model = load_weights(gguf, config)
        assert model.blk[1].attn_qkv.weight.shape == (256 + 2 * 128, 256)


@pytest.mark.parametrize("dequantize", [False, True])
def test_a_load_checks_the_tensor_shapes_once(fixture_model, monkeypatch, dequantize):
    """read_config checks every tensor's shape; the weight loaders, native or dense, and MLX do not check again."""
    checks, strict_loads = [], []
    check_shapes, mlx_load = model_config.check_shapes, nn.Module.load_weights

    def check(*args):
        checks.append(args)
        check_shapes(*args)

    def load(self, weights, strict=True):  # MLX's strict load compares every shape again
        strict_loads.append(strict)
        return mlx_load(self, weights, strict)

    monkeypatch.setattr(model_config, "check_shapes", check)
    monkeypatch.setattr(nn.Module, "load_weights", load)
    mlxllama.load(fixture_model(FIXTURE), dequantize=dequantize)
    assert len(checks) == 1 and not any(strict_loads)


def test_nonexistent_path(tmp_path):
    path = str(tmp_path / "missing.gguf")
    assert load_error(path) == f"{path}: no such file"


def test_empty_file(tmp_path):
    path = write(tmp_path, b"")
    assert load_error(path) == f"{path}: not a GGUF file (the file is empty)"


def test_not_a_gguf_file(tmp_path, fixture_bytes):
    path = write(tmp_path, b"PK\x03\x04" + fixture_bytes[4:])
    assert load_error(path) == f"{path}: not a GGUF file (offset 0: expected magic b'GGUF', found b'PK\\x03\\x04')"


def test_unsupported_version(tmp_path, fixture_bytes):
    path = write(tmp_path, fixture_bytes[:4] + struct.pack("<I", 7) + fixture_bytes[8:])
    assert load_error(path) == f"{path}: unsupported GGUF version 7 (supported: 2, 3) (offset 4)"


def test_truncated_in_header(tmp_path, fixture_bytes):
    kv = parse(fixture_bytes).kvs["tokenizer.chat_template"]
    length = kv.end - kv.value_at - 8
    path = write(tmp_path, fixture_bytes[: kv.value_at + 8 + 100])  # 100 bytes into the template
    assert load_error(path) == (
        f"{path}: truncated or corrupt GGUF header: value of 'tokenizer.chat_template' would need {length} bytes"
        f" but only 100 remain (offset {kv.value_at + 8})"
    )
    path = write(tmp_path, fixture_bytes[:30])  # a file this short cannot hold its 21 tensors
    assert load_error(path) == (
        f"{path}: tensor count 21 is impossible in a file of 30 bytes (truncated or corrupt) (offset 8)"
    )


def test_truncated_in_tensor_data(tmp_path, fixture_bytes):
    h = parse(fixture_bytes)
    last = max(h.tensors, key=lambda t: t.offset)
    end = h.data_start + last.offset + last.n_bytes
    assert end == len(fixture_bytes)
    path = write(tmp_path, fixture_bytes[:-100])
    assert load_error(path) == (
        f"{path}: tensor '{last.name}' data ends at offset {end}, past the end of the file"
        f" ({end - 100} bytes); the file is truncated"
    )


def test_absurd_kv_count(tmp_path, fixture_bytes):
    path = write(tmp_path, fixture_bytes[:16] + struct.pack("<Q", 2**63) + fixture_bytes[24:])
    size = len(fixture_bytes)
    assert load_error(path) == (
        f"{path}: metadata key count {2**63} is impossible in a file of {size} bytes (truncated or corrupt)"
        " (offset 16)"
    )


def test_absurd_string_length(tmp_path, fixture_bytes):
    at = parse(fixture_bytes).kvs["general.name"].value_at
    path = write(tmp_path, fixture_bytes[:at] + struct.pack("<Q", 2**64 - 1) + fixture_bytes[at + 8 :])
    assert load_error(path) == (
        f"{path}: truncated or corrupt GGUF header: value of 'general.name' would need {2**64 - 1} bytes"
        f" but only {len(fixture_bytes) - at - 8} remain (offset {at + 8})"
    )


def test_unknown_tensor_type(tmp_path, fixture_bytes):
    t = parse(fixture_bytes).tensors[1]
    data = bytearray(fixture_bytes)
    struct.pack_into("<I", data, t.type_at, 99)
    path = write(tmp_path, bytes(data))
    assert load_error(path) == f"{path}: tensor '{t.name}' has unknown GGML type id 99 (offset {t.type_at})"


def test_tensor_dimensions_that_overflow(tmp_path, fixture_bytes):
    t = parse(fixture_bytes).tensors[0]  # 2 dimensions; 2**32 * 2**32 wraps to 0 in uint64
    data = bytearray(fixture_bytes)
    struct.pack_into("<QQ", data, t.n_dims_at + 4, 2**32, 2**32)
    path = write(tmp_path, bytes(data))
    assert f"{path}: tensor '{t.name}' data ends at offset " in load_error(path)


def test_unsupported_architecture(tmp_path, fixture_bytes):
    at = parse(fixture_bytes).kvs["general.architecture"].value_at
    assert fixture_bytes[at + 8 : at + 13] == b"llama"
    path = write(tmp_path, fixture_bytes[: at + 8] + b"gpt99" + fixture_bytes[at + 13 :])
    assert load_error(path) == f"{path}: unsupported architecture 'gpt99' (supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma3)"


def test_missing_metadata_key(tmp_path, fixture_bytes):
    path = write(tmp_path, rebuild(fixture_bytes, {"llama.block_count": None}))
    assert load_error(path) == f"{path}: missing metadata key 'llama.block_count'"


def test_metadata_value_of_the_wrong_type(tmp_path, fixture_bytes):
    key = "llama.block_count"
    path = write(tmp_path, rebuild(fixture_bytes, {key: kv_entry(key, STRING, gguf_string(b"2"))}))
    assert load_error(path) == f"{path}: metadata key '{key}' should be an integer, found the string '2'"
    path = write(tmp_path, rebuild(fixture_bytes, {key: kv_entry(key, FLOAT32, struct.pack("<f", 2.0))}))
    assert load_error(path) == f"{path}: metadata key '{key}' should be an integer, found float 2.0"
    key = "llama.attention.layer_norm_rms_epsilon"
    path = write(tmp_path, rebuild(fixture_bytes, {key: kv_entry(key, ARRAY, struct.pack("<IQ", UINT32, 0))}))
    assert load_error(path) == f"{path}: metadata key '{key}' should be a number, found an array of 0 items"


def test_metadata_sizes_that_disagree_with_the_tensors(tmp_path, fixture_bytes):
    # The model is built from the config before the weights are loaded, so a config that asks
    # for a huge layer must be refused by read_config rather than allocated.
    key = "llama.embedding_length"
    path = write(tmp_path, rebuild(fixture_bytes, {key: kv_entry(key, UINT32, struct.pack("<I", 2**31))}))
    assert load_error(path).startswith(f"{path}: tensor ")
    key = "llama.block_count"
    path = write(tmp_path, rebuild(fixture_bytes, {key: kv_entry(key, UINT32, struct.pack("<I", 2**32 - 1))}))
    assert load_error(path) == f"{path}: llama.block_count {2**32 - 1} is more than the file's 21 tensors can hold"


# --- Random damage -----------------------------------------------------------------------------

@contextlib.contextmanager
def time_limit(seconds: float):
    """Interrupt a hang inside the loader (with a traceback showing where) instead of waiting on it."""

    class Hang(BaseException):  # not an Exception, so that the loader's catch-all cannot swallow it
        pass

    def interrupt(signum, frame):
        raise Hang(f"case ran over {seconds} s")

    if not hasattr(signal, "setitimer"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


ABSURD = [0, 1, 2, 3, 4, 5, 9, 13, 24, 31, 32, 255, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 32,
          2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1]


# A change to a file's bytes, as a function of them.

def put(offset: int, width: int, value: int):
    value &= (1 << 8 * width) - 1
    return overwrite(offset, value.to_bytes(width, "little"))


def xor(offset: int, mask: int):
    return lambda b: b[:offset] + bytes([b[offset] ^ mask]) + b[offset + 1 :] if offset < len(b) else b


def overwrite(offset: int, chunk: bytes):
    return lambda b: b[:offset] + chunk + b[offset + len(chunk) :]


def mutations(base: bytes, h: Header):
    """Strategies for one change to `base`."""
    size = len(base)
    offsets = st.integers(0, h.end - 1)
    numbers = st.one_of(st.sampled_from(ABSURD + [size - 1, size, size + 1]), st.integers(0, 2**64 - 1))
    slot = st.sampled_from(h.slots)
    tensor = st.sampled_from(h.tensors)
    dims = st.sampled_from([32, 64, 256, 2**31, 2**32, 2**33, 2**63, 2**64 - 32])
    aligned_offsets = st.one_of(
        st.sampled_from([size, size - 32, 2**40, 2**64 - 32]), st.integers(0, 2**20).map(lambda n: 32 * n)
    )
    return st.one_of(
        st.integers(0, size).map(lambda n: lambda b: b[:n]),  # truncation anywhere
        st.builds(xor, offsets, st.integers(1, 255)),  # a flipped byte in the header
        st.builds(overwrite, offsets, st.binary(min_size=1, max_size=16)),  # random bytes in the header
        slot.flatmap(lambda s: numbers.map(lambda v: put(s[0], s[1], v))),  # a count, length, type or offset
        # Tensor infos: n_dims, every dimension (products that overflow), offsets past the end.
        st.builds(lambda t, v: put(t.n_dims_at, 4, v), tensor, st.sampled_from([0, 1, 3, 4, 5, 2**32 - 1])),
        tensor.flatmap(lambda t: st.lists(dims, min_size=len(t.dims), max_size=len(t.dims)).map(
            lambda v: overwrite(t.n_dims_at + 4, b"".join(x.to_bytes(8, "little") for x in v)))),
        st.builds(lambda t, v: put(t.offset_at, 8, v), tensor, aligned_offsets),
        st.builds(lambda t, v: put(t.type_at, 4, v), tensor, st.integers(0, 64) | st.sampled_from([2**31, 2**32 - 1])),
    )


def tensor_retypes(base: bytes, h: Header):
    """A tensor given another known type, or moved to another aligned offset: files that pass
    the header checks, so that load_weights has to decode them."""
    types = st.sampled_from([int(t) for t in GGMLQuantizationType])
    offsets = st.integers(0, len(base) // 32).map(lambda n: 32 * n)
    tensor = st.sampled_from(h.tensors)
    return st.one_of(
        st.builds(lambda t, v: put(t.type_at, 4, v), tensor, types),
        st.builds(lambda t, v: put(t.offset_at, 8, v), tensor, offsets),
    )


def run_cases(tmp_path: Path, base: bytes, changes, examples: int, weights: bool) -> Counter:
    path = write(tmp_path, base, "mutated.gguf")
    outcomes: Counter = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(changes, min_size=1, max_size=3))
    def case(changes):
        data = base
        for change in changes:
            data = change(data)
        Path(path).write_bytes(data)
        start = time.perf_counter()
        try:
            with time_limit(CASE_SECONDS):
                gguf = open_gguf(path)
                config = read_config(gguf)
                if weights:
                    load_weights(gguf, config)
            outcomes["loaded"] += 1
        except MlxLlamaError as e:
            message = str(e)
            assert message.startswith(f"{path}: ") and "\n" not in message, message
            outcomes["error"] += 1
        assert time.perf_counter() - start < CASE_SECONDS

    case()
    return outcomes


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def test_damaged_headers_fail_cleanly(tmp_path, fixture_bytes):
    rss_before = peak_rss_mib()
    base = compact(fixture_bytes)
    outcomes = run_cases(tmp_path, base, mutations(base, parse(base)), 2000, weights=False)
    # Both outcomes must be common, or the mutations are not exercising the loader.
    assert outcomes["loaded"] > 50 and outcomes["error"] > 1000, outcomes
    # No case may have allocated anywhere near a mutated count or length.
    assert peak_rss_mib() - rss_before < 256


def test_damaged_files_fail_cleanly_through_load_weights(tmp_path, fixture_bytes):
    base = compact(fixture_bytes)
    outcomes = run_cases(tmp_path, base, tensor_retypes(base, parse(base)), 200, weights=True)
    assert outcomes["loaded"] > 20 and outcomes["error"] > 20, outcomes


@pytest.mark.parametrize("name", ["vocab/ggml-vocab-llama-spm.gguf", "vocab/ggml-vocab-phi-3.gguf",
                                  "types-tiny-Q4_K.gguf", "qwen2-tiny-Q8_0.gguf"])
def test_quick_array_reader_reads_what_the_stock_reader_reads(name):
    """gguf_file's reader overrides a private method of gguf's GGUFReader (pyproject pins the
    versions it was tested with): every field must come out as the stock reader gives it."""
    from gguf import GGUFReader

    from mlxllama.gguf_file import _field_value

    from conftest import REPO_FIXTURES

    path = REPO_FIXTURES / name
    ours, stock = open_gguf(path), GGUFReader(path)
    assert list(ours.metadata) == list(stock.fields)
    arrays = 0
    for key, stock_field in stock.fields.items():
        want, got = _field_value(stock_field), ours.metadata[key]
        if isinstance(want, np.ndarray):
            arrays += 1
            assert got.dtype == want.dtype and np.array_equal(got, want), key
        else:
            arrays += isinstance(want, list)
            assert got == want, key
    assert arrays >= 2  # string and numeric arrays: the path the override replaces
    assert [t.name for t in ours.tensors.values()] == [t.name for t in stock.tensors]
