"""Write llama.cpp's hidden states for a prompt as an `mlxllama trace` dump, to compare with ours.

Run with a Python that has llama-cpp-python installed:

    python scripts/dump_llama_cpp_trace.py MODEL.gguf "The capital of Italy is" DIR
    mlxllama trace -m MODEL.gguf -p "The capital of Italy is" --no-template --dump ours
    mlxllama trace --compare ours DIR

The prompt is tokenized with BOS and control tokens parsed, and evaluated in one batch with
outputs at every position. llama.cpp's graph callback (cb_eval) hands over each named tensor as
it is computed; those that correspond to the dump's files are copied out (ggml's [hidden,
positions] is numpy's [positions, hidden]): `embd` (`inp_embd` in some versions) -> embd, the
first `attn_out-i` -> layer_i_attn, the first `ffn_out-i` (the MLP's output; the second is the
residual after it) -> layer_i_mlp, and `l_out-i` -> layer_i_resid. Only the prompt is dumped, so
trace the same prompt with --steps 1.
"""

import ctypes
import json
import re
import sys
from pathlib import Path

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


_DUMPED = re.compile(r"(?:inp_)?embd|(attn_out|ffn_out|l_out)-(\d+)")
_KIND = {"attn_out": "attn", "ffn_out": "mlp", "l_out": "resid"}
captured: dict[str, np.ndarray] = {}


def dump_name(tensor_name: str) -> str | None:
    match = _DUMPED.fullmatch(tensor_name)
    if not match:
        return None
    if match.group(1) is None:
        return "embd"
    return f"layer_{int(match.group(2)):03d}_{_KIND[match.group(1)]}"


@llama_cpp.ggml_backend_sched_eval_callback
def on_tensor(tensor, ask, user_data):
    name = dump_name(_LIB.ggml_get_name(tensor).decode())
    head = _TensorHead.from_address(tensor)
    if name is None or head.type != GGML_TYPE_F32 or name in captured:
        return not ask  # ask: "is this tensor wanted?"; otherwise: "go on?"
    if ask:
        return True
    data = np.empty(_LIB.ggml_nbytes(tensor) // 4, np.float32)
    _LIB.ggml_backend_tensor_get(tensor, data.ctypes.data, 0, data.nbytes)
    captured[name] = data.reshape(head.ne[1], head.ne[0])
    return True


_default_context_params = llama_cpp.llama_context_default_params


def _context_params():
    params = _default_context_params()
    params.cb_eval = on_tensor
    return params


llama_cpp.llama_context_default_params = llama_cpp.llama_cpp.llama_context_default_params = _context_params


def main(model_path: str, prompt: str, out: str) -> None:
    llm = llama_cpp.Llama(model_path, n_ctx=512, logits_all=True, n_threads=2, verbose=False)
    ids = llm.tokenize(prompt.encode("utf-8"), add_bos=True, special=True)
    llm.eval(ids)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in captured.items():
        np.save(directory / f"{name}.npy", rows)
    meta = {"format": "mlxllama-trace", "version": 1, "model": Path(model_path).name, "token_ids": ids,
            "prompt_length": len(ids), "producer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__})",
            "dtype": "float32"}
    (directory / "meta.json").write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    print(f"{out}: {len(captured)} tensors of {len(ids)} positions")


if __name__ == "__main__":
    main(*sys.argv[1:4])
