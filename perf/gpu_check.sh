#!/usr/bin/env bash
# The GPU check of zpp.quant's CUDA kernels and the offload paths, in one run of under 8 minutes
# (the step time limits below add up to 450 s):
#   1. nvidia-smi, torch / CUDA / cupy versions;
#   2. NVRTC compile of cuda/quant.cu (cupy, first use), then
#      python -m pytest tests/test_quant_cuda.py: every kernel, the 1-bit ones
#      (onebit_compress, signs_weighted_sum, unpack_scaled) included, bit-exact against the
#      reference with poisoned outputs;
#   3. tests/test_zero_offload.py and tests/test_zero_nvme.py's CUDA cases (ZeRO-Offload and the
#      NVMe tier: GPU -> host -> NVMe, the losses of offload "cpu");
#   4. perf/quant_bench_cuda.py: quantize / dequantize / reduce / signs / 1-bit bandwidth
#      against torch's device-to-device copy at 64 and 256 MiB.
# Everything printed also goes to $OUT/gpu_check.log (and the bench to
# $OUT/quant_bench_cuda.json) when $OUT is set. Exits non-zero when cupy is missing, a test
# fails or the bench fails.
set -u -o pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

out_dir=${OUT:-}
if [ -n "$out_dir" ]; then
    mkdir -p "$out_dir"
    log="$out_dir/gpu_check.log"
    bench_json="$out_dir/quant_bench_cuda.json"
else
    log=/dev/null
    bench_json=""
fi

run_all() {
    local rc=0
    echo "== nvidia-smi"
    nvidia-smi || echo "nvidia-smi failed"
    echo
    echo "== versions"
    python - <<'EOF' || rc=2
import sys
import torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
try:
    import cupy
except Exception as exc:
    print("cupy unavailable:", type(exc).__name__, exc)
    sys.exit(1)
try:
    from cupy.cuda import nvrtc, runtime
    print("cupy", cupy.__version__, "runtime", runtime.runtimeGetVersion(), "nvrtc", nvrtc.getVersion())
except Exception as exc:
    print("cupy", cupy.__version__, "(versions:", type(exc).__name__, exc, ")")
EOF
    if [ $rc -ne 0 ]; then
        echo "gpu_check: cupy is missing: the CUDA tests would only skip"
        return $rc
    fi
    echo
    echo "== compile (cupy NVRTC, first use)"
    timeout 90 python -c "
import time, torch
t = time.time()
from zpp.quant import cuda
cuda.kernels()
print(f'compiled {len(cuda._NAMES)} kernels in {time.time() - t:.1f} s')
" || { echo "gpu_check: compile FAILED"; return 3; }
    echo
    echo "== tests"
    timeout 150 python -m pytest tests/test_quant_cuda.py -q -rs -p no:cacheprovider || rc=4
    echo
    echo "== ZeRO-Offload and the NVMe tier on CUDA (host step; losses against offload cpu)"
    timeout 150 python -m pytest tests/test_zero_offload.py tests/test_zero_nvme.py -m gpu -q -rs -p no:cacheprovider || rc=6
    echo
    echo "== bench"
    timeout 60 python perf/quant_bench_cuda.py --sizes 64 256 ${bench_json:+--json "$bench_json"} || rc=5
    echo
    echo "gpu_check: exit $rc"
    return $rc
}

run_all 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
