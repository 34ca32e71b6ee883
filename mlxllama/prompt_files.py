"""Prompt caches on disk: the keys and values of a prefix (a long document, a system prompt)
saved with everything they depend on, so a later run prefills only what follows it.

A file is safetensors: the prefix's token ids, each layer's keys and values for those positions
(keys by channel: with the full-precision keys of the block the prefix ends in, which the cache
keeps to store that block again whole, `layers.{i}.keys.open`), and in its metadata the model
file's identity and the settings that change the keys and values (the template, the context
length, how the weights are held (native, with or without the CPU's sub-block form, or
dequantized), the compute dtype, how the cache is quantized: a quantized cache is saved as it is
stored, as its three arrays). Loading
checks all of them against the run and refuses, in one line, a file that does not match: a cache
made for another model or with other settings would give wrong output, not an error.

Loaded, the prefix becomes an entry of a PromptCache, the store the server and `chat` use, so
generate, chat and batch reuse it the way they reuse any earlier prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .cache import CHANNEL_BLOCK, Buffer, block_start, kv_arrays, kv_label, kv_map, kv_nbytes, whole_blocks
from .errors import MlxLlamaError, count
from .files import replace_atomically
from .generate import prefill
from .gguf_file import open_gguf
from .prompt import Template, build_prompt, tokenize_rendered
from .prompt_cache import PromptCache, common_prefix
from .tokenizer import Tokenizer

FORMAT = "mlxllama-prompt-cache/1"
# A model's identity: every part's size, its first HEAD_BYTES (the header: metadata and tensor
# table) and SAMPLES chunks of the rest at even intervals; a fine-tune of the same layout differs in all.
HEAD_BYTES, SAMPLES, SAMPLE_BYTES = 16 << 20, 64, 1 << 16


def model_identity(path: str) -> str:
    digest = hashlib.sha256()
    for part in open_gguf(path).parts or [path]:
        size = os.path.getsize(part)
        with open(part, "rb") as f:
            digest.update(f"{os.path.basename(part)}:{size}".encode())
            digest.update(f.read(HEAD_BYTES))
            span = max(size - HEAD_BYTES - SAMPLE_BYTES, 0)
            if size > HEAD_BYTES:
                for i in range(SAMPLES):
                    f.seek(HEAD_BYTES + span * i // (SAMPLES - 1))
                    digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def checksum(arrays: dict[str, mx.array]) -> str:
    """Of every array's name, shape, dtype and bytes: what a corrupted file would not match."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"{name}:{a.shape}:{a.dtype}".encode())
        digest.update(memoryview(np.array(a.view(mx.uint8) if a.dtype != mx.bool_ else a)))
    return digest.hexdigest()


def settings_of(runtime, template: Template) -> dict[str, str]:
    """What changes a prefix's keys and values besides its ids and the weights."""
    text = template.text or ""
    return {
        "template": template.label,
        "template_sha256": hashlib.sha256(text.encode()).hexdigest() if template.text is not None else "none",
        "context_length": str(runtime.config.context_length),  # Phi-3's RoPE factors depend on it
        "weights": runtime.weight_form,
        "dtype": runtime.model.compute_dtype_name,
        "kv_cache": kv_label(runtime.model.kv_quantization),
    }


SETTING_NAMES = {"template": "the template", "template_sha256": "the template's text",
                 "context_length": "--ctx", "weights": "native or --dequantize weights", "dtype": "the compute dtype",
                 "kv_cache": "the KV cache"}
# The names of a quantized buffer's arrays in a file, after "layers.{i}.keys." (mx.quantize's order).
QUANTIZED_PARTS = ("packed", "scales", "biases")


