#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Builds the libFuzzer targets of tests/fuzz (ASan + UBSan) into
# tests/fuzz/build/fuzz_<name>. Installs clang-14 and its runtimes with apt
# when missing (as root, or through passwordless sudo) and fails clearly if
# it cannot.
#
#   bash tests/fuzz/build.sh            # every target
#   bash tests/fuzz/build.sh ring slab  # some
#   bash tests/fuzz/build.sh --list     # the target names
#
# Environment: FUZZ_CXX (default clang++-14); FUZZ_JOBS (parallel
# compiles; default: the CPUs); FUZZ_DEBUG (default -gline-tables-only);
# TORCH_DIR (torch's package directory; default: asked of the repo's .venv
# python, else of python3) and TORCH_CXX11_ABI (default 1) when TORCH_DIR
# is given.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)

# The stream core with every channel (the registry knows them all), which
# the stream and frame_ring targets both compile. A new source of the
# stream core or a channel goes here (tests/unit/test_fuzz_sources.py
# checks).
STREAM_SOURCES="csrc/transport/stream/connection.cpp csrc/transport/stream/connection_liveness.cpp csrc/transport/stream/connection_tls.cpp csrc/transport/stream/connection_reader.cpp csrc/transport/stream/connection_headers.cpp csrc/transport/stream/connection_writer.cpp csrc/transport/stream/connection_control.cpp csrc/transport/stream/connection_channels.cpp csrc/transport/stream/connection_plan.cpp csrc/transport/stream/connection_ring.cpp csrc/transport/stream/frame_ring.cpp csrc/transport/stream/loop.cpp csrc/transport/stream/loop_threads.cpp csrc/transport/stream/address.cpp csrc/transport/shm/connection.cpp csrc/channel/registry.cpp csrc/channel/shm/context.cpp csrc/channel/shm/slab_channel.cpp csrc/channel/shm/ring_channel.cpp csrc/channel/shm/ring.cpp csrc/channel/shm/slab.cpp csrc/channel/cuda_ipc/ipc_channel.cpp csrc/channel/cuda_ipc/ipc_take.cpp csrc/channel/cuda_ipc/ipc_release.cpp csrc/channel/cuda_ipc/ipc_receiver.cpp csrc/channel/cuda_ipc/ipc_lease.cpp csrc/channel/cuda_ipc/ipc_context.cpp csrc/channel/cuda_ipc/ipc_grants.cpp csrc/channel/cuda_ipc/ipc_grant_ends.cpp csrc/channel/cuda_ipc/ipc_grant_writes.cpp csrc/channel/cuda/grants.cpp csrc/channel/cuda_self/self_channel.cpp csrc/channel/cuda_staged/staged_channel.cpp csrc/channel/cuda_staged/staged_sender.cpp csrc/channel/cuda_ring/cuda_ring_channel.cpp csrc/channel/cuda_ring/cuda_ring_sender.cpp csrc/channel/cuda/staging_thread.cpp csrc/channel/cuda/staging_pool.cpp csrc/channel/cuda_ipc/block.cpp csrc/channel/cuda/engines.cpp csrc/channel/cuda/copy_engine.cpp csrc/channel/cuda/device.cpp csrc/channel/cuda/device_memory.cpp csrc/channel/cuda/exported_memory.cpp csrc/channel/lanes/context.cpp csrc/channel/lanes/lane.cpp csrc/channel/lanes/lanes_channel.cpp csrc/channel/lanes/lanes_sender.cpp csrc/channel/lanes/lanes_receiver.cpp csrc/channel/lanes/lanes_watch.cpp csrc/common/buffer_pool.cpp csrc/common/libcuda.cpp csrc/common/host.cpp csrc/frame/frame.cpp csrc/transport/handshake.cpp csrc/transport/tls.cpp csrc/transport/tls_peer.cpp csrc/common/crypto.cpp csrc/common/cpace.cpp csrc/common/aes_gcm_vaes.cpp csrc/common/libcrypto.cpp csrc/common/libssl.cpp csrc/common/logging.cpp csrc/common/exit_gate.cpp csrc/common/signal_socket.cpp csrc/common/fd_closer.cpp csrc/common/openmp_pool.cpp csrc/common/process_watch.cpp csrc/common/host_load.cpp csrc/common/resident_pages.cpp csrc/common/source_strikes.cpp"

