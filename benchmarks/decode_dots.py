"""Where a batch-1 int8 decode step spends its time on XLA:CPU (issue 34).

Two measurements, in one process:

1. The step's weight dots alone, as one jitted chain of the model's
   shapes (`benchmarks/decode.py`'s model: d_model 512, 4 layers, MLP
   2048, vocab 256: 25 dots, q k v o 512x512, 512x2048, 2048x512, logits
   512x256), each dot's output feeding the next input, in several forms
   of a one-row dot: float32 (the float model's, Eigen's matrix-vector
   kernel), int8 with 1, 2 (the engine's zero row), 4 or 8 rows (XNNPACK's
   YNN int8 kernel from 2 rows on), int8 with the weight stored [N, K],
   int8 with the weight as the left operand, int8 split over N into two
   independent dots (XLA:CPU may run independent thunks at once), float32
   activations times the int8 weight converted in the graph
   (dequantize-in-fusion), and bf16. Minimum over `--rounds` of the mean of
   10 calls: wall ms, process CPU ms, and CPU / wall (about 1: one core
   busy, about 2: both).
2. The decode loop's compiled program at batch 1 (256 slots), float
   weights + float cache against int8 weights + int8 cache: the loop body's
   top-level instructions by kind (each fusion, dot, one-trip loop `call`
   and `copy` is one thunk the runtime dispatches per step), and what one
   small thunk costs (a chain of tiny reductions on a [1, 512] row).

Run: python benchmarks/decode_dots.py [--rounds 9] (the host is shared:
compare the ratios of one run; the load average is printed)
[--json] (one JSON row per line, for benchmarks/before_after.py: the dot
chains' ms and the loop body's thunks per step by kind)
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import time

import host
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

D, LAYERS, VOCAB = 512, 4, 256


def _shapes() -> list[tuple[int, int]]:
  layer = [(D, D)] * 4 + [(D, 4 * D), (4 * D, D)]
  return layer * LAYERS + [(D, VOCAB)]


def _dot(x, w, contract_w: int, pref):
  return lax.dot_general(
    x, w, (((1,), (contract_w,)), ((), ())), preferred_element_type=pref
  )


def _rows(x, rows: int):
  """x [1, K] with rows - 1 zero rows under it, pinned as XLA would keep
  the engine's operands."""
  if rows == 1:
    return x
  return jnp.concatenate([x, jnp.zeros((rows - 1, x.shape[1]), x.dtype)])


def _int8(rows: int, layout: str = 'kn'):
  """A one-row int8 x int8 -> int32 dot of `rows` rows."""

  def f(x, w):
    x2, w = lax.optimization_barrier((_rows(x, rows), w))
    if layout == 'kn':
      return _dot(x2, w, 0, jnp.int32)[:1]
    if layout == 'nk':
      return _dot(x2, w, 1, jnp.int32)[:1]
    # 'lhs': the weight [N, K] as the left operand, out [N, rows].
    return _dot(w, x2, 1, jnp.int32)[:, :1].T

  return f


def _split(x, w):
  """Two independent int8 dots over halves of N."""
  n = w.shape[1] // 2
  x2, a, b = lax.optimization_barrier((_rows(x, 2), w[:, :n], w[:, n:]))
  a, b = _dot(x2, a, 0, jnp.int32), _dot(x2, b, 0, jnp.int32)
  return jnp.concatenate([a, b], axis=1)[:1]


def _dequantized(x, w):
  return _dot(x, w.astype(jnp.float32), 0, jnp.float32)


def _bf16(x, w):
  return _dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), 0, jnp.float32)


def _float(x, w):
  return _dot(x, w, 0, jnp.float32)


# label: (dot, activation dtype, weight dtype, weight layout).
VARIANTS = {
  'f32, 1 row (float model)': (_float, jnp.float32, jnp.float32, 'kn'),
  'int8, 1 row': (_int8(1), jnp.int8, jnp.int8, 'kn'),
  'int8, 2 rows (engine)': (_int8(2), jnp.int8, jnp.int8, 'kn'),
  'int8, 4 rows': (_int8(4), jnp.int8, jnp.int8, 'kn'),
  'int8, 8 rows': (_int8(8), jnp.int8, jnp.int8, 'kn'),
  'int8, 2 rows, w [N,K]': (_int8(2, 'nk'), jnp.int8, jnp.int8, 'nk'),
  'int8, 2 rows, w as lhs': (_int8(2, 'lhs'), jnp.int8, jnp.int8, 'nk'),
  'int8, 2 rows, split over N': (_split, jnp.int8, jnp.int8, 'kn'),
  'f32 x int8 w converted': (_dequantized, jnp.float32, jnp.int8, 'kn'),
  'bf16 x int8 w converted': (_bf16, jnp.float32, jnp.int8, 'kn'),
}


