"""Speed of quantized dot_general vs lax.dot_general f32 (and AQT, Qwix).

One process, interleaved rounds (every implementation is timed once per
round, in turn), medians over rounds; ratios are to `lax.dot_general` f32
and to the `int8 limit` of the same shape and mode, measured in the same
run. Modes: `fwd` (forward only) and `fwd+vjp` (`jax.vjp` of the forward,
then the VJP with a random cotangent: output and both gradients).

`int8 limit` is what any int8 implementation must at least pay: the bare
int8 x int8 -> int32 dots of the mode (1 for fwd, 3 for fwd+vjp) on
operands already quantized and laid out for XLA:CPU's fast kernel (the lhs
contracts its last axis), with no quantization, scaling or transposition.
`cpu x limit` is the same ratio in process CPU time (all threads), steadier
than wall time on a shared machine. `residual x` is the bytes `jax.vjp`'s
closure keeps, over lax f32's. AQT (`aqtp`) and Qwix (`qwix`) rows appear
when those packages are installed (`pip install -e '.[bench]'`).

`--graph` prints, instead of times, the graph each implementation gives
XLA for one dot (per shape and mode): `jaxpr eqns` (recursively, as
benchmarks/compile_time.py counts them), `hlo ops` (instructions of the
optimized HLO module, fusions' bodies included), `kernels` (the fusions
XLA:CPU compiles or hands to a library, as compile_time.py counts them),
`int8 dots` and
`compile ms` (process CPU time of lower + compile, minimum of 3 fresh
compiles after `jax.clear_caches()`).

Run: python benchmarks/dot_general.py [--rounds 7] [--shapes 256x1024x1024]
  [--impls 'lax f32' 'aqtr int8'] [--modes fwd+vjp] [--graph [--json]]
(`--json` prints one JSON row per line, for benchmarks/before_after.py.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import host
import jax
import jax.numpy as jnp
from jax import lax

import aqtr

DN = (((1,), (0,)), ((), ()))  # x[M, K] . w[K, N], the Dense layout.


LIMIT = 'int8 limit'
KEY = jax.random.key(7)


def _aqtr(name: str) -> Callable:
  if name == 'int8 sr':
    cfg = aqtr.presets.fully_quantized(8, 8, stochastic_rounding=True)
    return lambda x, w: aqtr.dot_general(x, w, DN, cfg, key=KEY)
  cfg = getattr(aqtr.presets, name)()
  return lambda x, w: aqtr.dot_general(x, w, DN, cfg)


def _int8(a: jax.Array) -> jax.Array:
  return jnp.clip(jnp.round(a * 32), -127, 127).astype(jnp.int8)


def int8_limit(mode: str, x, w, ct) -> tuple[Callable, tuple]:
  """The bare int8 dots of `mode` on pre-quantized, fast-layout operands.

  fwd: x[M, K] . w[K, N]; dlhs: g[M, N] . w[K, N] (contracting N);
  drhs: x^T[K, M] . g[M, N]. Every lhs contracts its last axis.
  """
  xq, wq, gq, xtq = _int8(x), _int8(w), _int8(ct), _int8(x.T)

  def dot(a, b, rhs_contract):
    dn = (((1,), (rhs_contract,)), ((), ()))
    return lax.dot_general(a, b, dn, preferred_element_type=jnp.int32)

  if mode == 'fwd':
    return jax.jit(lambda xq, wq: dot(xq, wq, 0)), (xq, wq)

  def three(xq, wq, gq, xtq):
    return dot(xq, wq, 0), dot(gq, wq, 1), dot(xtq, gq, 0)

  return jax.jit(three), (xq, wq, gq, xtq)


def _aqt(name: str) -> Callable | None:
  try:
    from aqt.jax.v2 import config as aqt_config
  except ImportError:
    return None
  if name == 'int8':
    dg = aqt_config.fully_quantized(
      fwd_bits=8, bwd_bits=8, use_stochastic_rounding=False
    )
  elif name == 'int8_fwd':
    dg = aqt_config.fully_quantized(fwd_bits=8, bwd_bits=None)
  elif name == 'fp8':
    dg = aqt_config.config_fwd_fp8()
  else:
    return None
  return lambda x, w: dg(x, w, DN)


def _qwix(name: str) -> Callable | None:
  try:
    from qwix._src.core import dot_general_qt
  except ImportError:
    return None
  kinds = {
    'int8': dict(
      lhs_qtype='int8',
      rhs_qtype='int8',
      dlhs_grad_qtype='int8',
      drhs_grad_qtype='int8',
    ),
    'int8_fwd': dict(
      lhs_qtype='int8', rhs_qtype='int8', use_original_residuals=True
    ),
    'fp8': dict(
      lhs_qtype=jnp.float8_e4m3fn,
      rhs_qtype=jnp.float8_e4m3fn,
      dlhs_grad_qtype=jnp.float8_e5m2,
      drhs_grad_qtype=jnp.float8_e5m2,
    ),
  }
  if name not in kinds:
    return None
  cfg = dot_general_qt.DotGeneralQtConfig(**kinds[name])
  return lambda x, w: dot_general_qt.dot_general_qt(x, w, DN, cfg)


def implementations(only=None) -> dict[str, Callable]:
  """The default rows, and any other `aqtr <preset>` named in `only`."""
  impls = {'lax f32': lambda x, w: lax.dot_general(x, w, DN)}
  for name in ('int8_fwd', 'int8', 'int8 sr', 'fp8'):
    impls[f'aqtr {name}'] = _aqtr(name)
    for lib, make in (('aqt', _aqt), ('qwix', _qwix)):
      f = make(name)
      if f is not None:
        impls[f'{lib} {name}'] = f
  for name in only or ():
    preset = name.removeprefix('aqtr ')
    if name not in impls and name.startswith('aqtr '):
      if not hasattr(aqtr.presets, preset):
        raise ValueError(f'--impls: no preset aqtr.presets.{preset}.')
      impls[name] = _aqtr(preset)
  return impls


def residual_bytes(f: Callable, x, w) -> int:
  """Bytes of the arrays `jax.vjp(f, x, w)` keeps for the backward pass."""
  _, vjp = jax.vjp(f, x, w)
  return sum(
    leaf.nbytes
    for leaf in jax.tree_util.tree_leaves(vjp)
    if isinstance(leaf, jax.Array)
  )


def _compile(f: Callable, mode: str, args):
  if mode == 'fwd':
    g = jax.jit(f)
  else:

    def g(x, w, ct):
      out, vjp = jax.vjp(f, x, w)
      return (out, *vjp(ct))

    g = jax.jit(g)
  t = time.perf_counter()
  jax.block_until_ready(g(*args))
  return g, time.perf_counter() - t


def graph(shape, modes=('fwd', 'fwd+vjp'), only=None) -> list[dict]:
  """Rows: the graph size and compile CPU time of one dot."""
  from compile_time import (
    count_eqns,
    count_hlo,
    count_int8_dots,
    count_kernels,
  )

  m, k, n = shape
  x, w, ct = jnp.ones((m, k)), jnp.ones((k, n)), jnp.ones((m, n))
  rows = []
  for mode in modes:
    args = (x, w) if mode == 'fwd' else (x, w, ct)
    for name, f in implementations(only).items():
      if only is not None and name not in only and name != 'lax f32':
        continue
      g = f
      if mode != 'fwd':

        def g(x, w, ct, f=f):
          out, vjp = jax.vjp(f, x, w)
          return (out, *vjp(ct))

      jaxpr = jax.make_jaxpr(g)(*args).jaxpr
      best = float('inf')
      for _ in range(3):
        jax.clear_caches()
        c = time.process_time()
        compiled = jax.jit(g).lower(*args).compile()
        best = min(best, time.process_time() - c)
      rows.append(
        dict(
          shape='x'.join(map(str, shape)),
          mode=mode,
          impl=name,
          eqns=count_eqns(jaxpr),
          hlo=count_hlo(compiled),
          kernels=count_kernels(compiled),
          int8_dots=count_int8_dots(jaxpr),
          compile_ms=best * 1e3,
        )
      )
  return rows


def bench(shape, rounds: int, modes=('fwd', 'fwd+vjp'), only=None) -> list:
  m, k, n = shape
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32)
  ct = jax.random.normal(kg, (m, n), jnp.float32)
  impls = {
    name: f
    for name, f in implementations(only).items()
    if only is None or name in only or name == 'lax f32'
  }
  rows = []
  for mode in modes:
    args = (x, w) if mode == 'fwd' else (x, w, ct)
    fns, compile_s = {}, {}
    for name, f in impls.items():
      try:
        fns[name], compile_s[name] = _compile(f, mode, args)
      except Exception as e:  # A competitor lacking a mode is reported.
        print(f'  {name} {mode}: failed ({type(e).__name__}: {e})'[:160])
    fns[LIMIT] = int8_limit(mode, x, w, ct)
    t = time.perf_counter()
    jax.block_until_ready(fns[LIMIT][0](*fns[LIMIT][1]))
    compile_s[LIMIT] = time.perf_counter() - t
    wall = {name: [] for name in fns}
    cpu = {name: [] for name in fns}
    for _ in range(rounds):
      for name, g in fns.items():
        g, a = g if name == LIMIT else (g, args)
        t, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(g(*a))
        wall[name].append(time.perf_counter() - t)
        cpu[name].append(time.process_time() - c)
    med = {name: statistics.median(v) for name, v in wall.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}
    res = {}
    if mode == 'fwd+vjp':
      res = {name: residual_bytes(impls[name], x, w) for name in impls}
    for name in fns:
      rows.append(
        dict(
          shape='x'.join(map(str, shape)),
          mode=mode,
          impl=name,
          ms=med[name] * 1e3,
          ratio=med[name] / med['lax f32'],
          limit=med[name] / med[LIMIT],
          cpu_limit=med_cpu[name] / med_cpu[LIMIT],
          compile_ratio=compile_s[name] / compile_s['lax f32'],
          residual=(
            res[name] / res['lax f32'] if name in res else float('nan')
          ),
        )
      )
  return rows


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--rounds', type=int, default=7)
  p.add_argument(
    '--shapes',
    nargs='*',
    default=['256x1024x1024', '1024x1024x1024', '2048x2048x2048'],
  )
  p.add_argument('--modes', nargs='*', default=['fwd', 'fwd+vjp'])
  p.add_argument(
    '--impls',
    nargs='*',
    default=None,
    help="names to run (default: all; 'aqtr <preset>' adds any preset)",
  )
  p.add_argument('--graph', action='store_true', help='graph sizes, not times')
  p.add_argument(
    '--json', action='store_true', help='JSON rows (for before_after.py)'
  )
  a = p.parse_args(argv)
  if a.graph:
    if not a.json:
      print(f'jax {jax.__version__}, host CPU: {host.cpu_model()}')
      print(
        '| M x K x N | mode | impl | jaxpr eqns | hlo ops | kernels | '
        'int8 dots | compile ms |'
      )
      print('|---|---|---|---:|---:|---:|---:|---:|')
    for s in a.shapes:
      shape = tuple(int(v) for v in s.split('x'))
      for r in graph(shape, a.modes, a.impls):
        print(
          json.dumps(r)
          if a.json
          else f'| {r["shape"]} | {r["mode"]} | {r["impl"]} | {r["eqns"]} | '
          f'{r["hlo"]} | {r["kernels"]} | {r["int8_dots"]} | '
          f'{r["compile_ms"]:.0f} |',
          flush=True,
        )
    return
  if a.json:
    for s in a.shapes:
      shape = tuple(int(v) for v in s.split('x'))
      for r in bench(shape, a.rounds, a.modes, a.impls):
        print(json.dumps(r), flush=True)
    return
  print(
    f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
    f'rounds={a.rounds}; medians; ratios from one run'
  )
  cols = ('ms', 'x f32', 'x limit', 'cpu x limit', 'compile x', 'residual x')
  print(
    f'| {"M x K x N":<15}| {"mode":<8}| {"impl":<13}| '
    + ' | '.join(cols)
    + ' |'
  )
  print('|' + '---|' * (3 + len(cols)))
  for s in a.shapes:
    shape = tuple(int(v) for v in s.split('x'))
    for r in bench(shape, a.rounds, a.modes, a.impls):
      print(
        f'| {r["shape"]:<15}| {r["mode"]:<8}| {r["impl"]:<13}| '
        f'{r["ms"]:.2f} | {r["ratio"]:.2f} | {r["limit"]:.2f} | '
        f'{r["cpu_limit"]:.2f} | {r["compile_ratio"]:.2f} | '
        f'{r["residual"]:.2f} |',
        flush=True,
      )


if __name__ == '__main__':
  main()
