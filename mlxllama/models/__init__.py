"""The architectures the runtime runs, found by a GGUF file's `general.architecture`.

Adding one is a file beside these and an entry below: docs/adding-an-architecture.md.
"""

from __future__ import annotations

from ..errors import MlxLlamaError
from ..gguf_file import GGUFFile
from .architecture import Architecture
from .config import Metadata, ModelConfig
from .gemma3 import Gemma3
from .llama import Llama
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen3moe import Qwen3Moe
from .transformer import Transformer

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in (Llama(), Qwen2(), Qwen3(), Qwen3Moe(), Phi3(), Gemma3())}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


def architecture_of(gguf: GGUFFile) -> Architecture:
    name = Metadata(gguf).get("general.architecture", str)
    if name not in ARCHITECTURES:
        raise MlxLlamaError(
            f"{gguf.path}: unsupported architecture {name!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return ARCHITECTURES[name]


def read_config(gguf: GGUFFile, context_length: int | None = None) -> ModelConfig:
    """The config of the file's architecture, for `context_length` tokens (None: its trained context)."""
    return architecture_of(gguf).read_config(gguf, context_length)


__all__ = ["ARCHITECTURES", "SUPPORTED_ARCHITECTURES", "Architecture", "ModelConfig", "Transformer",
           "architecture_of", "read_config"]
