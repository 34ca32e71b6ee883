"""The loaded model users script against: `mlxllama.load(path)`."""

from __future__ import annotations

import os
import time
from typing import Sequence

import mlx.core as mx
import numpy as np

from . import cuda_step, gguf_loader, quantized_model
from .cache import KVCache, make_cache
from .config import ModelConfig
from .fusion import fuse_projections
from .generate import GenerationResult, TextStream
from .model import Transformer
from .prompt import choose_template, render_messages
from .sampling import SamplingParams, make_sampler
from .tokenizer import Tokenizer


def default_dtype() -> mx.Dtype:
    # MLX's CPU backend runs float16 matmuls slower than float32 (it converts), so the CPU gets float32.
    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


class Runtime:
    def __init__(self, path: str, config: ModelConfig, model: Transformer, tokenizer: Tokenizer, metadata: dict,
                 load_seconds: float):
        self.path = path
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.metadata = metadata
        self.load_seconds = load_seconds

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            template: str | None = None, **kwargs) -> str:
        """Render messages with `template` (a built-in name) or else the GGUF's own chat template."""
        chosen = choose_template(self.chat_template, name=template)
        return render_messages(chosen, self.tokenizer, messages, add_generation_prompt, kwargs)

    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def new_cache(self) -> list[KVCache]:
        return make_cache(self.config.n_layers)

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), vocab] from one fresh forward pass (no cache)."""
        out = self.model(mx.array([list(ids)]))
        return np.array(out[0], dtype=np.float32)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, params: SamplingParams = SamplingParams(),
               stop: Sequence[str] = (), special: bool = False) -> TextStream:
        """Text pieces as they are generated; the stream's `.result` is set once it is exhausted.

        A string prompt is tokenized with BOS and no template; `special` parses control tokens in it.
        """
        ids = self.tokenize(prompt, special=special) if isinstance(prompt, str) else list(prompt)
        return TextStream(self.model, self.tokenizer, self.new_cache(), ids, make_sampler(params), max_tokens, stop)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, repeat_penalty: float = 1.0,
                 repeat_last_n: int = 64, seed: int | None = None, stop: Sequence[str] = (),
                 special: bool = False) -> GenerationResult:
        params = SamplingParams(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)
        return self.stream(prompt, max_tokens, params, stop, special).run()


def load(path: str | os.PathLike, dtype: mx.Dtype | None = None, dequantize: bool = False,
         context_length: int | None = None) -> Runtime:
    """Load a GGUF model that computes in `dtype` (default: float16 on a GPU, float32 on the CPU).

    `context_length` limits prompt plus generation (default: the model's trained context, as
    llama.cpp's n_ctx) and, like llama.cpp's n_ctx, picks Phi-3's short or long LongRoPE factors.

    Projections that read the same input are fused (fusion.py).

    Quantized matrices stay quantized (native mode, see quantized_model); `dequantize` expands
    every weight to `dtype` instead, the simple mode to compare against. On MLX's CUDA backend a
    native model decodes one sequence through the kernels of cuda_step.py.
    """
    start = time.perf_counter()
    gguf = gguf_loader.open_gguf(path)
    config = gguf_loader.read_config(gguf, context_length)
    tokenizer = Tokenizer.from_metadata(gguf.metadata)
    dtype = dtype or default_dtype()
    if dequantize:
        model = Transformer(config, dtype)
        # Not strict: read_config has checked every tensor's shape, and expected_shapes names every parameter.
        model.load_weights(list(gguf_loader.load_weights(gguf, config, dtype).items()), strict=False)
        fuse_projections(model)
    else:
        model = quantized_model.build(gguf, config, dtype)  # fuses block by block as it loads
        model.kernel_step = cuda_step.build(model)
    mx.eval(model.parameters())
    return Runtime(gguf.path, config, model, tokenizer, gguf.metadata, time.perf_counter() - start)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer alone; works on vocab-only GGUF files."""
    return Tokenizer.from_metadata(gguf_loader.read_metadata(path))
