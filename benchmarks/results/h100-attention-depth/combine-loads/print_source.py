"""The source MLX generates for each layer kernel of a model's decode step: MLX prints it when a
kernel is called with verbose=True, here on each kernel's first call. On the GPU machine:

    python3 print_source.py MODEL.gguf > mlx-generated-source.txt
"""
import sys
import mlx.core as mx
made = mx.fast.cuda_kernel
seen = set()
def cuda_kernel(**kw):
    kernel = made(**kw)
    def call(**args):
        key = (kw["name"], tuple(args.get("template") or ()))
        args["verbose"] = key not in seen
        seen.add(key)
        return kernel(**args)
    return call
mx.fast.cuda_kernel = cuda_kernel
from mlxllama import load
rt = load(sys.argv[1])
model = rt.model
cache = model.make_cache()
mx.eval(model.step(mx.array([[1]]), cache))
mx.eval(model.step(mx.array([[5]]), cache))