# One line per target: its name (the harness is tests/fuzz/fuzz_<name>.cpp),
# "torch" if it links libtorch, "cuda" if it needs cuda.h (the channel
# registry knows the CUDA channels; no CUDA library is linked), else "-",
# then the project sources it
# compiles, from the repo root. Adding a target is its harness plus one line
# here; a moved source file is an edit here only.
TARGETS=(
  "frame      -      csrc/frame/frame.cpp"
  "handshake  -      csrc/transport/handshake.cpp csrc/common/crypto.cpp csrc/common/aes_gcm_vaes.cpp csrc/common/libcrypto.cpp"
  "codec      torch  csrc/wire/codec.cpp csrc/wire/inbound.cpp csrc/wire/inbound_tensors.cpp csrc/wire/inbound_buffers.cpp csrc/wire/storage_reach.cpp csrc/common/buffer_pool.cpp"
  "ring       -      csrc/channel/shm/ring.cpp csrc/common/signal_socket.cpp csrc/common/fd_closer.cpp csrc/common/logging.cpp"
  "slab       -      csrc/channel/shm/slab.cpp csrc/common/fd_closer.cpp csrc/common/logging.cpp"
  "stream     cuda   $STREAM_SOURCES"
  "frame_ring cuda   $STREAM_SOURCES"
)

if [ "${1:-}" = "--list" ]; then
  for line in "${TARGETS[@]}"; do
    read -r name _ <<<"$line"
    echo "$name"
  done
  exit 0
fi

CXX=${FUZZ_CXX:-clang++-14}
out="$here/build"
mkdir -p "$out"
# Line tables only: what a sanitizer's stack needs (functions, files, lines,
# inlined frames), and 12% less CPU than -g for a source that includes
# torch's headers. FUZZ_DEBUG=-g gives a debugger's view of a finding.
read -ra debug_flags <<<"${FUZZ_DEBUG--gline-tables-only}"
CXXFLAGS=(-std=c++20 "${debug_flags[@]}" -O1 -fsanitize=fuzzer,address,undefined
  -fno-sanitize-recover=undefined -fno-omit-frame-pointer -I"$root")

die() {
  echo "tests/fuzz/build.sh: $*" >&2
  exit 1
}

# Compiles and links a trivial fuzz target: proves the compiler and the
# fuzzer/ASan/UBSan runtimes are all there.
probe() {
  command -v "$CXX" >/dev/null 2>&1 || return 1
  printf '%s\n' '#include <cstddef>' '#include <cstdint>' \
    'extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }' \
    >"$out/probe.cpp"
  "$CXX" "${CXXFLAGS[@]}" "$out/probe.cpp" -o "$out/probe" >"$out/probe.log" 2>&1
}

if ! probe; then
  echo "tests/fuzz/build.sh: $CXX with libFuzzer not usable; installing clang-14 libclang-rt-14-dev" >&2
  if [ "$(id -u)" = 0 ]; then
    sudo=()
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    sudo=(sudo -n)
  else
    die "need root (or passwordless sudo) to apt-get install clang-14 libclang-rt-14-dev"
  fi
  command -v apt-get >/dev/null 2>&1 || die "no apt-get: install clang-14 with libFuzzer, or set FUZZ_CXX"
  install() {
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q -o Dpkg::Use-Pty=0 clang-14 libclang-rt-14-dev >"$out/apt.log" 2>&1
  }
  if ! install; then
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$out/apt.log" 2>&1 || true
    install || die "apt-get install clang-14 libclang-rt-14-dev failed (see $out/apt.log)"
  fi
  probe || die "$CXX still cannot build a fuzz target (see $out/probe.log)"
fi

