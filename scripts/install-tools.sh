#!/usr/bin/env bash
# Installs the external tools some tests use (tshark decodes our pcaps, tcpreplay replays them into
# the ingest, promtool from the prometheus package lints a scrape of /metrics, clang with libFuzzer
# builds the ingest's fuzz harness). Needs root and apt; elsewhere it says so and those tests skip
# with that reason.
set -uo pipefail
missing=()
for t in tshark tcpreplay; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)  # Debian ships promtool in prometheus
# Debian's clang brings libclang-rt-*-dev, which holds libFuzzer.
command -v clang++ >/dev/null 2>&1 || missing+=(clang)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-tools: ${missing[*]} missing and cannot be installed here (needs root and apt); their tests will skip" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || echo "install-tools: apt-get could not install ${missing[*]}; their tests will skip" >&2
exit 0
