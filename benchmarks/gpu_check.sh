#!/usr/bin/env bash
# The CUDA checks, on a machine with a GPU: every test marked `cuda` (device facts through NVML, profiling with
# out-of-memory probing, fp16/bf16 autocast inside DeepSpeed's engine) and the example on accelerator="cuda".
# Prints a summary and writes it to benchmarks/results/gpu_check.txt. Exit status: 0 when everything passed.
#
#   bash benchmarks/gpu_check.sh
# GPU_CHECK_LOG_DIR=<folder> also keeps each part's whole log there (gpu.txt, tests.txt, example.txt).
# GPU_CHECK_CPU_STALL=1 also runs, on this host's CPUs, benchmarks/collective_latency.py and data_stall.py (3 fits,
# width 128, batch 512, pinned; about 2 min): one exchange's wake-up delay and the data-stall speedup on that host's
# cores. On the H100 host of 2026-11-27 (16 virtual cores) a pinned core took 5.5 ms to wake, against 2.9 ms on the
# 2-core development machine (docs/run-report.md, "On the GPU machine's CPUs"). Figures only: they do not change the
# exit status.
set -u
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
summary=benchmarks/results/gpu_check.txt
log=$(mktemp -d)

python -c "import torch; assert torch.cuda.is_available(), 'no CUDA GPU visible to torch'; \
print('GPU:', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0), 'torch', torch.__version__)" \
  > "$log/gpu.txt" 2>&1
gpu_status=$?

python -m pytest -m cuda -v -rs tests/test_cuda.py tests/comm/test_quantize.py tests/watch/test_trace.py > "$log/tests.txt" 2>&1
tests_status=$?

python examples/train_spirals.py --accelerator cuda --devices 1 --epochs 2 --no-baseline --device-precision auto \
  --root "$log/example" > "$log/example.txt" 2>&1
example_status=$?

if [ "${GPU_CHECK_CPU_STALL:-0}" = 1 ]; then
  # CPU ranks only: torch sees no GPU, and DeepSpeed takes its CPU accelerator (gloo) as on the development machine
  { export CUDA_VISIBLE_DEVICES= DS_ACCELERATOR=cpu
    python benchmarks/collective_latency.py --out benchmarks/results/collective_latency.json
    python benchmarks/data_stall.py --runs 3 --hidden 128 --global-batch 512 --pin \
      --out benchmarks/results/data_stall.json; } > "$log/cpu_stall.txt" 2>&1
fi

{
  echo "lightning_hetero GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  cat "$log/gpu.txt"
  echo
  echo "== tests marked cuda (exit $tests_status)"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$log/tests.txt" | tail -20
  echo
  echo "== example on accelerator=cuda, device_precision=auto (exit $example_status)"
  grep -E "^HeteroStrategy plan|^rank|^0 |epoch|validation|run report" "$log/example.txt" | tail -12
  if [ -f "$log/cpu_stall.txt" ]; then
    echo
    echo "== on this host's CPUs: one exchange, and the data-stall speedup (GPU_CHECK_CPU_STALL=1; figures only)"
    grep -E "all-reduce|speedup from|Error|error" "$log/cpu_stall.txt" | tail -12
  fi
  if [ $tests_status -ne 0 ] || [ $example_status -ne 0 ] || [ $gpu_status -ne 0 ]; then
    echo
    echo "== failures: last lines of each failing part"
    [ $gpu_status -ne 0 ] && cat "$log/gpu.txt"
    [ $tests_status -ne 0 ] && tail -60 "$log/tests.txt"
    [ $example_status -ne 0 ] && tail -40 "$log/example.txt"
  fi
  echo
  if [ $gpu_status -eq 0 ] && [ $tests_status -eq 0 ] && [ $example_status -eq 0 ]; then echo "RESULT: all CUDA checks passed"; else echo "RESULT: FAILED"; fi
} | tee "$summary"

[ -n "${GPU_CHECK_LOG_DIR:-}" ] && mkdir -p "$GPU_CHECK_LOG_DIR" && cp "$log"/*.txt "$GPU_CHECK_LOG_DIR"/
[ $gpu_status -eq 0 ] && [ $tests_status -eq 0 ] && [ $example_status -eq 0 ]
