"""Write llama.cpp's hidden states for a prompt as an `mlxllama trace` dump, to compare with ours.

Run with a Python that has llama-cpp-python installed:

    python scripts/dump_llama_cpp_trace.py MODEL.gguf "The capital of Italy is" DIR [--steps N] [--exact] [--ctx 512]
    mlxllama trace -m MODEL.gguf -p "The capital of Italy is" --no-template --steps N --ctx 512 --dump ours
    mlxllama trace --compare ours DIR

The prompt is tokenized with BOS and control tokens parsed, and evaluated in one batch with
outputs at every position; with --steps N, N - 1 greedy tokens are then fed back one pass each, as
`trace --steps N` does, so a bug that lives only in decoding (a position that stops advancing) is
found at its step. llama.cpp's graph callback (cb_eval) hands over each named tensor as it is
computed; those that correspond to the dump's files are copied out (ggml's [hidden, positions] is
numpy's [positions, hidden]): `embd` (`inp_embd` in some versions) -> embd, the first `attn_out-i`
of a pass -> layer_i_attn, the first `ffn_out-i` (the MLP's output; the second is the residual
after it) -> layer_i_mlp, and `l_out-i` -> layer_i_resid.

--exact runs llama.cpp on an F32 copy of the file's dequantized weights (written with gguf-py)
instead of the file itself: llama.cpp's quantized CPU matmuls round activations to 8 bits, which
moves chat-tiny Q4_K_M's hidden states by up to 17% from the exact answer, while the F32 copy gives
that answer for these weights. That is the reference `trace --compare` should be given.
"""

import argparse
import ctypes
import json
import re
from pathlib import Path

import gguf
import llama_cpp
import llama_cpp_cpu  # noqa: F401  (must come before any Llama is created)
import numpy as np

GGML_TYPE_F32 = 0
_LIB = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
_LIB.ggml_get_name.restype = ctypes.c_char_p
_LIB.ggml_get_name.argtypes = [ctypes.c_void_p]
_LIB.ggml_nbytes.restype = ctypes.c_size_t
_LIB.ggml_nbytes.argtypes = [ctypes.c_void_p]
_LIB.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]


class _TensorHead(ctypes.Structure):
    # The first fields of struct ggml_tensor (ggml.h): type, buffer, ne[4].
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4)]


_DUMPED = re.compile(r"(?:inp_)?embd|inp_scaled|(attn_out|ffn_out|l_out|attn_post_norm|ffn_post_norm)-(\d+)")
_KIND = {"attn_out": "attn", "ffn_out": "mlp", "l_out": "resid", "attn_post_norm": "attn", "ffn_post_norm": "mlp"}
# Tensors that replace one taken earlier in the pass: Gemma scales its embeddings (inp_scaled) and
# norms the attention's and the FFN's outputs (the post norms) before the residual adds, where our
# dump takes them.
_LATER = re.compile(r"inp_scaled|(attn_post_norm|ffn_post_norm)-\d+")
captured: dict[str, list[np.ndarray]] = {}  # each name's rows, one array a pass
this_pass: set[str] = set()  # the names already taken in the current pass


def dump_name(tensor_name: str) -> str | None:
    match = _DUMPED.fullmatch(tensor_name)
    if not match:
        return None
    if match.group(1) is None:
        return "embd"  # inp_embd, embd, or Gemma's inp_scaled
    return f"layer_{int(match.group(2)):03d}_{_KIND[match.group(1)]}"


@llama_cpp.ggml_backend_sched_eval_callback
def on_tensor(tensor, ask, user_data):
    tensor_name = _LIB.ggml_get_name(tensor).decode()
    name = dump_name(tensor_name)
    head = _TensorHead.from_address(tensor)
    later = _LATER.fullmatch(tensor_name) is not None
    if name is None or head.type != GGML_TYPE_F32 or (name in this_pass and not later):
        return not ask  # ask: "is this tensor wanted?"; otherwise: "go on?"
    if ask:
        return True
    data = np.empty(_LIB.ggml_nbytes(tensor) // 4, np.float32)
    _LIB.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
    rows = captured.setdefault(name, [])
    if name in this_pass:
        rows.pop()  # the later tensor is the one our dump holds
    rows.append(data.reshape(head.ne[1], head.ne[0]))
    this_pass.add(name)
    return True


_default_context_params = llama_cpp.llama_context_default_params


def _context_params():
    params = _default_context_params()
    params.cb_eval = on_tensor
    return params


llama_cpp.llama_context_default_params = llama_cpp.llama_cpp.llama_context_default_params = _context_params


def write_f32_copy(source: str, target: str) -> None:
    """The file with every tensor dequantized to F32 (metadata as it is): llama.cpp then computes
    in float32 throughout, with no 8-bit rounding of activations."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(target, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = field.types[0]
        value = gguf.LlamaFileType.ALL_F32 if name == "general.file_type" else field.contents()
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, value, value_type, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, value, value_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(n) for n in reversed(tensor.shape.tolist())]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(model_path: str, prompt: str, out: str, steps: int = 1, exact: bool = False, context: int = 512) -> None:
    run_path = model_path
    if exact:
        run_path = str(Path(out).with_suffix(".f32.gguf"))
        write_f32_copy(model_path, run_path)
    llm = llama_cpp.Llama(run_path, n_ctx=context, logits_all=True, n_threads=2, verbose=False)
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    fed = list(ids)
    this_pass.clear()
    llm.eval(ids)
    for _ in range(steps - 1):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if token == llm.token_eos():
            break
        this_pass.clear()
        llm.eval([token])
        fed.append(token)
    if exact:
        Path(run_path).unlink()
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in captured.items():
        np.save(directory / f"{name}.npy", np.concatenate(rows))
    meta = {"format": "mlxllama-trace", "version": 1, "model": Path(model_path).name, "token_ids": fed,
            "prompt_length": len(ids), "context_length": context, "producer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"
            + (" on an F32 copy of the weights" if exact else ""), "dtype": "float32"}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(captured)} tensors of {len(fed)} positions")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompt")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=1, help="passes, as trace --steps: the prompt, then greedy tokens")
    parser.add_argument("--exact", action="store_true", help="run on an F32 copy of the dequantized weights")
    parser.add_argument("--ctx", type=int, default=512, help="llama.cpp's n_ctx: trace the same --ctx (it picks"
                        " Phi-3's LongRoPE factors)")
    args = parser.parse_args()
    main(args.model, args.prompt, args.out, args.steps, args.exact, args.ctx)
