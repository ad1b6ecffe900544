#!/usr/bin/env bash
# Runs a small subset of calls of every kernel (decode, prefill, merge, KV-cache write/gather) under compute-sanitizer memcheck and racecheck; fails unless
# both report 0 errors. Needs an sm_90 GPU and the built package on PYTHONPATH. Known: racecheck reports
# hazards in the FP8 narrow kernel's end-of-request merge that are ordered by named barriers; the same
# false positive in 40 lines: scripts/racecheck_probe.cu (BENCHMARKS.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  "$CS" --tool "$tool" --error-exitcode 1 --target-processes all python3 scripts/sanitize_cases.py
done
echo "sanitizer: 0 errors (memcheck, racecheck)"
