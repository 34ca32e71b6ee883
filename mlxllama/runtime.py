"""The loaded model users script against: `mlxllama.load(path)`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType

from .cache import KVCache, KVQuantization, check_kv_size
from .constraints import Constraint, Guide
from .distributed import world
from .errors import MlxLlamaError
from .generate import GenerationResult, TextStream
from .gguf_file import open_gguf, read_metadata
from .models import ModelConfig, Transformer, architecture_of
from .models.transformer import EXPLICIT_FIRST
from .prompt import build_prompt, choose_template, render_messages
from .prompt_cache import PromptCache
from .quantized_layers import NativeExperts, NativeLinear, SubBlockLinear
from .sampling import SamplingParams, make_sampler
from .sharding import Shard, plan_shard
from .speculative import Drafting, Speculation
from .tokenizer import Tokenizer
from .tool_calls import ToolCall, read_tool_choice, read_tools, template_message, tool_use
from .weights import load_model

# "0" keeps MLX's CUDA backend on the plain step (for comparisons); mlxllama.cuda reads "uncompiled".
CUDA_KERNELS_ENV = "MLXLLAMA_CUDA_KERNELS"


def compute_dtype(name: str) -> mx.Dtype:
    """The compute type a name (--dtype's) stands for."""
    if name not in ("float32", "float16", "bfloat16"):
        raise MlxLlamaError(f"dtype {name!r}: expected float32, float16 or bfloat16")
    return getattr(mx, name)


def default_dtype() -> mx.Dtype:
    # MLX's CPU backend runs float16 matmuls slower than float32 (it converts), so the CPU gets float32.
    return mx.float16 if mx.default_device() == mx.gpu else mx.float32


@dataclass
class ChatReply:
    """An assistant turn: its text, the tool calls read from it, and why it ended ("tool_calls"
    when it made calls, else the generation's "stop" or "length")."""

    content: str
    tool_calls: list[ToolCall]
    finish_reason: str
    result: GenerationResult


class Runtime:
    def __init__(self, path: str, config: ModelConfig, model: Transformer, tokenizer: Tokenizer, metadata: dict,
                 load_seconds: float, dequantized: bool = False):
        self.path = path
        self.dequantized = dequantized  # every weight expanded to the compute dtype (load's `dequantize`)
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.metadata = metadata
        self.load_seconds = load_seconds

    @property
    def weight_form(self) -> str:
        """How the weights are held, as a saved prompt cache records it (its keys and values differ by
        it): "dequantized", "native" (MLX's affine form), "native, sub-blocks" (the K-types in the
        CPU's exact form, quantized_layers.SubBlockLinear), or "native, wide Q6_K" (Q6_K matrices
        on the wide form's grids, one every 64 values: quants.to_affine)."""
        if self.dequantized:
            return "dequantized"
        modules = self.model.modules()
        if any(isinstance(m, SubBlockLinear) for m in modules):
            return "native, sub-blocks"
        affine_q6_k = any(isinstance(m, (NativeLinear, NativeExperts)) and m.qtype == GGMLQuantizationType.Q6_K
                          for m in modules)
        return "native, wide Q6_K" if self.model.wide_q6_k and affine_q6_k else "native"

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
        return self.model.make_cache()

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """float32 [len(ids), vocab] from one fresh forward pass (no cache)."""
        out = self.model(mx.array([list(ids)]))
        return np.array(out[0], dtype=np.float32)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 256, params: SamplingParams = SamplingParams(),
               stop: Sequence[str] = (), special: bool = False, constraint: Constraint | None = None,
               prompt_cache: PromptCache | None = None, max_kv_size: int = 0, keep: int = 4,
               draft: Runtime | int | None = None, draft_tokens: int = 4, **sampling) -> TextStream:
        """Text pieces as they are generated; the stream's `.result` is set once it is exhausted.

        A string prompt is tokenized with BOS and no template; `special` parses control tokens in it.
        `constraint` (a Constraint: JSON Schema, any JSON object, regex or grammar) is what the
        output must match. With a `prompt_cache` (a PromptCache, e.g. a saved prefix loaded by
        mlxllama.prompt_files) only what follows the longest prefix it holds is prefilled; the
        stream's `cached_tokens` says how many came from it. A `max_kv_size` bounds the KV cache:
        it keeps the first `keep` positions and the last ones (cache.RotatingKVCache), and the
        prompt and reply may then run past the model's context. `draft` turns on speculative
        decoding: another loaded model of the same vocabulary, or an int n for prompt lookup over
        n-grams; `draft_tokens` are checked at a time, and the result says how many were drafted
        and accepted. Greedy output is the plain greedy output; sampled tokens follow the model's
        distribution exactly. Sampling keywords (temperature=, top_k=, seed=… : the fields of
        SamplingParams) override `params`.
        """
        check_kv_size(max_kv_size, keep, self.model.kv_quantization)
        params = params.with_overrides(**sampling)
        ids = self.tokenize(prompt, special=special) if isinstance(prompt, str) else list(prompt)
        guide = Guide(constraint, self.tokenizer) if constraint is not None else None
        entry, cached = prompt_cache.lookup(ids) if prompt_cache is not None else (None, 0)
        if entry is not None:
            cache = prompt_cache.restore(entry, cached, self.model)
        else:
            cache = self.model.make_cache(max_kv_size=max_kv_size, keep=keep)
        speculation = self.speculation(draft, params, draft_tokens, max_kv_size, keep)
        sampler = make_sampler(params, self.model.sampling_group)
        return TextStream(self.model, self.tokenizer, cache, ids, sampler, max_tokens, stop,
                          new_ids=ids[cached:], guide=guide, speculate=speculation)

    def chat(self, messages: Sequence[dict], max_tokens: int = 256, params: SamplingParams = SamplingParams(),
             stop: Sequence[str] = (), template: str | None = None, tools: Sequence[dict] | None = None,
             tool_choice: Any = "auto", constraint: Constraint | None = None, template_kwargs: dict | None = None,
             **sampling) -> ChatReply:
        """One assistant turn for OpenAI-style messages, rendered with the file's chat template (or
        the built-in `template`).

        `tools` (OpenAI's list of functions) is given to the template as transformers gives it;
        the reply is read back into tool calls in the template's format (Hermes/Qwen, Llama 3.x,
        Mistral). `tool_choice` "required" or {"type": "function", "function": {"name": …}} holds
        the reply to a call with arguments that match the tool's schema; "none" leaves tools out.
        Messages may carry an assistant's `tool_calls` and `role: "tool"` results.
        """
        chosen = choose_template(self.chat_template, name=template)
        use = tool_use(chosen.text, chosen.label, read_tools(tools or []), read_tool_choice(tool_choice))
        if use is not None and use.choice != "auto":
            if constraint is not None:
                raise MlxLlamaError("a required tool call and a constraint exclude each other")
            constraint = use.constraint(self.tokenizer)
        variables = {**(template_kwargs or {}), **(use.template_variables() if use else {})}
        prompt = build_prompt(self.tokenizer, chosen, [template_message(m) for m in messages], variables)
        result = self.generate(prompt.ids, max_tokens, params, stop, constraint=constraint, **sampling)
        content, calls = use.read_reply(self.tokenizer, result.token_ids) if use else (result.text, [])
        return ChatReply(content if calls else result.text, calls, "tool_calls" if calls else result.finish_reason,
                         result)

    def drafting(self, draft: Runtime | int, draft_tokens: int = 4) -> Drafting:
        """How sequences of this model are drafted for: by another loaded model of its vocabulary
        (checked here), or by prompt lookup over n-grams of up to an int n."""
        if isinstance(draft, int):
            return Drafting(draft_tokens, lookup=draft)
        return Drafting.with_model(draft, self.tokenizer, draft_tokens)

    def speculation(self, draft: Runtime | int | None, params: SamplingParams, draft_tokens: int = 4,
                    max_kv_size: int = 0, keep: int = 0) -> Speculation | None:
        """Speculative decoding of one sequence (see `drafting`; a draft model's cache bounded by
        `max_kv_size` as the model's is; None: no speculation)."""
        if draft is None:
            return None
        drafting = self.drafting(draft, draft_tokens)
        return Speculation(drafting.drafter(max_kv_size, keep), params, drafting.k)

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 256, params: SamplingParams = SamplingParams(),
                 stop: Sequence[str] = (), special: bool = False, constraint: Constraint | None = None,
                 **sampling) -> GenerationResult:
        """The whole continuation at once: `stream(...).run()`; greedy unless the sampling settings say otherwise."""
        return self.stream(prompt, max_tokens, params, stop, special, constraint, **sampling).run()