def save(path: str, runtime, template: Template, ids: list[int], text: str) -> int:
    """Prefill `ids` and write their keys and values to `path` (atomically); the file's size."""
    if not ids:
        raise MlxLlamaError("the prefix to cache is empty")
    cache = runtime.model.make_cache(bounded=False)  # every position of every layer, sliding ones too
    prefill(runtime.model, ids, cache)
    arrays = {"ids": mx.array(ids, mx.int32)}
    for i, layer in enumerate(cache):
        # keys by channel: the whole blocks that hold the prefix
        key_slots = whole_blocks(len(ids)) if layer.keys_by_channel else len(ids)
        for name, buffer, slots in (("keys", layer.keys, key_slots), ("values", layer.values, len(ids))):
            parts = kv_arrays(kv_map(lambda a: mx.contiguous(a[..., :slots, :]), buffer))
            names = [f"layers.{i}.{name}"] if len(parts) == 1 else [f"layers.{i}.{name}.{p}" for p in QUANTIZED_PARTS]
            arrays.update(zip(names, parts))
        if layer.keys_by_channel and len(ids) % CHANNEL_BLOCK:
            held, opened = layer.copies
            arrays[f"layers.{i}.keys.open"] = mx.contiguous(held[:, :, block_start(len(ids)) - opened :])
    mx.eval(list(arrays.values()))
    metadata = {"format": FORMAT, "model": os.path.basename(runtime.path), "model_identity": model_identity(runtime.path),
                "settings": json.dumps(settings_of(runtime, template)), "checksum": checksum(arrays), "text": text}
    replace_atomically(path, lambda temp: mx.save_safetensors(temp, arrays, metadata), suffix=".safetensors")
    return os.path.getsize(path)


@dataclass
class SavedPrefix:
    path: str
    ids: list[int]
    layers: list[tuple[Buffer, Buffer]]
    copies: list[tuple] | None = None  # keys by channel: each layer's KVCache.copies, where the file has them

    def check_starts(self, ids: list[int]) -> None:
        """A prompt that does not start with the saved prefix is an error: reusing it would be wrong."""
        part = common_prefix(ids, self.ids, len(self.ids))
        if part < len(self.ids):
            raise MlxLlamaError(f"{self.path}: the prompt does not start with the cached prefix of "
                                f"{count(len(self.ids), 'token')} (they part at token {part})")

    def store(self, into: PromptCache | None = None) -> PromptCache:
        """A prompt cache holding the prefix (`into`, or one just large enough), for generate, chat
        and batch to take it from."""
        store = into or PromptCache(sum(kv_nbytes(k) + kv_nbytes(v) for k, v in self.layers))
        store.store(self.ids, self.layers, copy=False, copies=self.copies or ())
        return store


def prefix_ids(tokenizer: Tokenizer, template: Template, messages: list[dict], kwargs: dict, anchor: str) -> list[int]:
    """What to cache so that later prompts starting the same way reuse it: the messages rendered as
    generate renders them, cut after `anchor` (the text of the last message given: the document,
    or the system prompt), less the last token, which may merge with whatever follows."""
    prompt = build_prompt(tokenizer, template, messages, kwargs)
    if template.text is not None:
        # Templates may trim a message; its text still ends where the trimmed text does.
        found = [(prompt.text.rfind(a), a) for a in (anchor, anchor.strip()) if a]
        at, text = max(found) if found else (-1, "")
        if at < 0:
            raise MlxLlamaError(f"template {template.label}: the text to cache does not appear in its rendering")
        ids = tokenize_rendered(tokenizer, prompt.text[: at + len(text)])
    else:
        ids = prompt.ids
    if len(ids) < 2:
        raise MlxLlamaError("the prefix to cache is empty")
    return ids[:-1]


def load(path: str, runtime, template: Template) -> SavedPrefix:
    """The prefix saved at `path`, checked against this run; a one-line error if it does not belong."""
    if not os.path.isfile(path):
        raise MlxLlamaError(f"{path}: no such file")
    try:
        arrays, metadata = mx.load(path, format="safetensors", return_metadata=True)
        mx.eval(list(arrays.values()))
    except (RuntimeError, ValueError, OSError) as e:
        raise MlxLlamaError(f"{path}: not a readable prompt cache ({' '.join(str(e).split())})") from None
    if metadata.get("format") != FORMAT:
        raise MlxLlamaError(f"{path}: not a prompt cache made by mlxllama cache-prompt ({FORMAT})")
    if metadata.get("checksum") != checksum(arrays):
        raise MlxLlamaError(f"{path}: corrupt (its arrays do not match the checksum it was saved with)")
    if metadata.get("model_identity") != model_identity(runtime.path):
        raise MlxLlamaError(f"{path}: made for another model ({metadata.get('model', '?')}), not"
                            f" {os.path.basename(runtime.path)}")
    try:
        saved = json.loads(metadata.get("settings", ""))
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise MlxLlamaError(f"{path}: its settings are unreadable")
    ours = settings_of(runtime, template)
    for key, name in SETTING_NAMES.items():
        if saved.get(key) != ours[key]:
            raise MlxLlamaError(f"{path}: made with {name} {saved.get(key)!r}, this run has {ours[key]!r}")
    ids = _ids(path, arrays)
    return SavedPrefix(path, ids, _layers(path, arrays, runtime), _copies(path, arrays, runtime, len(ids)))


