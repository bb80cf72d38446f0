"""Compile time and traced-graph size of a train step: float vs int8 libraries.

For each model and implementation, one jitted train step (the loss and its
gradient; with `--adam` also an Adam update) is built from a fresh Python
function every time, after `jax.clear_caches()` (so no trace, lowering or
compilation is reused, not even of a library's own inner `jax.jit`), and
timed as `jax.jit(step).lower(...).compile()`: `lower s` (trace + lowering
to StableHLO), `compile s` (XLA), `total s`, each the minimum of
`--rounds` interleaved rounds. `x float` is total over the float step's
total of the same model. `cpu s` is the process CPU time (all threads) of
lower + compile, steadier than wall time on a shared machine. Each row
ends with `aqtr / qwix`: aqtr's compile ratio over Qwix's (wall and cpu).

Graph size: `jaxpr eqns` counts the equations of the step's jaxpr,
recursively through every sub-jaxpr (jit calls, custom_jvp / custom_vjp
calls, control flow), which is what tracing and lowering walk; `hlo ops`
counts the instructions of the optimized HLO module (every computation,
fusions included), which is what XLA's code generation walks; `kernels`
counts its fusions (each one kernel XLA:CPU compiles, or a library call it
builds). `int8 dots`
counts the jaxpr's dot_generals with an int8 operand (a check that each
library quantized the contractions it was asked to).

Rows (models of benchmarks/train_step.py; every weight contraction is
quantized, attention's activation x activation einsums stay float):

  mlp  784-1024-1024-1024-10, batch 256: float (`lax.dot_general`), aqtr
       int8 (`aqtr.presets.int8()`), Qwix int8 (`dot_general_qt` with int8
       operands and int8 gradients), AQT int8 (`fully_quantized(8, 8)`).
  lm   the main job's LM sizes (bytes, 2 blocks, d_model 128, 4 heads, MLP
       512, batch 16 x 64), written as functions of a dot: the same four.
  pax  the main job's model itself (`aqtr.train.models.lm`, built from
       `aqtr.pax` layers), float and with int8 injected by
       `aqtr.train.models.inject`; Qwix int8 by `qwix.quantize_model`
       (interception of the same float model, weight ops only).

AQT and Qwix rows appear when those packages are installed
(`pip install -e '.[bench]'`); a library failing on a model is reported
and skipped.

Run: python benchmarks/compile_time.py [--rows mlp lm pax] [--rounds 3]
  [--impls float 'aqtr int8'] [--json]
(`--json`: one JSON row per line, for benchmarks/before_after.py.)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import host
import jax
import jax.numpy as jnp
import optax
import train_step as ts
from jax.extend import core as jex_core

try:
  from aqtr.core.lowering import sub_jaxprs
except ImportError:  # An aqtr tree before 2026-11-28 (`before_after.py`).

  def sub_jaxprs(eqn) -> list:
    return list(jex_core.jaxprs_in_params(eqn.params))


ROWS = ('mlp', 'lm', 'pax')


def count_eqns(jaxpr: jex_core.Jaxpr) -> int:
  """Equations of `jaxpr` and, recursively, of every sub-jaxpr it calls.

  An equation that calls a sub-jaxpr (pjit, custom_jvp_call,
  custom_vjp_call, cond, scan, while) counts once itself plus its body.
  """
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for sub in sub_jaxprs(eqn):  # A platform cond: its CPU branch.
      n += count_eqns(sub)
  return n


def count_int8_dots(jaxpr: jex_core.Jaxpr) -> int:
  """dot_general equations (recursively) with an int8 operand."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      n += any(getattr(v.aval, 'dtype', None) == jnp.int8 for v in eqn.invars)
    for sub in sub_jaxprs(eqn):
      n += count_int8_dots(sub)
  return n


def count_hlo(compiled) -> int:
  """Instructions of the optimized HLO module (all computations)."""
  n = 0
  for line in compiled.as_text().splitlines():
    s = line.strip()
    if s.startswith('ROOT '):
      s = s[5:]
    head, eq, _ = s.partition(' = ')
    if eq and head and ' ' not in head and not s.startswith('//'):
      n += 1
  return n