def load(path: str | os.PathLike, dtype: mx.Dtype | str | None = None, dequantize: bool = False,
         context_length: int | None = None, kv_quantization: KVQuantization | None = None,
         parallel: str | None = None, requantize: bool = True) -> Runtime:
    """Load a GGUF model that computes in `dtype` (an mx.Dtype or its name; default: float16 on a
    GPU, float32 on the CPU).

    `context_length` limits prompt plus generation (default: the model's trained context, as
    llama.cpp's n_ctx) and, like llama.cpp's n_ctx, picks Phi-3's short or long LongRoPE factors.

    Quantized matrices stay quantized (native mode, weights.py); `dequantize` expands every weight
    to `dtype` instead, the simple mode to compare against. On the CPU native mode holds Q2_K,
    Q3_K, Q4_K and Q6_K matrices in their sub-block form (quantized_layers.SubBlockLinear: the
    file's values, in about its bits). On a GPU it holds Q2_K and Q6_K matrices re-quantized to 8
    bits a value (quants.py: their 16-value sub-blocks have no exact affine form; Q6_K in groups of
    64 with its biases stored, or of 32 where the CUDA kernels read it), except a Q6_K output layer
    under mlxllama.cuda, which keeps the file's blocks and a kernel of its own (cuda/blocks.py).
    Without `requantize` it expands Q2_K and Q6_K to `dtype` everywhere and holds the file's values
    (trace does, to compare against an exact reference). The decode step is chosen here, once: on
    MLX's CUDA backend a native model decodes through the kernels of mlxllama.cuda, and every model
    prefills a shape with explicit attention the first time it meets it (Transformer.attend_prefill).

    With a `kv_quantization` (KVQuantization(bits=8), say) every cache made for the model stores its
    keys and values quantized: --kv-bits.

    Under `mlx.launch`, `parallel` splits the model over the launched processes (sharding.py):
    "tensor" (each rank holds a share of every layer; a pipeline where the model does not split
    so, said on stderr by the CLI through `runtime.shard.reason`) or "pipeline" (a range of layers
    a rank). Every rank must then run the same calls: rank 0's sampled tokens are the ones all
    ranks feed (distributed.py). None, or a single process, loads the whole model.
    """
    start = time.perf_counter()
    gguf, architecture, config, tokenizer = read_header(path, context_length)
    dtype = compute_dtype(dtype) if isinstance(dtype, str) else dtype or default_dtype()
    shard = plan_parallel(parallel, config, native=not dequantize)
    # The kernels fuse each projection with the residual add where a split model's all-reduce must
    # go: a split model runs the plain step (docs/distributed.md).
    kernels = not dequantize and requantize and shard is None and cuda_kernels_wanted()
    if kernels:
        from . import cuda  # here only: other platforms never read the kernels or load the CUDA driver
    # The kernels read every affine weight in groups of 32; MLX's own products take Q6_K's wide form.
    model = load_model(gguf, architecture, config, dtype, native=not dequantize, shard=shard, requantize=requantize,
                       block_products=cuda.block_products() if kernels else None,
                       sub_blocks=mx.default_device() == mx.cpu, wide=not (kernels and cuda.implemented(config)))
    model.store_kv_quantized(kv_quantization)
    if kernels:
        model.decode_step = cuda.kernel_step(model, fallback=model.decode_step) or model.decode_step
    if on_cuda():
        model.attend_prefill(EXPLICIT_FIRST)
    mx.eval(model.parameters())
    return Runtime(gguf.path, config, model, tokenizer, gguf.metadata, time.perf_counter() - start, dequantize)


