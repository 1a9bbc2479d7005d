#!/usr/bin/env bash
# Builds the libFuzzer harness of the native ingest (native/fuzz/fuzz_ingest.cpp) with ASan and UBSan:
# `scripts/build-fuzz.sh [OUT_DIR]` (default build/fuzz) -> OUT_DIR/fuzz_ingest. Needs clang with
# libFuzzer (Debian: apt-get install clang; scripts/install-tools.sh installs it). Coverage counts
# only the code under test (ingest and pool), not the harness or the invariant check.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/fuzz}
CXX=${CXX:-clang++}
mkdir -p "$out"
flags=(-std=c++17 -g -O1 -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=all
       -Inative/include -Wall -Wextra -Wno-unused-parameter)
"$CXX" "${flags[@]}" -fsanitize=fuzzer-no-link -c native/src/ingest.cpp -o "$out/ingest.o"
"$CXX" "${flags[@]}" -fsanitize=fuzzer-no-link -c native/src/pool.cpp -o "$out/pool.o"
"$CXX" "${flags[@]}" -c native/src/ingest_check.cpp -o "$out/ingest_check.o"
"$CXX" "${flags[@]}" -c native/fuzz/fuzz_ingest.cpp -o "$out/fuzz_ingest.o"
"$CXX" "${flags[@]}" -fsanitize=fuzzer "$out/ingest.o" "$out/pool.o" "$out/ingest_check.o" "$out/fuzz_ingest.o" \
  -o "$out/fuzz_ingest" -lpthread -lrt
echo "$out/fuzz_ingest"
