"""How fast a quantized train step could be: its dots timed bare.

For each model of benchmarks/train_step.py (mlp, lm, pax), the optimized
HLO of the jitted float step and of the aqtr int8 step is read, and every
`dot` that XLA kept is collected with its operand shapes, dtypes,
dimension numbers and output type (a dead one, such as the first layer's
input gradient, is gone). Each distinct dot is then timed alone
(a jitted `lax.dot_general` on operands of those shapes, interleaved
rounds, minimum), and the step itself is timed the same way.

The table splits each step into `dots ms` (the sum of its bare dots) and
`rest ms` (step minus dots: quantization, normalization, softmax, the
optimizer, and what the dots cost more inside the step than alone), and
gives two ceilings on `x float` (float step time / int8 step time):

  if free  float step / (float step - float dots + int8 step's dots):
           the int8 step if everything that is not a dot cost what the
           float step's non-dot work costs (quantization free)
  dots     float step's dots / int8 step's dots: the speedup of the
           dots alone

The int8 step's dots include the float ones it keeps (attention's
activation x activation einsums). Times are process CPU time (all
threads; steadier than wall time on a shared host) and wall time.

Run: python benchmarks/train_step_dots.py [--models mlp lm pax]
  [--rounds 10] [--details]
(`--details`: every distinct dot of each step, its count and time.)
"""

from __future__ import annotations

import argparse
import time

import hlo_census
import host
import jax
import jax.numpy as jnp
import optax
import train_step as ts
from jax import lax

import aqtr

MODELS = ('mlp', 'lm', 'pax')


def _dot_fn(key):
  (sa, da), (sb, db), dn, dt = key
  a, b = jnp.ones(sa, da), jnp.ones(sb, db)
  f = jax.jit(lambda a, b: lax.dot_general(a, b, dn, preferred_element_type=dt))
  return f, (a, b)


def _time(cases: dict, rounds: int) -> dict:
  """{name: (wall s, cpu s)}, min over interleaved rounds."""
  for f, args in cases.values():
    jax.block_until_ready(f(*args))
  best = {k: [float('inf')] * 2 for k in cases}
  for _ in range(rounds):
    for k, (f, args) in cases.items():
      t, u = time.perf_counter(), time.process_time()
      jax.block_until_ready(f(*args))
      best[k][0] = min(best[k][0], time.perf_counter() - t)
      best[k][1] = min(best[k][1], time.process_time() - u)
  return best


def steps(model: str) -> dict:
  """{'float': (step, args), 'aqtr int8': (step, args)} of `model`."""
  tx = optax.adam(1e-3)
  if model == 'pax':
    cases = ts._pax_steps()
    ids = jnp.zeros((ts.LM['batch'], ts.LM['seq']), jnp.int32)
    data = (ids, ids)
    named = {
      'float': cases['float (pax LM)'],
      'aqtr int8': cases['aqtr int8 (pax LM)'],
    }
  else:
    init, loss, make = {
      'mlp': (ts.mlp_init, ts.mlp_loss, ts.mlp_data),
      'lm': (ts.lm_init, ts.lm_loss, ts.lm_data),
    }[model]
    params, data = init(jax.random.key(0)), make(jax.random.key(1))
    cfg = aqtr.presets.int8()
    dot = {
      'float': lax.dot_general,
      'aqtr int8': lambda a, b, dn: aqtr.dot_general(a, b, dn, cfg),
    }
    named = {
      k: (lambda p, x, y, d=d: loss(d, p, x, y), params) for k, d in dot.items()
    }
  out = {}
  for k, (loss_fn, params) in named.items():
    step = jax.jit(ts._step(loss_fn, tx))
    out[k] = (step, (params, tx.init(params), *data))
  return out


def bench(model: str, rounds: int, details: bool) -> dict:
  st = steps(model)
  found = {
    k: hlo_census.dots(f.lower(*args).compile().as_text())
    for k, (f, args) in st.items()
  }
  keys = sorted({d for c in found.values() for d in c}, key=str)
  cases = {('step', k): v for k, v in st.items()}
  cases |= {('dot', d): _dot_fn(d) for d in keys}
  t = _time(cases, rounds)
  row = {'model': model}
  for k, counts in found.items():
    for j, unit in ((0, 'wall'), (1, 'cpu')):
      dots = sum(n * t[('dot', d)][j] for d, n in counts.items())
      row[k, unit] = (t[('step', k)][j], dots)
    row[k, 'count'] = sum(counts.values())
    if details:
      for d, n in sorted(counts.items(), key=str):
        (sa, da), (sb, db), dn, dt = d
        print(
          f'  {model} {k}: {n} x {da}{list(sa)} . {db}{list(sb)} '
          f'{dn} -> {dt}: {t[("dot", d)][1] * 1e6:.0f} us cpu'
        )
  return row


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--models', nargs='+', default=list(MODELS), choices=MODELS)
  p.add_argument('--rounds', type=int, default=10)
  p.add_argument('--details', action='store_true')
  a = p.parse_args(argv)
  if a.rounds < 1:
    p.error(f'--rounds must be >= 1, got {a.rounds}')
  host.header('train_step_dots.py')
  print(f'load average at start: {host.load_average()}')
  print(
    '| model | time | impl | dots | step ms | dots ms | rest ms '
    '| x float | if free | dots |'
  )
  print('|---|---|---|---:|---:|---:|---:|---:|---:|---:|')
  for m in a.models:
    r = bench(m, a.rounds, a.details)
    for unit in ('cpu', 'wall'):
      fs, fd = r['float', unit]
      qs, qd = r['aqtr int8', unit]
      free = fs / (fs - fd + qd)
      for k, (s, d) in (('float', (fs, fd)), ('aqtr int8', (qs, qd))):
        last = (
          f'{fs / qs:.2f} | {free:.2f} | {fd / qd:.2f}'
          if k != 'float'
          else '1.00 | | '
        )
        print(
          f'| {m} | {unit} | {k} | {r[k, "count"]} | {s * 1e3:.2f} '
          f'| {d * 1e3:.2f} | {(s - d) * 1e3:.2f} | {last} |',
          flush=True,
        )
  print(f'load average at end: {host.load_average()}')


if __name__ == '__main__':
  main()