def plan_parallel(parallel: str | None, config: ModelConfig, native: bool) -> Shard | None:
    """This rank's part of the model for `parallel` ("tensor", "pipeline" or None: all of it)."""
    if parallel not in (None, "tensor", "pipeline"):
        raise MlxLlamaError(f"parallel must be 'tensor' or 'pipeline', not {parallel!r}")
    w = world()
    if parallel is None or w.size == 1:
        return None
    return plan_shard(config, w.rank, w.size, w.group, pipeline=parallel == "pipeline", native=native,
                      hand_over="sum" if on_cuda() else "send")


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def cuda_kernels_wanted() -> bool:
    return on_cuda() and os.environ.get(CUDA_KERNELS_ENV) != "0"


@dataclass
class ModelFile:
    """A GGUF file read without its weights: its configuration (for a context length, as load's),
    tokenizer and metadata. What a server's HTTP side needs while its engine's process holds the
    model (server/engine_process.py)."""

    path: str
    config: ModelConfig
    tokenizer: Tokenizer
    metadata: dict

    @property
    def chat_template(self) -> str | None:
        return self.metadata.get("tokenizer.chat_template")


def read_header(path: str | os.PathLike, context_length: int | None = None):
    """(the open file, its architecture, its configuration for `context_length`, its tokenizer):
    what load checks and reads before the weights (every tensor's shape included)."""
    gguf = open_gguf(path)
    architecture = architecture_of(gguf)
    return gguf, architecture, architecture.read_config(gguf, context_length), Tokenizer.from_metadata(gguf.metadata)


def read_model_file(path: str | os.PathLike, context_length: int | None = None) -> ModelFile:
    """What load checks and reads before the weights, and no weights."""
    gguf, _, config, tokenizer = read_header(path, context_length)
    return ModelFile(gguf.path, config, tokenizer, gguf.metadata)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer alone; works on vocab-only GGUF files."""
    return Tokenizer.from_metadata(read_metadata(path))