def _ids(path: str, arrays: dict) -> list[int]:
    ids = arrays.get("ids")
    if ids is None or ids.ndim != 1 or ids.dtype != mx.int32 or ids.size == 0:
        raise MlxLlamaError(f"{path}: no token ids")
    return ids.tolist()


def _layers(path: str, arrays: dict, runtime) -> list[tuple[Buffer, Buffer]]:
    """Each layer's keys and values, of the shapes this model's cache holds for the prefix."""
    config, n = runtime.config, arrays["ids"].size
    expected = {name: _stored_layout(runtime.model, n, name) for name in ("keys", "values")}
    layers = []
    for i in range(config.n_layers):
        pair = []
        for name in ("keys", "values"):
            parts = []
            for suffix, shape, dtype in expected[name]:
                key = f"layers.{i}.{name}{suffix}"
                a = arrays.get(key)
                if a is None or a.shape != shape or a.dtype != dtype:
                    raise MlxLlamaError(f"{path}: {key} is missing or not {list(shape)} {dtype}")
                parts.append(a)
            pair.append(tuple(parts) if len(parts) > 1 else parts[0])
        layers.append(tuple(pair))
    taken = (len(expected["keys"]) + len(expected["values"])) * config.n_layers
    opens = sum(f"layers.{i}.keys.open" in arrays for i in range(config.n_layers))
    if len(arrays) - opens != 1 + taken:
        raise MlxLlamaError(f"{path}: holds {len(arrays) - 1 - opens} layer arrays, the model's {config.n_layers}"
                            f" layers take {taken}")
    return layers


def _copies(path: str, arrays: dict, runtime, n: int) -> list[tuple] | None:
    """Keys by channel: each layer's copies of the keys of the block the prefix ends in, where the
    file holds them (a file saved before it did restores without them: that block's keys are
    refilled from their codes, rounded once more); None where there are none to hold."""
    model = runtime.model
    q = model.kv_quantization
    if q is None or not q.keys_by_channel or n <= q.start or not n % CHANNEL_BLOCK:
        return None
    c, first = model.config, block_start(n)
    shape = (1, c.n_kv_heads, n - first, c.head_dim)
    held = [arrays.get(f"layers.{i}.keys.open") for i in range(c.n_layers)]
    if all(a is None for a in held):
        return None
    for i, a in enumerate(held):
        if a is None or a.shape != shape or a.dtype != model.compute_dtype:
            raise MlxLlamaError(f"{path}: layers.{i}.keys.open is missing or not {list(shape)} {model.compute_dtype}")
    return [(a, first) for a in held]


def _stored_layout(model, n: int, name: str) -> list[tuple[str, tuple, mx.Dtype]]:
    """The arrays a layer's keys or values (`name`) of n positions are stored as: (name suffix,
    shape, dtype)."""
    c, dtype, q = model.config, model.compute_dtype, model.kv_quantization
    if q is None or n <= q.start:
        return [("", (1, c.n_kv_heads, n, c.head_dim), dtype)]
    bits = q.bits_of_keys if name == "keys" else q.bits
    if name == "keys" and q.keys_by_channel:  # whole blocks, a scale and bias a channel of each
        n, group_size = whole_blocks(n), CHANNEL_BLOCK
    else:
        group_size = q.group_size
    groups = (1, c.n_kv_heads, n, c.head_dim // group_size)
    layouts = [((1, c.n_kv_heads, n, c.head_dim * bits // 32), mx.uint32), (groups, dtype), (groups, dtype)]
    return [(f".{part}", shape, dtype) for part, (shape, dtype) in zip(QUANTIZED_PARTS, layouts)]
