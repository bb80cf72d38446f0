"""Library functions called eagerly (outside `jit`): first call, later calls.

What a notebook user or a conversion script pays for `aqtr.quantize`,
`aqtr.fake_quant`, `QTensor.dequant` and a codec round trip called
without `jit`: the first call's wall time (tracing, lowering, compiling;
`jax.clear_caches()` before it, so programs other rows compiled do not
count), the XLA compiles it made, and the median of later calls with the
same shapes. `aqtr.core.eager` runs each of them as one program;
compare with the op-by-op calls of an older tree:

  python benchmarks/before_after.py --rev 4892d32 -- \\
    benchmarks/eager_calls.py --rounds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import host
import jax
import jax.numpy as jnp

import aqtr
from aqtr.core import codecs
from aqtr.numerics import Nf4

SHAPES = [(256, 512), (2048, 2048)]
COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'
_COMPILES = [0]


def _count(event, duration, **kw):
  del duration, kw
  if event == COMPILE_EVENT:
    _COMPILES[0] += 1


def _calls(x):
  """{row name: a zero-argument eager call on `x`}."""
  int8 = aqtr.TensorConfig()
  nf4 = aqtr.TensorConfig(numerics=Nf4())
  qt = aqtr.quantize(x, int8)
  codes = Nf4().quantize(x / jnp.abs(x).max(), None)
  parts = {'qvalue': codes, 'scale': jnp.ones((x.shape[0], 1))}
  stored = codecs.encode_parts(parts, Nf4())
  return {
    'quantize int8': lambda: aqtr.quantize(x, int8).qvalue,
    'fake_quant int8': lambda: aqtr.fake_quant(x, int8),
    'fake_quant nf4': lambda: aqtr.fake_quant(x, nf4),
    'QTensor.dequant': lambda: qt.dequant(),
    'encode_parts nf4': lambda: codecs.encode_parts(parts, Nf4())['table4'],
    'decode_parts nf4': lambda: codecs.decode_parts(stored, Nf4())['qvalue'],
  }


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=20)
  p.add_argument('--json', action='store_true', help='one JSON row a line')
  args = p.parse_args()
  jax.monitoring.register_event_duration_secs_listener(_count)
  if not args.json:
    host.header('eager_calls.py')
    print(f'load: {host.load_average()}')
    print('| call | shape | first call ms | compiles | later calls ms |')
    print('|---|---|---:|---:|---:|')
  for shape in SHAPES:
    x = jax.random.normal(jax.random.key(0), shape)
    for name, call in _calls(x).items():
      jax.clear_caches()
      _COMPILES[0] = 0
      t0 = time.perf_counter()
      jax.block_until_ready(call())
      first = time.perf_counter() - t0
      compiles = _COMPILES[0]
      later = []
      for _ in range(args.rounds):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        later.append(time.perf_counter() - t0)
      row = {
        'call': name,
        'shape': 'x'.join(map(str, shape)),
        'first_ms': round(first * 1e3, 2),
        'compiles': compiles,
        'later_ms': round(statistics.median(later) * 1e3, 3),
      }
      if args.json:
        print(json.dumps(row), flush=True)
      else:
        print(
          f'| {name} | {row["shape"]} | {row["first_ms"]:.1f} | '
          f'{compiles} | {row["later_ms"]:.3f} |',
          flush=True,
        )


if __name__ == '__main__':
  main()
