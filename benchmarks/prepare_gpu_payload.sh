#!/usr/bin/env bash
# Build what the GPU scripts carry to the device machine, under .whl/ (git-ignored), from the package index:
#   .whl/p1..p5  MLX 0.32.4 for CUDA 13 (the mlx and mlx-cuda-13 wheels unpacked, tar | xz -9, split in
#                five parts of at most 16 MB, so each call stays under the 64 MiB limit with the repository),
#   .whl/p1      also llama.cpp's source as llama-cpp-python 0.3.36 vendors it, cut to what llama-bench and
#                llama-batched-bench need with the CPU and CUDA backends,
#   .whl/p5      also the gguf wheel.
# Takes a few minutes (xz -9 of ~190 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
pip_download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_17_x86_64 --platform any -d "$work/dl" "$@"
}
pip_download mlx==0.32.4 mlx-cuda-13==0.32.4 gguf==0.19.0
mkdir -p "$work/site"
for wheel in "$work"/dl/mlx*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
(cd "$work/site" && tar cf - . | xz -9 -T0 > "$work/mlx.tar.xz")
rm -rf .whl/p1 .whl/p2 .whl/p3 .whl/p4 .whl/p5
mkdir -p .whl/p1 .whl/p2 .whl/p3 .whl/p4 .whl/p5
split -b 16000000 -d "$work/mlx.tar.xz" "$work/mlx.part"
for i in 0 1 2 3 4; do mv "$work/mlx.part0$i" ".whl/p$((i + 1))/"; done
cp "$work"/dl/gguf-*.whl .whl/p5/

python3 -m pip download -q --no-deps --no-binary :all: -d "$work/src" llama-cpp-python==0.3.36
tar xzf "$work"/src/llama_cpp_python-0.3.36.tar.gz -C "$work/src"
full=$work/src/llama_cpp_python-0.3.36/vendor/llama.cpp
cut=$work/llama.cpp
mkdir -p "$cut/tools" "$cut/ggml/src"
cp -r "$full"/{CMakeLists.txt,LICENSE,cmake,include,src,common,licenses,vendor} "$cut/"
cp -r "$full"/tools/{llama-bench,batched-bench} "$cut/tools/"
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(llama-bench)\nadd_subdirectory(batched-bench)\n' \
    > "$cut/tools/CMakeLists.txt"
cp -r "$full"/ggml/{CMakeLists.txt,cmake,include} "$cut/ggml/"
cp -r "$full"/ggml/src/{CMakeLists.txt,*.c,*.cpp,*.h,*.in,ggml-cpu,ggml-cuda,ggml-blas} "$cut/ggml/src/"
tar cf - -C "$work" llama.cpp | xz -6 -T0 > .whl/p1/llama.cpp.tar.xz
rm -rf "$work"
du -sh .whl/p*
