#!/usr/bin/env bash
# Compile-checks the CUDA sources without a GPU.
#
#  * nvcc: every cuda/*.cu, for sm_80 and sm_90, to cubin, with -DZPP_NVCC_CHECK so that the
#    file's guarded block instantiates each kernel template. One line per file and arch.
#  * NVRTC (what cupy uses at run time), when a libnvrtc can be found (the CUDA toolkit, or the
#    pip package nvidia-cuda-nvrtc; ZPP_NVRTC=/path/libnvrtc.so.N picks one): cuda/quant.cu
#    with the options and name expressions of zpp/quant/cuda.py, for the same archs.
#
# Exits non-zero on any failure; without nvcc (and without NVRTC) it says so and exits 0.
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

# NVRTC, as cupy.RawModule compiles it (no headers, name expressions).
python3 - "${archs[@]}" <<'EOF' || status=1
import ctypes
import ctypes.util
import glob
import os
import sys
import sysconfig

archs = sys.argv[1:]


def find_nvrtc():
    if os.environ.get("ZPP_NVRTC"):
        return os.environ["ZPP_NVRTC"]
    cands = []
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    cands += sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*")))
    for sp in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        cands += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libnvrtc.so*")))
    cands = [c for c in cands if "builtins" not in c and ".alt." not in c]
    found = ctypes.util.find_library("nvrtc")
    if found:
        cands.append(found)
    return cands[0] if cands else None


path = find_nvrtc()
if path is None:
    print("nvrtc  cuda/quant.cu: skipped (no libnvrtc found; pip install nvidia-cuda-nvrtc to check)")
    sys.exit(0)
sys.path.insert(0, os.getcwd())
try:
    from zpp.quant import cuda as zc
except Exception as exc:  # torch missing, say
    print(f"nvrtc  cuda/quant.cu: skipped (cannot import zpp.quant.cuda: {exc})")
    sys.exit(0)

# libnvrtc opens libnvrtc-builtins by name: load the one beside it first (pip wheels).
for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
    if ".alt." not in builtins:
        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        break
lib = ctypes.CDLL(path)
major, minor = ctypes.c_int(), ctypes.c_int()
lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
lib.nvrtcGetErrorString.restype = ctypes.c_char_p
src = zc.source_path().read_bytes()
failed = False
for arch in archs:
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"quant.cu", 0, None, None)
    assert rc == 0, lib.nvrtcGetErrorString(rc)
    for name in zc._NAMES:
        assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = [o.encode() for o in zc._OPTIONS] + [f"-arch=sm_{arch}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    text = log.value.decode(errors="replace").strip()
    missing = []
    if rc == 0:
        for name in zc._NAMES:
            lowered = ctypes.c_char_p()
            if lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(lowered)) != 0 or not lowered.value:
                missing.append(name)
    if rc != 0 or missing or text:
        failed = failed or rc != 0 or bool(missing)
        what = "FAILED" if (rc != 0 or missing) else "ok, with messages"
        print(f"nvrtc  cuda/quant.cu sm_{arch}: {what} (NVRTC {major.value}.{minor.value}: "
              f"{lib.nvrtcGetErrorString(rc).decode()})")
        for line in text.splitlines():
            print("    " + line)
        for name in missing:
            print(f"    no lowered name for {name}")
        if text and rc == 0 and not missing:
            failed = True  # warnings count as failures, like -Werror for nvcc
    else:
        print(f"nvrtc  cuda/quant.cu sm_{arch}: ok ({len(zc._NAMES)} name expressions, "
              f"NVRTC {major.value}.{minor.value})")
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
sys.exit(1 if failed else 0)
EOF

if [ $status -ne 0 ]; then
    echo "compile_cuda: FAILED"
else
    echo "compile_cuda: ok"
fi
exit $status
