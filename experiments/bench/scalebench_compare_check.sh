#!/usr/bin/env bash
# Acceptance of `scalebench compare` on real runs: an unchanged rerun passes
# (exit 0) and the same result with throughput cut by 10% (an injected
# slowdown: latencies scaled up to match) is flagged (exit 1).
# Usage: experiments/bench/scalebench_compare_check.sh [scalebench flags, default a 20-VM 20 s run]
set -uo pipefail
cd "$(dirname "$0")/../.."
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(--vms 20 --duration 20 --warmup 5 --addr-base 127.44.0.0)
dir="runs/bench-compare-$(date -u +%Y%m%dT%H%M%S)"
scalebench "${flags[@]}" -q --out "$dir/a" >/dev/null || exit 2
scalebench "${flags[@]}" -q --out "$dir/b" >/dev/null || exit 2
python3 - "$dir/b/result.json" "$dir/slow.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
doc["throughput_rps"] *= 0.9
doc["latency_ms"] = {k: v / 0.9 for k, v in doc["latency_ms"].items()}
json.dump(doc, open(sys.argv[2], "w"))
PY
scalebench compare "$dir/a/result.json" "$dir/b/result.json"; rerun=$?
scalebench compare "$dir/a/result.json" "$dir/slow.json"; slow=$?
echo "unchanged rerun: exit ${rerun} (want 0); injected 10% slowdown: exit ${slow} (want 1)"
[ "$rerun" -eq 0 ] && [ "$slow" -eq 1 ]
