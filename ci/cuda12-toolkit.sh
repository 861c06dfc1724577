#!/usr/bin/env bash
# A CUDA 12.4 toolkit root from Debian's trixie non-free packages, for building the cu12 wheel on
# a machine that has no CUDA 12 installed. Nothing is installed into the system: a private apt
# configuration fetches the .debs (`apt-get download`), `dpkg -x` unpacks them into a scratch
# folder, and the pieces a build needs are copied into CACHE_DIR/root, the rest removed.
#
# Usage: ci/cuda12-toolkit.sh [CACHE_DIR]     (default: ${XDG_CACHE_HOME:-~/.cache}/fp8kturbov/cuda-12)
# Prints the toolkit root on stdout (progress on stderr); a root already there is reused.
#
# Debian's layout is not a toolkit root: nvcc and cicc live in usr/lib/nvidia-cuda-toolkit/bin,
# ptxas and the other tools in usr/bin, libdevice apart, and nvcc.profile points at /etc. The root
# made here has bin/ (nvcc and cicc copied, since nvcc finds its profile beside its own resolved
# path, and the tools), its own bin/nvcc.profile, include/, lib64/ (the static and shared runtime,
# the device runtime, the driver stub) and nvvm/libdevice/, which is what CMake and nvcc expect.
# nvcc 12.4 accepts GCC up to 13 as host compiler: where the default is newer, set CUDAHOSTCXX.
set -euo pipefail

cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/fp8kturbov/cuda-12}"
root="$cache/root"
packages=(nvidia-cuda-toolkit nvidia-cuda-dev libcudart12 libnvvm4 libcu++-dev)
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

log() { printf 'cuda12-toolkit: %s\n' "$*" >&2; }

release_of() {  # "12.4" from `nvcc --version`, empty where it does not run
  "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p' | head -n 1
}

if [ -x "$root/bin/nvcc" ] && [ "$(release_of "$root/bin/nvcc" | cut -d. -f1)" = 12 ]; then
  log "reusing $root (nvcc $(release_of "$root/bin/nvcc"))"
  echo "$root"
  exit 0
fi
for tool in apt-get dpkg; do
  command -v "$tool" >/dev/null || { log "needs $tool (a Debian or Ubuntu machine)"; exit 1; }
done
[ -r "$keyring" ] || { log "needs $keyring (apt-get install debian-archive-keyring)"; exit 1; }

mkdir -p "$cache"
cache="$(cd "$cache" && pwd)"
root="$cache/root"
scratch="$(mktemp -d "$cache/scratch.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT

# A private apt: its own source list, lists, cache and an empty package status, so that neither
# the system's sources nor its installed packages take part.
apt_dir="$scratch/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/preferences.d" "$scratch/debs"
echo "deb [signed-by=$keyring] http://deb.debian.org/debian trixie main non-free" >"$apt_dir/sources.list"
apt_options=(
  -o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
  -o Dir::State::status=/dev/null -o Dir::Etc::Preferences=/dev/null
  -o "Dir::Etc::PreferencesParts=$apt_dir/preferences.d"
  -o APT::Architecture=amd64 -o APT::Architectures=amd64 -o APT::Sandbox::User=root
)
log "fetching ${packages[*]} (about 1 GB) from Debian trixie"
apt-get "${apt_options[@]}" -q update >&2
(cd "$scratch/debs" && apt-get "${apt_options[@]}" -q download "${packages[@]}" >&2)

log "unpacking"
unpacked="$scratch/unpacked"
for deb in "$scratch/debs"/*.deb; do
  dpkg -x "$deb" "$unpacked"
  rm "$deb"  # the space back before the next one
done

log "assembling $root"
rm -rf "$root"
mkdir -p "$root/bin" "$root/lib64/stubs" "$root/nvvm"
toolkit_bin="$unpacked/usr/lib/nvidia-cuda-toolkit/bin"
libs="$unpacked/usr/lib/x86_64-linux-gnu"
cp "$toolkit_bin/nvcc" "$toolkit_bin/cicc" "$root/bin/"
cp -r "$toolkit_bin/crt" "$root/bin/"
for tool in ptxas fatbinary nvlink cudafe++ cuobjdump nvdisasm nvprune bin2c cu++filt; do
  cp "$unpacked/usr/bin/$tool" "$root/bin/"
done
cp -r "$unpacked/usr/include" "$root/include"
cp -r "$unpacked/usr/lib/nvidia-cuda-toolkit/libdevice" "$root/nvvm/libdevice"
cp "$libs/libcudart_static.a" "$libs/libcudadevrt.a" "$libs/libculibos.a" "$root/lib64/"
cp "$libs/stubs/libcuda.so" "$root/lib64/stubs/"
cp -P "$libs"/libnvvm.so* "$libs"/libcudart.so* "$root/lib64/"  # CMake's FindCUDAToolkit wants libcudart.so
# The profile of NVIDIA's own toolkit root, everything relative to nvcc's folder (_HERE_).
cat >"$root/bin/nvcc.profile" <<'EOF'
TOP              = $(_HERE_)/..
NVVMIR_LIBRARY_DIR = $(TOP)/nvvm/libdevice
LD_LIBRARY_PATH += $(TOP)/lib64:
PATH            += $(_HERE_):
INCLUDES        +=  "-I$(TOP)/include" $(_SPACE_)
LIBRARIES        =+ $(_SPACE_) "-L$(TOP)/lib64/stubs" "-L$(TOP)/lib64"
CUDAFE_FLAGS    +=
PTXAS_FLAGS     +=
EOF

release="$(release_of "$root/bin/nvcc")"
if [ "${release%%.*}" != 12 ]; then
  log "the assembled nvcc reports release '${release:-none}', not 12.x"
  exit 1
fi
log "nvcc $release at $root ($(du -sh "$root" | cut -f1))"
echo "$root"
