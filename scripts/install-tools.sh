#!/usr/bin/env bash
# Installs the external tools some tests use (tshark decodes our pcaps, tcpreplay replays them into
# the ingest, promtool from the prometheus package lints a scrape of /metrics, clang with its
# sanitizer runtime and libFuzzer builds the ingest's fuzz harness). Needs root and apt; elsewhere it says so and those tests skip
# with that reason.
set -uo pipefail
missing=()
for t in tshark tcpreplay; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)  # Debian ships promtool in prometheus
command -v clang++ >/dev/null 2>&1 || missing+=(clang)
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -ne 0 ]; then
  if can_apt; then
    apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || echo "install-tools: apt-get could not install ${missing[*]}; their tests will skip" >&2
  else
    echo "install-tools: ${missing[*]} missing and cannot be installed here (needs root and apt); their tests will skip" >&2
  fi
fi
# clang's compiler runtime (the sanitizers and libFuzzer: libclang_rt.asan-*.a, libclang_rt.fuzzer-*.a)
# is only a Recommends of Debian's clang (libclang-common-N-dev -> libclang-rt-N-dev), so the install
# above leaves it out and the fuzz tests skip. Install the one of the clang that is there.
if command -v clang++ >/dev/null 2>&1; then
  asan="libclang_rt.asan-$(uname -m).a"
  if [ "$(clang++ -print-file-name="$asan")" = "$asan" ]; then
    rt="libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev"
    if can_apt; then
      { apt-get install -y -qq --no-install-recommends "$rt" >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "$rt" >/dev/null; }; } \
        || echo "install-tools: apt-get could not install $rt (clang's sanitizer runtime); the fuzz tests will skip" >&2
    else
      echo "install-tools: clang's sanitizer runtime ($rt) is missing and cannot be installed here; the fuzz tests will skip" >&2
    fi
  fi
fi
exit 0
