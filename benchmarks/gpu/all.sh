#!/usr/bin/env bash
# Every GPU check in one go: what `make bench-gpu` runs, without the Makefile's venv (a GPU machine's own
# torch and Triton; a CPU build of torch in .venv would see no GPU). From the repository root:
#
#   benchmarks/gpu/all.sh OUT [OLD_REV]          # on a GPU: about 7 minutes
#   DRY_RUN=1 benchmarks/gpu/all.sh OUT          # every part on the CPU at toy sizes (CI, via make)
#
# PY: the Python to use (default python3). OLD_REV: a git revision whose _triton_kernels.py tiles.py times
# and instructions.py counts beside this one's. Writes under OUT: results.{json,md}, log.txt (run.py),
# where.{json,md}, instructions.{json,md}, tiles.{json,txt}.
set -euo pipefail
out=${1:?usage: benchmarks/gpu/all.sh OUT [OLD_REV]}
old_rev=${2:-}
py=${PY:-python3}
dry=()
interpret=()
if [ -n "${DRY_RUN:-}" ]; then
    dry=(--dry-run)
    interpret=(env TRITON_INTERPRET=1 STREAMWATCH_KERNEL=triton)
fi
mkdir -p "$out"
old=()
if [ -n "$old_rev" ]; then
    git show "$old_rev:streamwatch/_triton_kernels.py" > "$out/old_kernels.py"
    old=(--old "$out/old_kernels.py")
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the fused CPU kernel for this Python (a fresh machine's checkout has none built)
"$py" -c "import streamwatch._fused" 2>/dev/null || "$py" setup.py build_ext --inplace -q > "$out/build.txt" 2>&1
"$py" benchmarks/gpu/run.py --out "$out" "${dry[@]}"
"$py" benchmarks/gpu/where.py --out "$out" "${dry[@]}" > "$out/where.md"
"$py" benchmarks/gpu/instructions.py --json "$out/instructions.json" "${old[@]}" > "$out/instructions.md"
"${interpret[@]}" "$py" benchmarks/gpu/tiles.py --out "$out" --budget 90 "${dry[@]}" "${old[@]}" > "$out/tiles.txt"
