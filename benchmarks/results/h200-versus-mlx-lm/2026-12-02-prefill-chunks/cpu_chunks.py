"""CPU: our prefill (the fused kernel, as the CPU runs it) in chunks of 512 and 2,048, rounds alternating."""
import statistics
import sys

import versus_mlx_lm
from mlxllama import bench, generate, load

runtime = load(sys.argv[1])
def ours(chunk):
    def timer(n, seed):
        generate.PREFILL_CHUNK = chunk
        try:
            return n / bench.time_prompt(runtime, n, seed)
        finally:
            generate.PREFILL_CHUNK = 512
    return timer
for n in (1024, 2048):
    s = versus_mlx_lm.interleaved_rounds({c: (lambda seed, t=ours(c): t(n, seed)) for c in (512, 2048)}, 3, {},
                                       warm_ups=2)  # as the run had
    middle, low, high = versus_mlx_lm.paired(s[2048], s[512])
    print(f"pp{n}: chunks of 512 {statistics.median(s[512]):.0f} t/s, of 2048 {statistics.median(s[2048]):.0f}; "
          f"2048/512 {middle:.2f}x ({low:.2f}-{high:.2f})", flush=True)
