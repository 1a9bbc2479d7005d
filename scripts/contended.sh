#!/usr/bin/env bash
# Runs a command beside busy loops, as on a user's busy machine: `scripts/contended.sh [-n N] CMD...`.
# N busy-loop processes (default 2, one per core of the 2-core reference machine) spin for the whole
# command and are stopped by their ids after it. Exits with the command's status.
set -u
n=2
if [ "${1:-}" = "-n" ]; then n=$2; shift 2; fi
[ $# -gt 0 ] || { echo "usage: contended.sh [-n N] CMD..." >&2; exit 2; }
pids=()
stop() { [ ${#pids[@]} -eq 0 ] || { kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; }; }
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "$n"); do
  sh -c 'while :; do :; done' &
  pids+=($!)
done
echo "contended: $n busy loop(s) running beside: $*" >&2
"$@"
