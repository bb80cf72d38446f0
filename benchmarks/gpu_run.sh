#!/usr/bin/env bash
# benchmarks/gpu.py on a GPU machine that cannot reach a package registry.
#
# On a machine with a registry (once; the folder is git-ignored):
#   bash benchmarks/gpu_run.sh wheels
# downloads the packages a bare JAX+CUDA machine lacks (fiddle and its
# dependencies for aqtr, gin-config, aqtp and qwix for the peer rows) as
# Python 3.12 manylinux wheels into .whl/.
#
# On the GPU machine, from the repository root, with .whl/ carried along:
#   bash benchmarks/gpu_run.sh [gpu.py flags...]
# installs those wheels into /tmp/site (pip with no index and no
# dependencies; unpacked with zipfile if pip fails), puts
# /tmp/site and the checkout on PYTHONPATH, prints nvidia-smi and JAX's
# devices, and runs benchmarks/gpu.py with a run budget (GPU_BUDGET
# seconds, 420 unless set) and its tables, census and HLO written to
# $OUT (/tmp/gpu_out unless set), the log included.
set -u
cd "$(dirname "$0")/.."

PY="$(command -v python3 || command -v python)"
if [ "${1:-}" = wheels ]; then
  exec "$PY" -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 -d .whl \
    fiddle libcst graphviz gin-config aqtp qwix
fi

OUT="${OUT:-/tmp/gpu_out}"
SITE="${SITE:-/tmp/site}"
mkdir -p "$OUT"
if compgen -G '.whl/*.whl' > /dev/null; then
  if ! "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" \
    .whl/*.whl > "$OUT/pip.txt" 2>&1; then
    tail -3 "$OUT/pip.txt"
    echo "pip failed: unpacking the wheels into $SITE instead"
    for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$SITE"; done
  fi
else
  echo 'no .whl/*.whl here: peer rows may be skipped, aqtr needs fiddle'
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi 2>&1 | head -20 || true
  date -u
  "$PY" -c 'import jax, sys; print(sys.version.split()[0], "jax",
    jax.__version__, jax.devices())'
  "$PY" -c 'import aqtr, aqt, qwix; print("imports ok:", aqtr.__file__)'
  echo "git: $(git log -1 --format='%h %s' 2>/dev/null || echo '?')"
  echo "XLA_FLAGS=${XLA_FLAGS:-}"
} 2>&1 | tee "$OUT/env.txt"
"$PY" benchmarks/gpu.py --out "$OUT" --budget "${GPU_BUDGET:-420}" "$@" \
  2>&1 | tee "$OUT/log.txt"