def count_kernels(compiled) -> int:
  """Fusions of the optimized HLO (each one kernel XLA:CPU compiles with
  LLVM, or a library call it builds): the unit compile time grows with."""
  return compiled.as_text().count(' fusion(')


def _qwix_pax(module):
  """Qwix's interception of the float pax LM: int8 weight ops, int8 grads."""
  import qwix

  rule = qwix.QtRule(  # The 13 weight ops, not attention's qk / pv einsums.
    module_path=r'.*(proj|ffn|softmax).*',
    weight_qtype='int8',
    act_qtype='int8',
    bwd_qtype='int8',
  )
  return qwix.quantize_model(module, qwix.QtProvider([rule]))


def pax_cases() -> dict[str, tuple[Callable, dict]]:
  """The main job's LM (aqtr.pax layers): float, aqtr int8, Qwix int8."""
  import aqtr
  from aqtr.train import models

  lm = ts.LM
  tpl = models.lm(
    lm['vocab'], lm['seq'], lm['d'], lm['layers'], lm['heads'],
    lm['hidden'] // lm['d'],
  )  # fmt: skip
  ids = jnp.zeros((lm['batch'], lm['seq']), jnp.int32)
  float_module = models.build(models.inject(tpl, None)[0])
  params = float_module.init(jax.random.key(0), ids)['params']
  modules = {
    'float': float_module,
    'aqtr int8': models.build(models.inject(tpl, aqtr.presets.int8())[0]),
  }
  try:
    modules['qwix int8'] = _qwix_pax(float_module)
  except ImportError:
    pass
  out = {}
  for name, module in modules.items():

    def loss(p, x, y, module=module):
      logits = module.apply({'params': p}, x).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    out[name] = (loss, params)
  return out


def cases(row: str) -> tuple[dict[str, tuple[Callable, dict]], tuple]:
  """{impl: (loss(params, x, y), params)} and (x, y) of one row."""
  if row == 'pax':
    return pax_cases(), ts.lm_data(jax.random.key(1))
  init, loss, data = {
    'mlp': (ts.mlp_init, ts.mlp_loss, ts.mlp_data),
    'lm': (ts.lm_init, ts.lm_loss, ts.lm_data),
  }[row]
  params = init(jax.random.key(0))
  out = {
    name: (lambda p, a, b, dot=dot: loss(dot, p, a, b), params)
    for name, dot in ts.dots().items()
  }
  return out, data(jax.random.key(1))