torch_flags() {
  if [ -z "${TORCH_DIR:-}" ]; then
    local py=python3
    [ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
    read -r TORCH_DIR TORCH_CXX11_ABI < <("$py" -c \
      'import os, torch; print(os.path.dirname(torch.__file__), int(torch._C._GLIBCXX_USE_CXX11_ABI))') ||
      die "torch not found (set TORCH_DIR, or run tools/setup_env.sh)"
  fi
  [ -d "$TORCH_DIR/include" ] && [ -d "$TORCH_DIR/lib" ] ||
    die "no torch headers/libraries under TORCH_DIR=$TORCH_DIR"
  # Must match the one torch was built with (1 for the pip wheels since 2.7).
  TORCH_CXXFLAGS=(-isystem "$TORCH_DIR/include"
    -isystem "$TORCH_DIR/include/torch/csrc/api/include"
    -D_GLIBCXX_USE_CXX11_ABI="${TORCH_CXX11_ABI:-1}")
  TORCH_LDFLAGS=(-L"$TORCH_DIR/lib" -Wl,-rpath,"$TORCH_DIR/lib" -ltorch_cpu -lc10)
}

# Every source is compiled once into an object (build/obj/<flags>/), shared
# by the targets that list it, and the targets' objects are made in
# parallel by make, from a makefile written here: a target's binary links
# its harness's and its sources' objects. An object is remade when its
# source, a header it includes (the compiler's dependency file), its flags
# (build/flags-<set>, rewritten only when they change) or the torch it was
# compiled against changed. Two sets of flags: "torch" (torch's headers,
# for targets that link libtorch) and "plain" (cuda.h's directory too,
# which no source needs a library for).
# `makeable DIR`: fails naming DIR if the makefile could not carry it.
makeable() {
  case "$1" in *[[:space:]\$\#]*) die "make cannot build with a space, \$ or # in a path: $1" ;; esac
}
makeable "$root"
command -v make >/dev/null 2>&1 || die "make not found (Debian: apt-get install make)"

# `write_if_changed FILE LINE...`: FILE holds the lines, and its time
# changes only when they do.
write_if_changed() {
  local file=$1 tmp
  shift
  tmp=$(mktemp "$file.XXXXXX")
  printf '%s\n' "$@" >"$tmp"
  if cmp -s "$tmp" "$file"; then rm -f "$tmp"; else mv "$tmp" "$file"; fi
}

py=python3
[ -x "$root/.venv/bin/python" ] && py="$root/.venv/bin/python"
wanted=("$@")
mk="$out/fuzz.mk"
goals=()
no_cuda_h=()
declare -A flag_sets=() objects_made=()
rules=()
for line in "${TARGETS[@]}"; do
  read -r name kind sources <<<"$line"
  if [ "${#wanted[@]}" -gt 0 ] && [[ " ${wanted[*]} " != *" $name "* ]]; then
    continue
  fi
  harness="$here/fuzz_$name.cpp"
  [ -f "$harness" ] || die "no harness $harness for target $name"
  srcs=("$harness")
  for s in $sources; do
    [ -f "$root/$s" ] || die "target $name: no source $s (moved? edit TARGETS in $0)"
    srcs+=("$root/$s")
  done
  if [ "$kind" = torch ]; then
    set_name=torch
    if [ -z "${flag_sets[torch]:-}" ]; then
      torch_flags
      makeable "$TORCH_DIR"
      flag_sets[torch]="${CXXFLAGS[*]} ${TORCH_CXXFLAGS[*]}"
      torch_libs="${TORCH_LDFLAGS[*]}"
      write_if_changed "$out/flags-torch" "$CXX ${flag_sets[torch]}" "$TORCH_DIR/version.py"
      torch_dep="$TORCH_DIR/version.py"
    fi
    libs=$torch_libs
    dep=$torch_dep
  else
    set_name=plain
    if [ -z "${flag_sets[plain]:-}" ]; then
      # cuda.h's directory where it is found (headers.py says how to get
      # it otherwise); only "cuda" targets need it.
      inc=$("$py" "$root/torch_rpc_ext/_cuda/headers.py" 2>/dev/null) || true
      if [ -n "$inc" ] && [ -f "$inc/cuda.h" ]; then
        makeable "$inc"
        flag_sets[plain]="${CXXFLAGS[*]} -isystem $inc"
        cuda_dep="$inc/cuda.h"
      else
        flag_sets[plain]="${CXXFLAGS[*]}"
        cuda_dep=""
      fi
      write_if_changed "$out/flags-plain" "$CXX ${flag_sets[plain]}"
    fi
    if [ "$kind" = cuda ] && [ -z "$cuda_dep" ]; then
      no_cuda_h+=("$name")  # the others are built, then this fails
      continue
    fi
    libs=""
    dep=$cuda_dep
  fi
  # The sources a target lists from one folder compile as one unity unit
  # (a generated file that #includes them, named by its list: targets that
  # list the same ones share it), as setup.py's trees of another torch do:
  # parsing the headers once per folder, not once per source, took the
  # build from 223 s of CPU to about 140 (session 109). FUZZ_UNITY=0
  # compiles each alone.
  if [ "${FUZZ_UNITY:-1}" != 0 ]; then
    units=("${srcs[0]}")
    unset by_dir
    declare -A by_dir=()
    dirs=()
    for src in "${srcs[@]:1}"; do
      d=$(dirname "$src")
      [ -n "${by_dir[$d]+set}" ] || dirs+=("$d")
      by_dir[$d]+="$src "
    done
    for d in "${dirs[@]}"; do
      read -ra members <<<"${by_dir[$d]}"
      if [ "${#members[@]}" -eq 1 ]; then
        units+=("${members[0]}")
        continue
      fi
      mapfile -t members < <(printf '%s\n' "${members[@]}" | sort)
      key=$(printf '%s\n' "${members[@]}" | sha1sum | cut -c1-10)
      rel_dir=${d#"$root"/}
      unit="$out/unity/$set_name/${rel_dir//\//_}-$key.cpp"
      mkdir -p "$(dirname "$unit")"
      lines=("// Generated by tests/fuzz/build.sh: a unity unit.")
      for m in "${members[@]}"; do lines+=("#include \"$m\""); done
      write_if_changed "$unit" "${lines[@]}"
      units+=("$unit")
    done
    srcs=("${units[@]}")
  fi
  objs=()
  for src in "${srcs[@]}"; do
    rel=${src#"$root"/}
    obj="$out/obj/$set_name/${rel%.cpp}.o"
    objs+=("$obj")
    [ -n "${objects_made[$obj]:-}" ] && continue
    objects_made[$obj]=1
    rules+=("$obj: $src $out/flags-$set_name $dep"
      "	@mkdir -p \$(@D) && echo \"compiling $rel\""
      "	@$CXX ${flag_sets[$set_name]} -MMD -MP -c $src -o \$@"
      "-include ${obj%.o}.d")
  done
  bin="$out/fuzz_$name"
  goals+=("$bin")
  # Relinked when its objects or its link line (objects, flags, libraries)
  # changed.
  link="$CXX ${CXXFLAGS[*]} ${objs[*]} -o $bin.tmp $libs -lpthread"
  write_if_changed "$out/link-$name" "$link"
  rules+=("$bin: ${objs[*]} $out/link-$name"
    "	@$link && mv \$@.tmp \$@"
    "	@echo \"built fuzz_$name\"")
done
[ "${#goals[@]}" -gt 0 ] || [ "${#no_cuda_h[@]}" -gt 0 ] ||
  die "no target matches: ${wanted[*]} (see --list)"
printf '%s\n' "# Written by tests/fuzz/build.sh: edit that, not this." \
  ".DELETE_ON_ERROR:" "${rules[@]}" >"$mk"
start=$(date +%s)
if [ "${#goals[@]}" -gt 0 ]; then
  make -s -f "$mk" -j"${FUZZ_JOBS:-$(nproc)}" "${goals[@]}" || die "building failed (above)"
fi
echo "fuzz build: ${#goals[@]} target(s) current, $(($(date +%s) - start)) s"
[ "${#no_cuda_h[@]}" -eq 0 ] ||
  die "${no_cuda_h[*]} not built: no cuda.h ($("$py" "$root/torch_rpc_ext/_cuda/headers.py" 2>&1))"
