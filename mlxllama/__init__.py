"""mlxllama: run GGUF language models on MLX, with chat templates applied explicitly."""

from .batching import batch_generate
from .chat_template import render_chat
from .constraints import Constraint
from .errors import MlxLlamaError
from .runtime import Runtime, load, load_tokenizer

__all__ = ["Constraint", "MlxLlamaError", "Runtime", "batch_generate", "load", "load_tokenizer", "render_chat"]
