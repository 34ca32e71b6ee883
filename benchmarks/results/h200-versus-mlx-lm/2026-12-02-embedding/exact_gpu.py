import sys, gguf, numpy as np, mlx.core as mx
from gguf.quants import dequantize as reference
from mlxllama.quantized_layers import BlockEmbedding
from mlxllama.tensors import Blocks
print(mx.default_device())
for path in sys.argv[1:]:
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name not in ("Q4_K", "Q5_K", "Q6_K", "Q8_0") or t.name not in ("token_embd.weight", "output.weight"):
            continue
        rows = int(t.shape[1])
        table = Blocks(mx.array(t.data).reshape(rows, -1), t.tensor_type)
        ids = np.random.default_rng(0).integers(0, rows, (4, 16))
        got = np.array(BlockEmbedding(table)(mx.array(ids)))
        want = reference(t.data, t.tensor_type).reshape(rows, -1)[ids]
        print(path.split("/")[-1], t.name, t.tensor_type.name, "bit-equal:", np.array_equal(got, want),
              "max |diff|:", float(np.abs(got - want).max()))
