#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (used on a lent GPU machine; see README "Speed and memory").
#
#   bash benchmarks/gpu_checks.sh            # writes its logs under ${OUT:-/tmp/podmonitor-gpu}
#
# 1. the CUDA tests (the engine on a CUDA device against the CPU result, rtol 1e-7);
# 2. the engine's update at L = 1024, N = 150 (one layer) on the GPU;
# 3. one monitored validation run at GPT-2-small attention shape on the GPU (bench_validation_run.py);
# 4. bench_engine.py with the engine on the GPU against the naive numpy reference on 2 CPU threads.
set -uo pipefail
out=${OUT:-/tmp/podmonitor-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
echo "== CUDA tests"
timeout 240 $py -m pytest -q -p no:cacheprovider -k cuda tests/engine/test_accumulator.py tests/engine/test_sketch.py 2>&1 | tee "$out/cuda_tests.txt"
echo "== update at L = 1024, N = 150 on cuda"
timeout 120 $py - <<'PY' 2>&1 | tee "$out/update_cuda.txt"
import time, torch
from podmonitor import PODAccumulator, PODConfig
from podmonitor.synthetic import layered_ensemble
for dtype in (torch.float64, torch.float32):
    batches = [layered_ensemble(1, 50, 1024, seed=lo)[0].to(dtype).cuda() for lo in (0, 50, 100)]
    acc = PODAccumulator(PODConfig())
    acc.update(batches[0][:2]); torch.cuda.synchronize(); acc.reset()
    t0 = time.perf_counter()
    for b in batches:
        acc.update(b)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    report = acc.compute()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    print(f"input {str(dtype):14} update {t1 - t0:.3f} s  compute {t2 - t1:.3f} s  scales {report.dominant_scales}")
PY
echo "== validation run at GPT-2-small attention shape on cuda"
timeout 420 $py benchmarks/bench_validation_run.py --device cuda --threads 16 2>&1 | tee "$out/validation_run_cuda.txt"
echo "== the engine on cuda against the naive numpy reference (2 CPU threads) at the paper's size"
timeout 400 $py benchmarks/bench_engine.py --device cuda --skip-large --threads 2 2>&1 | tee "$out/bench_engine_cuda.txt"
