#!/usr/bin/env bash
# Build llama.cpp's llama-bench, llama-batched-bench and llama-server (no web page) with CUDA for Hopper (sm_90) on the GPU machine,
# from the llama.cpp source that llama-cpp-python 0.3.36 vendors (the CPU reference's version).
#   bash benchmarks/build_llama_cpp.sh SRC BUILD   -> BUILD/bin/llama-bench, BUILD.done when finished
# That machine's CUDA toolkit is assembled from pip wheels: cuBLAS sits in site-packages/nvidia/cu13
# without the unversioned .so names CMake looks for, and libcuda.so comes with the driver, so both
# are linked into one folder handed to CMake.
set -euo pipefail
src=$1 build=$2
links=$build-links
mkdir -p "$links"
cu13=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))')
for lib in "$cu13"/lib/libcublas.so.* "$cu13"/lib/libcublasLt.so.*; do
    ln -sf "$lib" "$links/$(basename "$lib" | sed 's/\.so\..*/.so/')"
done
libcuda=$( (ldconfig -p | awk '/libcuda\.so\.1 /{print $NF}'; ls /usr/local/nvidia/lib64/libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1 2>/dev/null) | head -1 || true)
vmm=OFF
if [ -n "$libcuda" ]; then ln -sf "$libcuda" "$links/libcuda.so"; else vmm=ON; fi
echo "cublas from $cu13, libcuda: ${libcuda:-none (GGML_CUDA_NO_VMM=ON)}, nvcc: $(command -v nvcc)"
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_CUDA_NO_VMM=$vmm -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DCMAKE_LIBRARY_PATH="$links" \
    -DCMAKE_CUDA_FLAGS="-I$cu13/include" -DCMAKE_CXX_FLAGS="-I$cu13/include"
start=$SECONDS
cmake --build "$build" --target llama-bench llama-batched-bench llama-server -j "$(nproc)"
echo "built in $((SECONDS - start)) s"
touch "$build.done"
