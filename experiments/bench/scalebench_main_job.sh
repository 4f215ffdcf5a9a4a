#!/usr/bin/env bash
# Acceptance timing of the main job: `scalebench --vms 4000 --alpha 1.0 --block 32k`
# (the README's main command on its defaults) must finish within 10 minutes wall.
# Prints the run's summary and the wall time; exits 1 if it took longer or failed.
# Usage: experiments/bench/scalebench_main_job.sh [extra scalebench flags]
set -euo pipefail
cd "$(dirname "$0")/../.."
out="runs/bench-main-job-$(date -u +%Y%m%dT%H%M%S)"
start=$(date +%s)
status=0
scalebench --vms 4000 --alpha 1.0 --block 32k --out "$out" "$@" || status=$?
wall=$(( $(date +%s) - start ))
echo "wall time: ${wall} s (limit 600 s); exit status ${status}; result ${out}/result.json"
[ "$status" -eq 0 ] && [ "$wall" -le 600 ]
