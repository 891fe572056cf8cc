#!/usr/bin/env bash
# A folder of wheels that installs p2p-cocodc on a machine with no network (README, "Offline region").
# Run on a networked Linux or macOS machine with python3 and pip (23.2 tested); the wheels are for the
# target's Python and platform, whatever this machine's are. Torch stays out unless --with-torch: a
# GPU machine keeps the CUDA torch it has.
#
#   scripts/wheelhouse.sh [--python 3.12] [--platform manylinux_2_28_x86_64] [--out wheelhouse]
#                         [--with-torch [--torch SPEC]]
#
#   --python      the target's Python, MAJOR.MINOR (3.11, 3.12 or 3.13; default 3.12)
#   --platform    the newest manylinux tag the target's glibc allows (default manylinux_2_28_x86_64,
#                 glibc 2.28: RHEL 8, Ubuntu 20.04 and later; manylinux2014_x86_64 is glibc 2.17,
#                 manylinux_2_35_x86_64 Ubuntu 22.04). pip matches each tag exactly, so every older
#                 manylinux tag of the same architecture is passed too.
#   --out         the folder (default wheelhouse; added to, not emptied)
#   --with-torch  torch and its CUDA libraries too (several GB); --torch picks one, e.g. 'torch==2.11.0'
#
# The folder holds the project's own wheel, every dependency (hivemind 1.1.12's py3 manylinux2014 wheel
# and py-multihash's blake3, mmh3 and typing_extensions among them) and wheels built here from the
# pure-Python packages that publish only a source archive (prefetch_generator, varint,
# python-baseconv). Install:
#   pip install --no-index --find-links wheelhouse p2p-cocodc
set -euo pipefail
PYVER=3.12
PLATFORM=manylinux_2_28_x86_64
OUT=wheelhouse
WITH_TORCH=0
TORCH_SPEC=torch
usage() { sed -n '7,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit "${1:-2}"; }
while (($#)); do
    case $1 in
        --python) PYVER=${2:?}; shift 2 ;;
        --platform) PLATFORM=${2:?}; shift 2 ;;
        --out) OUT=${2:?}; shift 2 ;;
        --with-torch) WITH_TORCH=1; shift ;;
        --torch) TORCH_SPEC=${2:?}; WITH_TORCH=1; shift 2 ;;
        -h | --help) usage 0 ;;
        *) echo "wheelhouse.sh: unknown argument $1" >&2; usage ;;
    esac
done
[[ $PYVER =~ ^3\.[0-9]+$ ]] || { echo "wheelhouse.sh: --python takes MAJOR.MINOR, e.g. 3.12" >&2; exit 2; }

# the target's platform tags: manylinux_2_N_ARCH for N from the target's glibc down to 17, then the
# legacy names (manylinux2014 = 2_17, manylinux2010 = 2_12, manylinux1 = 2_5)
case $PLATFORM in
    manylinux_2_*) rest=${PLATFORM#manylinux_2_}; glibc=${rest%%_*}; arch=${rest#*_} ;;
    manylinux2014_*) glibc=17; arch=${PLATFORM#manylinux2014_} ;;
    manylinux2010_*) glibc=12; arch=${PLATFORM#manylinux2010_} ;;
    manylinux1_*) glibc=5; arch=${PLATFORM#manylinux1_} ;;
    *) echo "wheelhouse.sh: --platform takes a manylinux tag, e.g. manylinux_2_28_x86_64" >&2; exit 2 ;;
esac
[[ $glibc =~ ^[0-9]+$ ]] || { echo "wheelhouse.sh: cannot read the glibc version in $PLATFORM" >&2; exit 2; }
platforms=()
for ((n = glibc; n >= 17; n--)); do platforms+=(--platform "manylinux_2_${n}_$arch"); done
((glibc >= 17)) && platforms+=(--platform "manylinux2014_$arch")
if [[ $arch == x86_64 || $arch == i686 ]]; then
    ((glibc >= 12)) && platforms+=(--platform "manylinux_2_12_$arch" --platform "manylinux2010_$arch")
    platforms+=(--platform "manylinux_2_5_$arch" --platform "manylinux1_$arch")
fi
target=(--only-binary=:all: --implementation cp --python-version "$PYVER" "${platforms[@]}")

