"""Speed of quantized ragged_dot (MoE experts) vs lax.ragged_dot f32 (+Qwix).

One process, interleaved rounds, minimum over rounds; ratios are to
`lax.ragged_dot` f32 of the same shape and mode. Modes: `fwd` and
`fwd+vjp` (output and both gradients for a random cotangent). Tokens are
split over the experts unevenly (one expert gets none). The Qwix column
(`qwix._src.core.ragged_dot_qt`, int8 forward and gradients) appears when
Qwix is installed and runs.

Run: python benchmarks/ragged_dot.py [--rounds 7] [--shapes 2048x512x1024x8]
(M tokens x K x N x G experts); `--json` prints one JSON row per line
(for `benchmarks/before_after.py`). `--graph` measures, instead of wall
times, each program's size (jaxpr equations, optimized HLO instructions)
and the minimum process CPU time of one call (steadier than wall time on
a shared machine).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

import aqtr


def group_sizes(m: int, g: int) -> jax.Array:
  """Uneven sizes summing to m, the second expert empty."""
  w = jnp.arange(1, g + 1, dtype=jnp.float32).at[1].set(0.0)
  sizes = jnp.floor(w / w.sum() * m).astype(jnp.int32)
  return sizes.at[0].add(m - sizes.sum())


def _qwix() -> Callable | None:
  try:
    from qwix._src.core import ragged_dot_qt as rq
  except ImportError:
    return None
  cfg = rq.RaggedDotQtConfig(
    lhs_qtype=jnp.int8,
    rhs_qtype=jnp.int8,
    dlhs_grad_qtype=jnp.int8,
    drhs_grad_qtype=jnp.int8,
  )
  return lambda x, w, gs: rq.ragged_dot_qt(x, w, gs, cfg)


def implementations() -> dict[str, Callable]:
  impls = {
    'lax f32': lambda x, w, gs: lax.ragged_dot(x, w, gs),
    'aqtr int8_fwd': lambda x, w, gs: aqtr.ragged_dot(
      x, w, gs, aqtr.presets.int8_fwd()
    ),
    'aqtr int8': lambda x, w, gs: aqtr.ragged_dot(
      x, w, gs, aqtr.presets.int8()
    ),
    'aqtr fp8': lambda x, w, gs: aqtr.ragged_dot(x, w, gs, aqtr.presets.fp8()),
  }
  qwix = _qwix()
  if qwix is not None:
    impls['qwix int8'] = qwix
  return impls


def _compile(f: Callable, mode: str, gs, args):
  if mode == 'fwd':
    g = jax.jit(lambda x, w: f(x, w, gs))
  else:

    def g(x, w, ct):
      out, vjp = jax.vjp(lambda a, b: f(a, b, gs), x, w)
      return (out, *vjp(ct))

    g = jax.jit(g)
  t = time.perf_counter()
  jax.block_until_ready(g(*args))
  return g, time.perf_counter() - t


def bench(shape, rounds: int) -> list[dict]:
  m, k, n, e = shape
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (e, k, n), jnp.float32)
  ct = jax.random.normal(kg, (m, n), jnp.float32)
  gs = group_sizes(m, e)
  rows = []
  for mode in ('fwd', 'fwd+vjp'):
    args = (x, w) if mode == 'fwd' else (x, w, ct)
    fns, compile_s = {}, {}
    for name, f in implementations().items():
      try:
        fns[name], compile_s[name] = _compile(f, mode, gs, args)
      except Exception as err:  # A competitor lacking a mode is reported.
        print(f'  {name} {mode}: failed ({type(err).__name__}: {err})'[:160])
    best = dict.fromkeys(fns, float('inf'))
    for _ in range(rounds):
      for name, g in fns.items():
        t = time.perf_counter()
        jax.block_until_ready(g(*args))
        best[name] = min(best[name], time.perf_counter() - t)
    base, cbase = best['lax f32'], compile_s['lax f32']
    for name in fns:
      rows.append(
        dict(
          shape='x'.join(map(str, shape)),
          mode=mode,
          impl=name,
          ms=best[name] * 1e3,
          ratio=best[name] / base,
          compile_ratio=compile_s[name] / cbase,
        )
      )
  return rows


def graph(shape, rounds: int) -> list[dict]:
  """Rows: program sizes and the min CPU ms of one call, per impl/mode."""
  from compile_time import count_eqns, count_hlo

  m, k, n, e = shape
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (e, k, n), jnp.float32)
  ct = jax.random.normal(kg, (m, n), jnp.float32)
  gs = group_sizes(m, e)
  rows = []
  for mode in ('fwd', 'fwd+vjp'):
    args = (x, w) if mode == 'fwd' else (x, w, ct)
    for name, f in implementations().items():
      g, _ = _compile(f, mode, gs, args)
      if mode == 'fwd':
        jaxpr = jax.make_jaxpr(lambda x, w, f=f: f(x, w, gs))(*args).jaxpr
      else:
        jaxpr = jax.make_jaxpr(g)(*args).jaxpr
      best = float('inf')
      for _ in range(rounds):
        t = time.process_time()
        jax.block_until_ready(g(*args))
        best = min(best, time.process_time() - t)
      rows.append(
        dict(
          shape='x'.join(map(str, shape)),
          mode=mode,
          impl=name,
          eqns=count_eqns(jaxpr),
          hlo=count_hlo(g.lower(*args).compile()),
          cpu_ms=best * 1e3,
        )
      )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=7)
  p.add_argument('--shapes', nargs='*', default=['2048x512x1024x8'])
  p.add_argument('--json', action='store_true', help='JSON rows, no table')
  p.add_argument('--graph', action='store_true', help='sizes and CPU ms')
  a = p.parse_args(argv)
  run = graph if a.graph else bench
  if a.json or a.graph:
    for s in a.shapes:
      for r in run(tuple(int(v) for v in s.split('x')), a.rounds):
        print(json.dumps(r) if a.json else r, flush=True)
    return
  print(
    f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
    f'rounds={a.rounds}; ratio = min time / lax f32 min time'
  )
  print(
    f'| {"M x K x N x G":<17}| {"mode":<8}| {"impl":<14}| {"ms":>8} '
    f'| {"x f32":>6} | {"compile x":>9} |'
  )
  print('|' + '---|' * 6)
  for s in a.shapes:
    shape = tuple(int(v) for v in s.split('x'))
    for r in bench(shape, a.rounds):
      print(
        f'| {r["shape"]:<17}| {r["mode"]:<8}| {r["impl"]:<14}| '
        f'{r["ms"]:>8.2f} | {r["ratio"]:>6.2f} | '
        f'{r["compile_ratio"]:>9.2f} |',
        flush=True,
      )


if __name__ == '__main__':
  main()