def dot_chains(rounds: int) -> dict[str, tuple[float, float]]:
  """(wall s, CPU s) per chain call of each variant, min over rounds."""
  rng = np.random.default_rng(0)
  base = [rng.integers(-127, 128, s).astype(np.int8) for s in _shapes()]
  calls = {}
  for label, (dot, xdt, wdt, layout) in VARIANTS.items():
    ws = [jnp.asarray(w.T.copy() if layout == 'nk' else w, wdt) for w in base]
    k_axis = 1 if layout == 'nk' else 0

    def chain(x, ws, dot=dot, xdt=xdt, k_axis=k_axis):
      for w in ws:
        k = w.shape[k_axis]
        if x.shape[1] != k:  # Feeds the output back (any K).
          x = jnp.tile(x, (1, k // x.shape[1] + 1))[:, :k]
        y = dot(x, w)
        x = (y & 127).astype(xdt) if xdt == jnp.int8 else y * 1e-3
      return x

    x = jnp.ones((1, D), xdt)
    calls[label] = (jax.jit(chain).lower(x, ws).compile(), x, ws)
  best = {k: (float('inf'), float('inf')) for k in calls}
  for _ in range(rounds):
    for label, (f, x, ws) in calls.items():
      jax.block_until_ready(f(x, ws))
      t, c = time.perf_counter(), time.process_time()
      for _ in range(10):
        out = f(x, ws)
      jax.block_until_ready(out)
      wall = (time.perf_counter() - t) / 10
      cpu = (time.process_time() - c) / 10
      best[label] = (min(best[label][0], wall), min(best[label][1], cpu))
  return best


def _body_kinds(hlo: str) -> collections.Counter:
  """Top-level instruction kinds of the largest computation (the loop
  body), one per thunk: ynn / fusion / dot / call / copy / other."""
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if m:
      cur = m.group(1)
      comps[cur] = []
    elif cur and line.startswith('  ') and ' = ' in line:
      comps[cur].append(line)
  body = max(comps.values(), key=len)
  kinds = collections.Counter()
  for line in body:
    m = re.search(r'\s([a-z][a-z\-]*)\((?:%|\))', line)
    kind = m.group(1) if m else '?'
    if kind in ('get-tuple-element', 'tuple', 'bitcast', 'parameter', '?'):
      continue  # No work at run time.
    if '__ynn_fusion' in line:
      kind = 'ynn dot'
    kinds[kind] += 1
  return kinds


def row_options(p: argparse.ArgumentParser) -> None:
  """Adds `--rows` (label prefixes) and `--json` to a decode benchmark."""
  p.add_argument(
    '--rows',
    nargs='+',
    default=None,
    help='only the rows whose label starts with one of these (the float '
    'row is always run: the x float column needs it)',
  )
  p.add_argument(
    '--json',
    action='store_true',
    help='one JSON row per cell (for benchmarks/before_after.py)',
  )


def chosen_rows(rows: list, wanted: list[str] | None) -> list:
  """The `rows` ((label, ...) tuples, the float row first) `--rows` asks
  for, the float row always."""
  return [
    r
    for r in rows
    if wanted is None
    or r[0] == rows[0][0]
    or any(r[0].startswith(x) for x in wanted)
  ]


def json_row(row: dict, out, base, cpu: float, cpu0: float, steps: int):
  """Prints one decode cell as a JSON row (`--json`): `out` and the float
  cell `base` (generate results), `cpu` and `cpu0` their CPU seconds."""
  ms = {
    'ms/step': 1e3 * out.decode_s / steps,
    'cpu ms/step': 1e3 * cpu / steps,
    'x float': base.decode_s / out.decode_s,
    'cpu x float': cpu0 / cpu,
  }
  print(json.dumps(row | ms), flush=True)


def compile_cell(dec, variables, prompts, steps: int, switch) -> int:
  """Traces and compiles the decoder `dec`'s loop anew with `switch` (a
  context manager, e.g. `unittest.mock.patch.object(...)`) active, and
  returns its body's thunks per step."""
  jax.clear_caches()  # Trace anew (jit caches traces by function).
  with switch:  # Traced and compiled here, with this form.
    dec.generate(variables, prompts, steps + 1)
  ((_, loop),) = dec._compiled.values()
  return sum(_body_kinds(loop.as_text()).values())


def time_cells(cells, rounds: int, steps: int, same) -> tuple[dict, dict]:
  """Minimum wall and process CPU decode seconds of each cell over
  interleaved rounds.

  Args:
    cells: (key, decoder, variables, prompts) tuples.
    rounds: the rounds.
    steps: decode steps per call (`steps + 1` tokens generated).
    same: key -> the key of the weights whose tokens the cell must give
      (cells of equal `same(key)` must decode the same tokens).

  Returns:
    ({key: wall s}, {key: cpu s}).
  """
  best, cpu, tokens = {}, {}, {}
  for _ in range(rounds):
    for key, dec, variables, prompts in cells:
      out = dec.generate(variables, prompts, steps + 1)
      best[key] = min(best.get(key, float('inf')), out.decode_s)
      cpu[key] = min(cpu.get(key, float('inf')), out.decode_cpu_s)
      assert out.tokens == tokens.setdefault(same(key), out.tokens), key
  return best, cpu


def step_thunks() -> dict[str, collections.Counter]:
  """Loop-body instruction kinds of the decode loop, float vs int8."""
  import decode as bench  # noqa: PLC0415 (benchmarks/decode.py)

  from aqtr.pax import decode  # noqa: PLC0415
  from aqtr.pax.kv_cache import KVCacheConfig  # noqa: PLC0415

  models = bench.models_by_weights(256, D, LAYERS, 8)
  out = {}
  for w, kv in [
    ('float', KVCacheConfig()),
    ('int8', KVCacheConfig(numerics='int8')),
  ]:
    lm, variables = models[w]
    dec = decode.Decoder(lm, length=256, kv=kv)
    dec.generate(variables, [[1, 2, 3]], 3)
    ((_, loop),) = dec._compiled.values()
    out[f'{w} w + {w} kv'] = _body_kinds(loop.as_text())
  return out


def thunk_cost(n: int = 100, rounds: int = 200) -> float:
  """Seconds per small fusion: a chain of `n` absmax rescales of a
  [1, 512] row (XLA:CPU runs each reduction and rescale as its own
  thunks), against a chain of n // 4."""

  def chain(x, n):
    for _ in range(n):
      x = x * (1.0 / (jnp.max(jnp.abs(x)) + 1.0)) + 0.5
    return x

  x = jnp.ones((1, D), jnp.float32)
  res = []
  for m in (n // 4, n):
    f = jax.jit(lambda x, m=m: chain(x, m)).lower(x).compile()
    fusions = len(re.findall(r' fusion\(', f.as_text()))
    best = float('inf')
    for _ in range(rounds):
      t = time.perf_counter()
      jax.block_until_ready(f(x))
      best = min(best, time.perf_counter() - t)
    res.append((best, fusions))
  (t0, f0), (t1, f1) = res
  return (t1 - t0) / (f1 - f0)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=9)
  p.add_argument('--json', action='store_true')
  args = p.parse_args()
  if args.json:
    for label, (wall, cpu) in dot_chains(args.rounds).items():
      row = {'row': label, 'wall ms': 1e3 * wall, 'cpu ms': 1e3 * cpu}
      print(json.dumps(row), flush=True)
    for cell, k in step_thunks().items():
      row = {'row': f'thunks per step, {cell}', 'all': sum(k.values())}
      print(json.dumps(row | dict(k)), flush=True)
    return
  host.header('decode_dots.py')
  best = dot_chains(args.rounds)
  wbytes = {
    label: sum(a * b for a, b in _shapes()) * (4 if wdt == jnp.float32 else 1)
    for label, (_, _, wdt, _) in VARIANTS.items()
  }
  f_wall, f_cpu = best['f32, 1 row (float model)']
  print(f'load average (1, 5, 15 min): {host.load_average()}\n')
  print(
    f'The step weight dots chained ({len(_shapes())} dots), min of '
    f'{args.rounds} rounds:\n'
  )
  print(
    '| dot | wall ms | x f32 | cpu ms | cpu x f32 | cpu / wall '
    '| weight GB/s (wall) |'
  )
  print('|---|---|---|---|---|---|---|')
  for label, (wall, cpu) in best.items():
    print(
      f'| {label} | {1e3 * wall:.3f} | {f_wall / wall:.2f} | '
      f'{1e3 * cpu:.3f} | {f_cpu / cpu:.2f} | {cpu / wall:.2f} | '
      f'{wbytes[label] / wall / 1e9:.1f} |'
    )
  kinds = step_thunks()
  names = ['ynn dot', 'dot', 'fusion', 'call', 'copy']
  print('\nDecode loop body at batch 1, 256 slots (thunks per step):\n')
  print('| cell | ' + ' | '.join(names) + ' | other | all |')
  print('|---|' + '---|' * (len(names) + 2))
  for cell, k in kinds.items():
    other = sum(v for n, v in k.items() if n not in names)
    cols = ' | '.join(str(k.get(n, 0)) for n in names)
    print(f'| {cell} | {cols} | {other} | {sum(k.values())} |')
  cost = thunk_cost()
  print(f'\nOne small fusion thunk (a [1, 512] row): {1e6 * cost:.2f} us')
  print(f'load average (1, 5, 15 min): {host.load_average()}')


if __name__ == '__main__':
  main()
