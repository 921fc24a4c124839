"""Compile cuda/quant.cu as cupy.RawModule does at run time, through NVRTC, without cupy or a GPU.

    python .ci/nvrtc_check.py 80 90        # the archs (sm_80, sm_90)

The source zpp.quant.cuda loads (``zc.source_path()``, the only kernel file) is compiled with
its ``_OPTIONS`` and every name expression of ``_NAMES``, each of which must get a lowered
name. A compile error, a missing name or any message in the log (warnings count, like
nvcc's -Werror) fails. libnvrtc comes from ``$ZPP_NVRTC``, the CUDA toolkit, or the pip
wheel ``nvidia-cuda-nvrtc``; none found, or zpp not importable: skipped (exit 0), unless
``ZPP_REQUIRE_NVRTC=1``.
"""
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
required = os.environ.get("ZPP_REQUIRE_NVRTC") == "1"
if path is None:
    print(f"nvrtc  cuda/quant.cu: {'FAILED' if required else 'skipped'} (no libnvrtc found; "
          "pip install nvidia-cuda-nvrtc to check)")
    sys.exit(1 if required else 0)
sys.path.insert(0, os.getcwd())
try:
    from zpp.quant import cuda as zc
except Exception as exc:  # torch missing, say
    print(f"nvrtc  cuda/quant.cu: {'FAILED' if required else 'skipped'} (cannot import zpp.quant.cuda: {exc})")
    sys.exit(1 if required else 0)

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
