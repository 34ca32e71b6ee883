"""`mlxllama inspect`: what a GGUF file holds, read from its header alone (no weights are loaded)."""

from __future__ import annotations

import math
import os
from collections import Counter
from typing import Any

from .chat_template import match_builtin
from .errors import MlxLlamaError
from .gguf_file import open_gguf, tensor_shape
from .models import ARCHITECTURES, SUPPORTED_ARCHITECTURES
from .tokenizer import Tokenizer

_TOKENIZER_KINDS = {"llama": "SentencePiece", "gpt2": "byte-level BPE"}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    gguf = open_gguf(path)
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    tensors = list(gguf.tensors.values())
    template = meta.get("tokenizer.chat_template")
    return {
        "file": gguf.path,
        "name": meta.get("general.name"),
        "architecture": arch,
        "supported": arch in SUPPORTED_ARCHITECTURES,
        # Every tensor counts, as llama.cpp's llama_model_n_params counts them.
        "parameters": sum(math.prod(tensor_shape(t)) for t in tensors),
        "context_length": meta.get(f"{arch}.context_length"),
        "rope_scaling": _rope_scaling_info(meta, arch),
        "layers": meta.get(f"{arch}.block_count"),
        "attention": _attention_info(gguf, arch),
        "tokenizer": _tokenizer_info(meta),
        "chat_template": None if template is None else {"builtin": match_builtin(template), "chars": len(template)},
        "tensor_types": dict(sorted(Counter(t.tensor_type.name for t in tensors).items())),
        "tensors": len(tensors),
        "file_bytes": sum(os.path.getsize(part) for part in gguf.parts),
        "files": len(gguf.parts),
        "tensor_bytes": sum(int(t.n_bytes) for t in tensors),
    }


def _attention_info(gguf, arch: str | None) -> dict[str, Any] | None:
    """Heads, head size, Q/K norms, sliding windows and experts as the model would be built (no weights
    read); None for an architecture we do not run or a file whose config is wrong (load says why)."""
    if arch not in ARCHITECTURES:
        return None
    try:
        c = ARCHITECTURES[arch].read_config(gguf)
    except MlxLlamaError:
        return None
    return {"heads": c.n_heads, "kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "qk_norm": c.qk_norm,
            "sliding_window": c.sliding_window or None,
            "sliding_layers": sum(c.sliding_layers) if c.sliding_window else 0,
            "global_layers": [i for i, s in enumerate(c.sliding_layers) if not s] if c.sliding_window else None,
            "experts": c.n_experts or None, "experts_used": c.n_experts_used or None,
            "expert_ffn": c.expert_ffn_size or None}


def _rope_scaling_info(meta: dict, arch: str | None) -> dict[str, Any] | None:
    """The RoPE scaling keys the file has (`{arch}.rope.scaling.type`, `.original_context_length`), else None."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind is None and original is None:
        return None
    return {"type": kind, "original_context_length": original}


def _tokenizer_info(meta: dict) -> dict[str, Any] | None:
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        return None
    info: dict[str, Any] = {
        "model": model,
        "kind": _TOKENIZER_KINDS.get(model, "unsupported"),
        "pre": meta.get("tokenizer.ggml.pre"),
        "tokens": len(meta.get("tokenizer.ggml.tokens", ())),
    }
    try:
        tok = Tokenizer.from_metadata(meta)
    except MlxLlamaError as e:
        return {**info, "error": str(e)}

    def token(tid: int | None) -> dict | None:
        return None if tid is None else {"id": tid, "text": tok.id_to_piece(tid)}

    # The ids as llama.cpp resolves them (defaults, out-of-range ids, end-of-turn found by its text).
    return {**info, "add_bos": tok.add_bos, "bos": token(tok.bos_id), "eos": token(tok.eos_id),
            "eot": token(tok.eot_id), "stop_ids": sorted(tok.stop_ids)}


def format_text(info: dict[str, Any]) -> str:
    def token(t: dict | None) -> str:
        return "none" if t is None else f"{t['id']} {t['text']!r}"

    params = info["parameters"]
    split = f" in {info['files']} files" if info["files"] > 1 else ""
    lines = [
        ("file", f"{info['file']} ({info['file_bytes']:,} bytes{split}, tensors {info['tensor_bytes']:,} bytes)"),
        ("name", info["name"] or "-"),
        ("architecture", f"{info['architecture']} ({'supported' if info['supported'] else 'not supported'})"),
        ("parameters", f"{_short(params)} ({params:,})"),
        ("context length", info["context_length"]),
    ]
    rope = info["rope_scaling"]
    if rope is not None:
        parts = [] if rope["type"] is None else [f"type {rope['type']}"]
        if rope["original_context_length"] is not None:
            parts.append(f"original context length {rope['original_context_length']}")
        lines.append(("rope scaling", ", ".join(parts)))
    lines.append(("layers", info["layers"]))
    attention = info["attention"]
    if attention is not None:
        norms = ", Q/K norms" if attention["qk_norm"] else ""
        lines.append(("attention", f"{attention['heads']} heads ({attention['kv_heads']} KV) of {attention['head_dim']}{norms}"))
        if attention["sliding_window"]:
            lines.append(("sliding window", f"{attention['sliding_window']} on {attention['sliding_layers']} of"
                          f" {info['layers']} layers (global: {', '.join(map(str, attention['global_layers']))})"))
        if attention["experts"]:
            lines.append(("experts", f"{attention['experts_used']} of {attention['experts']} a token, FFNs of"
                          f" {attention['expert_ffn']}"))
    tok = info["tokenizer"]
    if tok is None:
        lines.append(("tokenizer", "none"))
    else:
        pre = f", pre-tokenizer {tok['pre']}" if tok["pre"] else ""
        lines.append(("tokenizer", f"{tok['kind']} ({tok['model']}){pre}, {tok['tokens']:,} tokens"))
        if "error" in tok:
            lines.append(("", f"cannot be used: {tok['error']}"))
        else:
            lines += [("BOS", token(tok["bos"]) + (" (added)" if tok["add_bos"] else "")),
                      ("EOS", token(tok["eos"])), ("EOT", token(tok["eot"])),
                      ("stop ids", " ".join(map(str, tok["stop_ids"])))]
    template = info["chat_template"]
    if template is None:
        lines.append(("chat template", "none"))
    else:
        match = f"matches built-in '{template['builtin']}'" if template["builtin"] else "no built-in match"
        lines.append(("chat template", f"{template['chars']:,} characters, {match}"))
    types = ", ".join(f"{name} {count}" for name, count in info["tensor_types"].items())
    lines.append(("tensor types", f"{types} ({info['tensors']} tensors)"))
    return "\n".join(f"{label:<15}{value}" for label, value in lines)


def _short(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
