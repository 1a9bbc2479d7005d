#!/usr/bin/env bash
# Installs the external tools some tests use (tshark decodes our pcaps, tcpreplay replays them into
# the ingest, promtool from the prometheus package lints a scrape of /metrics, clang with its
# sanitizer runtime and libFuzzer builds the ingest's fuzz harness, Triton's perf_analyzer measures the
# front door). Needs root and apt; elsewhere it says so and those tests skip
# with that reason.
set -uo pipefail
missing=()
for t in tshark tcpreplay; do command -v "$t" >/dev/null 2>&1 || missing+=("$t"); done
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)  # Debian ships promtool in prometheus
command -v clang++ >/dev/null 2>&1 || missing+=(clang)
can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
export DEBIAN_FRONTEND=noninteractive
# apt-get bounded: wait up to 2 min for the dpkg lock (a fresh Debian machine runs unattended-upgrades
# at boot), and give up on an unreachable mirror after 30 s of silence instead of apt's default 120 s.
apt_opts=(-o DPkg::Lock::Timeout=120 -o Acquire::http::Timeout=30 -o Acquire::https::Timeout=30
          -o Acquire::Retries=1)
if [ ${#missing[@]} -ne 0 ]; then
  if can_apt; then
    apt-get "${apt_opts[@]}" update -qq >/dev/null \
      && apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || echo "install-tools: apt-get could not install ${missing[*]}; their tests will skip" >&2
  else
    echo "install-tools: ${missing[*]} missing and cannot be installed here (needs root and apt); their tests will skip" >&2
  fi
fi
# clang's compiler runtime (the sanitizers and libFuzzer: libclang_rt.asan-*.a, libclang_rt.fuzzer-*.a)
# is only a Recommends of Debian's clang (libclang-common-N-dev -> libclang-rt-N-dev), so the install
# above leaves it out and the fuzz tests skip. Install the one of the clang that is there.
# Each way it can fail ends in one line on stderr naming the package and the command to run by hand,
# and the fuzz tests then skip with their reason in pytest's summary (`-ra`).
asan="libclang_rt.asan-$(uname -m).a"
has_asan() { [ "$(clang++ -print-file-name="$asan" 2>/dev/null)" != "$asan" ]; }
if command -v clang++ >/dev/null 2>&1 && ! has_asan; then
  rt="libclang-rt-$(clang++ -dumpversion | cut -d. -f1)-dev"
  by_hand="the fuzz tests will skip (as root: apt-get update && apt-get install $rt)"
  if can_apt; then
    if { apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "$rt" >/dev/null 2>&1 \
         || { apt-get "${apt_opts[@]}" update -qq >/dev/null \
              && apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends "$rt" >/dev/null; }; }; then
      has_asan || echo "install-tools: installed $rt, but clang++ still finds no $asan (is clang++ Debian's?); $by_hand" >&2
    else
      echo "install-tools: apt-get could not install $rt, clang's sanitizer runtime (no network or mirror, or no such package for this clang); $by_hand" >&2
    fi
  else
    echo "install-tools: clang's sanitizer runtime ($rt) is missing and cannot be installed here (needs root and apt-get); $by_hand" >&2
  fi
fi
# Triton's perf_analyzer, into build/tools/: the binary of the tritonclient 2.43 manylinux wheel (newer
# wheels' binaries need a newer glibc than Debian 12's), with the two libraries it links that the wheel
# does not carry: libb64 (Debian's libb64-0d) and CUDA's runtime libcudart.so.12 (NVIDIA's
# nvidia-cuda-runtime-cu12 wheel, into build/tools/lib; it runs without a GPU).
tools="$(cd "$(dirname "$0")/.." && pwd)/build/tools"
py=${PYTHON:-python3}
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ] && [ ! -x "$tools/perf_analyzer" ]; then
  tmp=$(mktemp -d)
  if "$py" -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" tritonclient==2.43.0 \
       nvidia-cuda-runtime-cu12==12.9.79 >/dev/null 2>&1; then
    mkdir -p "$tools/lib"
    "$py" - "$tmp" "$tools" <<'PY' || echo "install-tools: could not unpack perf_analyzer from its wheel; its test will skip" >&2
import os, sys, zipfile
from pathlib import Path
tmp, tools = Path(sys.argv[1]), Path(sys.argv[2])
for whl, member, dest in (("tritonclient-2.43.0-*.whl", "tritonclient-2.43.0.data/data/bin/perf_analyzer",
                           tools / "perf_analyzer"),
                          ("nvidia_cuda_runtime_cu12-*.whl", "nvidia/cuda_runtime/lib/libcudart.so.12",
                           tools / "lib" / "libcudart.so.12")):
    (path,) = tmp.glob(whl)
    part = dest.with_name(dest.name + ".part")
    part.write_bytes(zipfile.ZipFile(path).read(member))
    part.chmod(0o755)
    part.replace(dest)
PY
  else
    echo "install-tools: pip could not download tritonclient 2.43.0 (perf_analyzer); its test will skip" >&2
  fi
  rm -rf "$tmp"
fi
if [ -x "$tools/perf_analyzer" ] && ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  if can_apt; then
    { apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends libb64-0d >/dev/null 2>&1 \
      || { apt-get "${apt_opts[@]}" update -qq >/dev/null \
           && apt-get "${apt_opts[@]}" install -y -qq --no-install-recommends libb64-0d >/dev/null; }; } \
      || echo "install-tools: apt-get could not install libb64-0d (for perf_analyzer); its test will skip" >&2
  else
    echo "install-tools: libb64-0d (for perf_analyzer) is missing and cannot be installed here; its test will skip" >&2
  fi
fi
exit 0