PIP=${PIP:-python3 -m pip}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "wheelhouse: cp${PYVER/./} ${PLATFORM}, into $OUT"
# from a copy of what the wheel holds: setuptools' build/ in the tree could bring back deleted modules
mkdir "$tmp/src"
cp "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/LICENSE" "$tmp/src/"
cp -R "$ROOT/p2p_cocodc" "$tmp/src/"
find "$tmp/src" -name __pycache__ -prune -exec rm -rf {} +
$PIP wheel --quiet --no-deps --ignore-requires-python "$tmp/src" -w "$tmp/own"
own=$(ls "$tmp/own"/p2p_cocodc-*.whl)
version=$(basename "$own" | cut -d- -f2)
mv "$own" "$OUT/"

# beyond hivemind's declared list: py-multihash needs blake3 and mmh3, blake3 typing_extensions
reqs=("p2p-cocodc==$version" blake3 mmh3 typing_extensions)
if ((WITH_TORCH)); then
    reqs+=("$TORCH_SPEC")
else
    # a stand-in torch (no files, no dependencies) satisfies p2p-cocodc's and hivemind's torch
    # requirement, so the resolver takes neither torch nor its CUDA libraries; removed afterwards
    stub_version=2.13.0+wheelhouse.stub
    stub=$tmp/torch-$stub_version-py3-none-any.whl
    python3 - "$stub" "$stub_version" <<'EOF'
import sys, zipfile
path, version = sys.argv[1:]
info = f"torch-{version}.dist-info"
with zipfile.ZipFile(path, "w") as z:
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    wheel = "Wheel-Version: 1.0\nGenerator: wheelhouse.sh\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    z.writestr(f"{info}/WHEEL", wheel)
    z.writestr(f"{info}/RECORD", "")
EOF
    reqs+=("torch @ file://$stub")
fi

# pip download takes wheels only (the target is not this machine). Pure-Python packages that publish
# only a source archive are built into wheels here (a py3-none-any wheel runs anywhere): hivemind's
# prefetch_generator and varint, and py-multibase's python-baseconv (a missing one of these shows as a
# conflict between py-multibase versions, not as itself); any other such package once it is named.
$PIP wheel --quiet --no-deps --ignore-requires-python prefetch_generator varint python-baseconv -w "$OUT"
built=(prefetch_generator varint python-baseconv)
ok=0
for _ in 1 2 3 4 5 6 7 8 9 10; do
    if log=$($PIP download "${target[@]}" --find-links "$OUT" -d "$OUT" "${reqs[@]}" 2>&1); then
        ok=1
        break
    fi
    missing=$(sed -n 's/^ERROR: No matching distribution found for \([^;]*\).*/\1/p' <<<"$log" | head -1)
    name=${missing%%[<>=!~ ]*}
    if [[ -z $missing ]] || [[ " ${built[*]} " == *" $name "* ]]; then
        echo "$log" >&2
        echo "wheelhouse.sh: pip download failed for cp${PYVER/./} $PLATFORM (above)" >&2
        exit 1
    fi
    rm -rf "$tmp/build" && mkdir "$tmp/build"
    $PIP wheel --quiet --no-deps --ignore-requires-python "$missing" -w "$tmp/build"
    whl=$(ls "$tmp/build"/*.whl)
    if [[ $whl != *-none-any.whl ]]; then
        echo "wheelhouse.sh: $missing has no wheel for cp${PYVER/./} $PLATFORM, and its source" \
            "builds a platform wheel ($(basename "$whl")): build it on the target's platform" >&2
        exit 1
    fi
    echo "wheelhouse: $missing has no wheel on the index; built $(basename "$whl") from its source"
    mv "$whl" "$OUT/"
    built+=("$name")
done
((ok)) || { echo "$log" >&2; echo "wheelhouse.sh: gave up after building ${built[*]}" >&2; exit 1; }
rm -f "$OUT"/torch-*wheelhouse.stub*.whl

echo "wheelhouse: $(ls "$OUT"/*.whl | wc -l) wheels in $OUT ($(du -sh "$OUT" | cut -f1))"
echo "install on the target: pip install --no-index --find-links $(basename "$OUT") p2p-cocodc"
