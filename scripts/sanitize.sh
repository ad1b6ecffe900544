#!/usr/bin/env bash
# Runs a small subset of calls of every kernel (decode, prefill, merge, KV-cache write/gather) under compute-sanitizer memcheck and racecheck; fails unless
# both report 0 errors. Needs an sm_90 GPU and the built package on PYTHONPATH. racecheck orders a
# named-barrier hand-off between warpgroups correctly only if each ran its 128-thread barriers
# equally often before it (scripts/racecheck_probe.cu); the narrow kernel evens the counts for that.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
for tool in memcheck racecheck; do
  echo "== compute-sanitizer --tool $tool"
  "$CS" --tool "$tool" --error-exitcode 1 --target-processes all python3 scripts/sanitize_cases.py
done
echo "sanitizer: 0 errors (memcheck, racecheck)"
