#!/usr/bin/env bash
# Compile-checks the CUDA sources without a GPU.
#
#  * nvcc: every cuda/*.cu, for sm_80 and sm_90, to cubin, with -DZPP_NVCC_CHECK so that the
#    file's guarded block instantiates each kernel template. One line per file and arch.
#  * NVRTC (what cupy uses at run time), when a libnvrtc can be found (the CUDA toolkit, or the
#    pip package nvidia-cuda-nvrtc; ZPP_NVRTC=/path/libnvrtc.so.N picks one): cuda/quant.cu
#    with the options and name expressions of zpp/quant/cuda.py, for the same archs
#    (.ci/nvrtc_check.py).
#
# Exits non-zero on any failure; without nvcc (and without NVRTC) it says so and exits 0,
# unless ZPP_REQUIRE_NVRTC=1 (CI), which makes a missing libnvrtc a failure.
set -u
cd "$(dirname "$0")/.."

archs=(80 90)
status=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

NVCC=${NVCC:-}
if [ -z "$NVCC" ]; then
    if command -v nvcc >/dev/null 2>&1; then
        NVCC=$(command -v nvcc)
    elif [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then
        NVCC="${CUDA_HOME:-/usr/local/cuda}/bin/nvcc"
    fi
fi

shopt -s nullglob
sources=(cuda/*.cu)
if [ ${#sources[@]} -eq 0 ]; then
    echo "compile_cuda: no cuda/*.cu files"
    exit 1
fi

if [ -z "$NVCC" ]; then
    echo "compile_cuda: nvcc not found: skipped the nvcc check"
else
    echo "compile_cuda: $("$NVCC" --version | tail -n 1)"
    for src in "${sources[@]}"; do
        base=$(basename "$src" .cu)
        for arch in "${archs[@]}"; do
            out="$tmp/${base}.sm_${arch}.cubin"
            log="$tmp/${base}.sm_${arch}.log"
            if "$NVCC" -std=c++17 --fmad=false -DZPP_NVCC_CHECK -arch="sm_${arch}" -cubin \
                -Werror all-warnings -Xptxas -v -o "$out" "$src" >"$log" 2>&1; then
                kernels=$(grep -c "Compiling entry function" "$log")
                spills=$(grep -Eo "[0-9]+ bytes spill stores" "$log" | awk '{s += $1} END {print s + 0}')
                echo "nvcc   $src sm_${arch}: ok ($kernels kernels, $spills bytes of spill stores in all)"
            else
                echo "nvcc   $src sm_${arch}: FAILED"
                sed 's/^/    /' "$log"
                status=1
            fi
        done
    done
fi

# NVRTC, as cupy.RawModule compiles it (no headers, name expressions): .ci/nvrtc_check.py.
python3 .ci/nvrtc_check.py "${archs[@]}" || status=1

if [ $status -ne 0 ]; then
    echo "compile_cuda: FAILED"
else
    echo "compile_cuda: ok"
fi
exit $status
