"""llama-cpp-python, made safe for this machine's CPU: import this before creating a Llama.

llama.cpp's extra buffer types (the AMX repacking path) crash inside the VM this project is
developed in, so every Llama created after this import has them switched off.
"""

import llama_cpp

_default_model_params = llama_cpp.llama_model_default_params


def _model_params_without_extra_bufts():
    params = _default_model_params()
    params.use_extra_bufts = False
    return params


llama_cpp.llama_model_default_params = _model_params_without_extra_bufts
llama_cpp.llama_cpp.llama_model_default_params = _model_params_without_extra_bufts
