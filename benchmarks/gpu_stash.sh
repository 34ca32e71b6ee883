#!/usr/bin/env bash
# GPU session, calls 1-4: MLX's CUDA build (~75 MB compressed) is more than one call may carry next to
# the repository, so each call leaves one part in /tmp/gpu. The first also starts building llama.cpp
# in the background (about 10 minutes on 16 cores), so it runs while the other parts arrive.
#   bash benchmarks/gpu_stash.sh .whl/p1   (then p2, p3, p4; gpu_run.sh takes p5)
set -euo pipefail
mkdir -p /tmp/gpu
cp "$1"/mlx.part* /tmp/gpu/
if [ -f "$1/llama.cpp.tar.xz" ]; then
    tar xJf "$1/llama.cpp.tar.xz" -C /tmp/gpu
    setsid nohup bash benchmarks/build_llama_cpp.sh /tmp/gpu/llama.cpp /tmp/gpu/llama-build \
        > /tmp/gpu/build.log 2>&1 < /dev/null &
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
fi
ls -la /tmp/gpu
tail -3 /tmp/gpu/build.log 2>/dev/null || true
