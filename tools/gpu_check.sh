#!/usr/bin/env bash
# One call on a GPU machine: install the wheels it lacks (carried in .whl/), run the GPU tests,
# the kernel micro-benchmarks, the decode-step profile and `qat4 bench`, and leave every log under
# $OUT (default ./out). Compiled kernels are kept between machines: a tarball of the Triton cache in
# parts of at most 15 MiB (default out/triton_cache.tgz.*; a machine returns files of up to 16 MiB)
# is unpacked first and written back to $OUT at the end.
#   usage: tools/gpu_check.sh [tests|kernels|profile|bench|all|batch]...   (default: all; batch only when named)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
CACHE_TGZ=${TRITON_CACHE:-out/triton_cache.tgz}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/qat4_triton_cache}
mkdir -p "$TRITON_CACHE_DIR"
compgen -G "$CACHE_TGZ.*" >/dev/null && cat "$CACHE_TGZ".* | tar xzf - -C "$TRITON_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
git rev-parse --short HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"

steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(all)
want() { for s in "${steps[@]}"; do [ "$s" = "$1" ] || [ "$s" = all ] && return 0; done; return 1; }

if want tests; then
    # the whole suite compiles for some 400 s on a machine without the carried cache: run it alone there
    timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if want kernels; then
    timeout 120 python3 tools/bench_w4.py 2>&1 | tee "$OUT/bench_w4.log" | tail -30
    timeout 90 python3 tools/bench_w4.py --floor 2>&1 | tee "$OUT/bench_w4_floor.log" | tail -12
    timeout 90 python3 tools/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log" | tail -20
    timeout 60 python3 tools/bench_sync.py 2>&1 | tee "$OUT/bench_sync.log"
fi
if [[ " ${steps[*]} " == *" batch "* ]]; then
    # the decode-batch kernel: its GPU tests, then its table beside the GEMV and GEMM at 16 and 64 rows
    timeout 300 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/gpu/test_w4_batch_gpu.py 2>&1 \
        | tee "$OUT/gpu_tests_batch.log" | tail -15
    shapes=2560x1536,5120x1536,2048x1536,4096x1536,1536x2048,1536x4096,12288x1536,24576x1536,1536x6144,1536x12288,256x1536,1536x256,262144x1536
    for rows in 16 64; do
        timeout 240 python3 tools/bench_w4.py --rows $rows --shapes $shapes 2>&1 | tee "$OUT/bench_w4_batch_$rows.log" | tail -18
    done
fi
if want profile; then
    timeout 150 python3 tools/profile_step.py --depth 512 2>&1 | tee "$OUT/profile_step.log" | head -40
    timeout 150 python3 tools/decode_spread.py --draws 3 2>&1 | tee "$OUT/decode_spread.log" | grep draw
    timeout 150 python3 tools/bench_sampling.py 2>&1 | tee "$OUT/bench_sampling.log" | tail -12
fi
if want bench; then
    export QAT4_TILINGS=$OUT/decode_tilings.json   # tuned here, picked up by the runs below
    timeout 200 python3 -m qat4.cli bench --model synthetic:e2b --depths 0 --new 128 --prompt 512 --tune \
        2>&1 | tee "$OUT/bench_tune.log" | tail -8
    timeout 240 python3 -m qat4.cli bench --model synthetic:e2b --depths 0,4096,32768,131072 --new 128 --prompt 4096 \
        --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -20
    timeout 150 python3 -m qat4.cli bench --model synthetic:e2b --depths 131072 --new 64 --prompt 4096 --memory-cap-mib 3732 \
        --json "$OUT/bench_cap.json" 2>&1 | tee "$OUT/bench_cap.log" | tail -8
fi
tar czf - -C "$TRITON_CACHE_DIR" . | split -b 15M - "$OUT/triton_cache.tgz."
