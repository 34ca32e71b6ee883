#!/usr/bin/env bash
# llama.cpp's llama-bench and llama-batched-bench for Hopper (sm_90), built on this project's machine
# (no GPU, 2 cores, CUDA 13.0's nvcc; 19 minutes) instead of on the GPU machine (8 minutes of device
# time there), from the source llama-cpp-python 0.3.36 vendors, as benchmarks/build_llama_cpp.sh builds it there.
# Run in a work folder /tmp/llcpp holding:
#   - cublas/: PyPI's nvidia-cublas 13.x wheel unzipped (`pip download --no-deps "nvidia-cublas>=13,<14"`);
#   - stub/: libcuda.so, an empty library with the soname libcuda.so.1 (gcc -shared -fPIC
#     -Wl,-soname,libcuda.so.1), and libcublas.so / libcublasLt.so linked to the wheel's .so.13 files;
#   - src/: llama-cpp-python 0.3.36's sdist unpacked (`pip download --no-deps --no-binary :all:`).
# The linker drops the stub (nothing is taken from it), so on the GPU machine the driver's libcuda.so.1
# is preloaded (LD_PRELOAD) and cuBLAS found in MLX's nvidia/cu13 wheel (LD_LIBRARY_PATH); build/bin's
# binaries and libraries, with libcudart.so.13, travel as one .tar.xz (42 MB).
set -e
CU=/tmp/llcpp/cublas/nvidia/cu13
export PATH=/usr/local/cuda-13.0/bin:$PATH
cmake -S src/llama_cpp_python-0.3.36/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DGGML_CUDA_NO_VMM=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_LIBRARY_PATH=/tmp/llcpp/stub -DCUDAToolkit_ROOT=/usr/local/cuda-13.0 \
  -DCMAKE_CUDA_FLAGS="-I$CU/include" -DCMAKE_CXX_FLAGS="-I$CU/include" -DCMAKE_C_FLAGS="-I$CU/include" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--allow-shlib-undefined" -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON
start=$SECONDS
nice cmake --build build --target llama-bench llama-batched-bench -j 2
echo "built in $((SECONDS - start)) s"
