#!/usr/bin/env bash
# Runs a small subset of calls of every kernel (decode, prefill, merge, KV-cache write/gather) under compute-sanitizer memcheck and racecheck; fails unless
# both report 0 errors. Needs an sm_90 GPU and the built package on PYTHONPATH, built with
# MLA_ATTN_RACECHECK=1 (setup.py): racecheck orders a named-barrier hand-off between warpgroups
# correctly only if each ran its 128-thread barriers equally often before it
# (scripts/racecheck_probe.cu), and only such a build has the narrow kernel even the counts for that
# (extra barriers the production build leaves out). Racecheck on any other build is refused.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CS=${COMPUTE_SANITIZER:-compute-sanitizer}
TOOLS=${SANITIZE_TOOLS:-memcheck racecheck}  # e.g. SANITIZE_TOOLS=memcheck on a production build
if [[ " $TOOLS " == *" racecheck "* ]] &&
   ! python3 -c 'import sys; from mla_attn import _build_config as c; sys.exit(0 if getattr(c, "RACECHECK", False) else 1)'; then
  echo "error: racecheck needs a build with MLA_ATTN_RACECHECK=1 (mla_attn._build_config.RACECHECK is not True):" >&2
  echo "       rebuild with MLA_ATTN_RACECHECK=1 python setup.py build_ext --inplace, or run SANITIZE_TOOLS=memcheck $0" >&2
  exit 2
fi
for tool in $TOOLS; do
  echo "== compute-sanitizer --tool $tool"
  "$CS" --tool "$tool" --error-exitcode 1 --target-processes all python3 scripts/sanitize_cases.py
done
echo "sanitizer: 0 errors ($TOOLS)"