def _fresh_step(loss: Callable, tx) -> Callable:
  """A new function object every call (no jit or trace cache hit).

  `tx` None: the loss and its gradient; else also the optimizer update.
  """

  def grad_step(params, x, y):
    return jax.value_and_grad(lambda p: loss(p, x, y))(params)

  def step(params, opt_state, x, y):
    value, grads = grad_step(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return grad_step if tx is None else step


def measure(row: str, rounds: int, only=None, adam=False) -> list[dict]:
  """Compile times (min over rounds) and graph sizes of one row."""
  impls, (x, y) = cases(row)
  impls = {
    k: v for k, v in impls.items() if only is None or k in only or k == 'float'
  }
  tx = optax.adam(1e-3) if adam else None
  best = {k: [float('inf')] * 4 for k in impls}
  size = {}
  for _ in range(rounds):
    for name, (loss, params) in list(impls.items()):
      args = (params, x, y) if tx is None else (params, tx.init(params), x, y)
      try:
        jax.clear_caches()
        c0, t0 = time.process_time(), time.perf_counter()
        lowered = jax.jit(_fresh_step(loss, tx)).lower(*args)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2, c2 = time.perf_counter(), time.process_time()
      except Exception as e:  # A competitor that fails is reported.
        print(f'  {row} {name}: failed ({type(e).__name__}: {e})'[:240])
        del impls[name], best[name]
        continue
      b = best[name]
      new = (t1 - t0, t2 - t1, t2 - t0, c2 - c0)
      best[name] = [min(old, t) for old, t in zip(b, new, strict=True)]
      if name not in size:
        jaxpr = jax.make_jaxpr(_fresh_step(loss, tx))(*args).jaxpr
        size[name] = (
          count_eqns(jaxpr),
          count_hlo(compiled),
          count_int8_dots(jaxpr),
          count_kernels(compiled),
        )
  rows = []
  for name in impls:
    lower_s, compile_s, total_s, cpu_s = best[name]
    eqns, hlo, int8_dots, kernels = size[name]
    rows.append(
      dict(
        row=row,
        impl=name,
        lower_s=lower_s,
        compile_s=compile_s,
        total_s=total_s,
        ratio=total_s / best['float'][2],
        cpu_s=cpu_s,
        cpu_x=cpu_s / best['float'][3],
        eqns=eqns,
        eqns_x=eqns / size['float'][0],
        hlo=hlo,
        hlo_x=hlo / size['float'][1],
        kernels=kernels,
        int8_dots=int8_dots,
      )
    )
  return rows


COLUMNS = (
  ('row', 'row', '<4', ''),
  ('impl', 'impl', '<10', ''),
  ('lower_s', 'lower s', '>7', '.2f'),
  ('compile_s', 'compile s', '>9', '.2f'),
  ('total_s', 'total s', '>7', '.2f'),
  ('ratio', 'x float', '>7', '.2f'),
  ('cpu_s', 'cpu s', '>5', '.2f'),
  ('cpu_x', 'x float', '>7', '.2f'),
  ('eqns', 'jaxpr eqns', '>10', 'd'),
  ('eqns_x', 'x float', '>7', '.2f'),
  ('hlo', 'hlo ops', '>7', 'd'),
  ('hlo_x', 'x float', '>7', '.2f'),
  ('kernels', 'kernels', '>7', 'd'),
  ('int8_dots', 'int8 dots', '>9', 'd'),
)


def header() -> str:
  head = '| ' + ' | '.join(f'{t:{w}}' for _, t, w, _ in COLUMNS) + ' |'
  rule = '|' + '|'.join(
    '-' * (int(w[1:]) + 1) + (':' if w[0] == '>' else '-')
    for _, _, w, _ in COLUMNS
  )
  return head + '\n' + rule + '|'


def line(r: dict) -> str:
  cells = (f'{r[k]:{w}{f}}' for k, _, w, f in COLUMNS)
  return '| ' + ' | '.join(cells) + ' |'


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    '--rows',
    nargs='*',
    default=list(ROWS),
    help=f'models to run, space- or comma-separated, of {ROWS} (default: all)',
  )
  p.add_argument('--rounds', type=int, default=3)
  p.add_argument(
    '--impls', nargs='*', default=None, help='names to run (default: all)'
  )
  p.add_argument(
    '--adam', action='store_true', help='time the Adam update as well'
  )
  p.add_argument(
    '--json',
    action='store_true',
    help='one JSON row per line (for before_after.py), no table',
  )
  a = p.parse_args(argv)
  rows = [r for arg in a.rows for r in arg.split(',') if r]
  bad = sorted(set(rows) - set(ROWS))
  if bad:
    p.error(f'--rows: unknown {bad}; choose from {list(ROWS)}')
  step = 'loss + gradient' + (' + Adam update' if a.adam else '')
  if a.json:
    for row in rows:
      for r in measure(row, a.rounds, a.impls, a.adam):
        keep = ('lower_s', 'compile_s', 'total_s', 'cpu_s', 'eqns', 'hlo')
        keep += ('kernels', 'int8_dots')
        out = {'row': r['row'], 'impl': r['impl']}
        print(json.dumps(out | {k: r[k] for k in keep}), flush=True)
    return
  print(
    f'jax {jax.__version__}, {jax.devices()[0].device_kind}, host CPU: '
    f'{host.cpu_model()}; step: {step}; min of {a.rounds} rounds, fresh step '
    'functions'
  )
  print(header())
  notes = []
  for row in rows:
    got = {}
    for r in measure(row, a.rounds, a.impls, a.adam):
      print(line(r), flush=True)
      got[r['impl']] = r
    if 'aqtr int8' in got and 'qwix int8' in got:
      aq, qw = got['aqtr int8'], got['qwix int8']
      notes.append(
        f'{row}: aqtr / qwix compile ratio {aq["ratio"] / qw["ratio"]:.2f} '
        f'(cpu {aq["cpu_x"] / qw["cpu_x"]:.2f})'
      )
  print('\n'.join(['', *notes]) if notes else '')


if __name__ == '__main__':
  main()
