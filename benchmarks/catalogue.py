"""The catalogue measured: SQNR per numerics x calibration, cost, PTQ.

Three tables, every row built by iterating the registries (`aqtr.numerics`,
`aqtr.calibrations`), so algorithms registered later appear by themselves:

1. SQNR (dB) = 10 log10(sum x^2 / sum (x - fake_quant(x))^2) of every
   numerics x calibration pair that builds (a TensorConfig that rejects the
   pair, e.g. an asymmetric numerics with a symmetric-only calibration, is
   left out; `constant` is left out: it ignores the data, and so are the
   stateful calibrations: their bound depends on past steps), per-channel
   tiling (one scale per row of 1024, or per weight output column; block
   formats MX / NVFP4: their 32 / 16-element blocks), on
   (a) N(0, 1) [256, 1024], (b) Laplace(0, 1) [256, 1024], (c) the main
   job's LM trained briefly (`aqtr.train`, float): its weight kernels and
   (d) its activations (every layer's [batch*seq, features] output on a
   validation batch). Variants: int_symmetric at 2/3/4/8 bits, fp8 per
   dtype; other numerics at their defaults. rms as k-sigma (p=2, c=3) and
   absmean (p=1, c=1, BitNet's ternary scale).
2. Time per 1M elements of each calibration's bound (jitted, per-channel
   bound of a [1024, 1024] float32 tensor, minimum over rounds; mse with
   int8 and int4 numerics, percentile per method).
3. Post-training quantization of the digits MLP (the main job's
   `experiment.digits()`, trained in float): weight-only int W2/W3/W4
   (per output channel, activations float) with each calibration;
   validation accuracy.

Run: python benchmarks/catalogue.py [--lm-steps 150] [--digits-steps 300]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import host
import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr import calibrations, numerics, tilings
from aqtr.numerics import IntSymmetric, NoNumerics

Array = np.ndarray


def numerics_variants() -> Iterator[tuple[str, Any]]:
  """(label, Numerics) for every registered numerics (variants of some)."""
  for name in numerics.names():
    cls = numerics.get(name)
    if name == 'none':
      continue
    if name == 'int_symmetric':
      for b in (2, 3, 4, 8):
        yield f'int{b}', cls(bits=b)
    elif name == 'fp8':
      for d in ('float8_e4m3fn', 'float8_e5m2'):
        yield d.removeprefix('float8_'), cls(dtype_name=d)
    else:
      try:
        yield name, cls()
      except (TypeError, ValueError):
        continue


def calibration_variants() -> Iterator[tuple[str, Any]]:
  """(label, Calibration) for every registered data-dependent calibration."""
  for name in calibrations.names():
    cls = calibrations.get(name)
    if name == 'constant' or issubclass(cls, calibrations.StatefulCalibration):
      continue  # Stateful ones need state across steps: not a one-shot.
    if name == 'rms':
      yield 'rms 3sd', cls(p=2.0, c=3.0)
      yield 'absmean', cls(p=1.0, c=1.0)
    else:
      try:
        yield name, cls()
      except (TypeError, ValueError):
        continue


def tensor_config(n, c) -> aqtr.TensorConfig | None:
  """The pair as a TensorConfig, or None when the pair is rejected."""
  # Block formats (MX, NVFP4) bring their blocks: sub-channel tiles.
  block = n.block_size
  tiling = (
    tilings.PerChannel()
    if block is None
    else tilings.SubChannel(tile_size=block)
  )
  try:
    return aqtr.TensorConfig(numerics=n, calibration=c, tiling=tiling)
  except (TypeError, ValueError):
    return None


def sqnr(tensors: list[tuple[Array, int]], t: aqtr.TensorConfig) -> float:
  """SQNR (dB) of fake-quantizing each (tensor, contracting axis)."""
  sig = err = 0.0
  for x, axis in tensors:
    f = jax.jit(lambda x, a=axis: aqtr.fake_quant(x, t, contracting_axes=(a,)))
    y = np.asarray(f(jnp.asarray(x)), np.float64)
    sig += float(np.sum(np.square(x, dtype=np.float64)))
    err += float(np.sum((x - y) ** 2))
  return math.inf if err == 0 else 10 * math.log10(sig / err)


def lm_tensors(steps: int) -> tuple[list, list, str]:
  """Weights and activations of the main job's LM after `steps` steps."""
  from aqtr.train import experiment, pax_run, tasks

  cfg = experiment.default()
  cfg.steps, cfg.eval_every, cfg.log_every = steps, steps, steps
  exp, template, _ = experiment.split(cfg)
  task = tasks.make(exp)
  res = pax_run.train(
    'float', aqtr.presets.float(), exp, task, template, show_progress=False
  )
  weights = []
  for path, w in jax.tree_util.tree_leaves_with_path(res.params):
    w = np.asarray(w, np.float32)
    if w.ndim >= 2 and 'embedding' not in jax.tree_util.keystr(path):
      weights.append((w.reshape(w.shape[0], -1), 0))  # [in, out]
  from aqtr.train import models

  module = models.build(res.injected)
  x = task.eval_set[0][0]
  _, state = module.apply({'params': res.params}, x, capture_intermediates=True)
  acts = []
  for a in jax.tree.leaves(state['intermediates']):
    a = np.asarray(a, np.float32)
    if a.ndim == 3:
      acts.append((a.reshape(-1, a.shape[-1]), 1))
  # Scales are per row of an activation and per column of a weight, so
  # tensors sharing that size are concatenated (one compilation each).
  counts = len(weights), len(acts)
  weights, acts = _merged(weights, 1), _merged(acts, 0)
  info = (
    f'LM d_model 128, 2 layers, {steps} float steps, val bpc '
    f'{res.final["bpc"]:.2f}; {counts[0]} weight kernels, '
    f'{counts[1]} activation tensors'
  )
  return weights, acts, info


def _merged(tensors: list[tuple[Array, int]], along: int) -> list:
  """Concatenates tensors of equal contracted size along axis `along`."""
  groups: dict[int, list[Array]] = {}
  for x, axis in tensors:
    groups.setdefault(x.shape[axis], []).append(x)
  axis = 1 - along
  return [(np.concatenate(xs, axis=along), axis) for xs in groups.values()]


def sqnr_table(data: dict[str, list]) -> list[str]:
  cals = list(calibration_variants())
  cols = list(data)
  lines = [
    '| numerics | calibration | ' + ' | '.join(cols) + ' |',
    '|---|---|' + '---:|' * len(cols),
  ]
  for nl, n in numerics_variants():
    for cl, c in cals:
      t = tensor_config(n, c)
      if t is None:
        continue
      try:
        vals = [sqnr(data[k], t) for k in cols]
      except (TypeError, ValueError) as e:
        print(f'skip {nl} x {cl}: {e}')
        continue
      cells = ' | '.join(f'{v:6.2f}' for v in vals)
      lines.append(f'| {nl} | {cl} | {cells} |')
      print(lines[-1], flush=True)
  return lines


def timing_table(rounds: int) -> list[str]:
  x = jnp.asarray(
    np.random.default_rng(0).standard_normal((1024, 1024)), jnp.float32
  )
  rows = []
  for cl, c in calibration_variants():
    variants = [(cl, c, IntSymmetric())]
    if cl == 'mse':
      variants.append(('mse (int4)', c, IntSymmetric(bits=4)))
    if cl == 'percentile':
      variants = [
        (f'percentile {m}', dataclasses.replace(c, method=m), IntSymmetric())
        for m in ('sort', 'top_k', 'histogram')
      ]
    rows += variants
  fns = {
    label: jax.jit(lambda x, c=c, n=n: c.bound_for(x, (1,), n))
    for label, c, n in rows
  }
  for f in fns.values():
    jax.block_until_ready(f(x))
  best = dict.fromkeys(fns, math.inf)
  for _ in range(rounds):  # Interleaved rounds, minimum.
    for label, f in fns.items():
      t0 = time.perf_counter()
      for _ in range(3):
        jax.block_until_ready(f(x))
      best[label] = min(best[label], (time.perf_counter() - t0) / 3)
  base = best.get('absmax', math.nan)
  lines = ['| calibration | ms per 1M elements | x absmax |', '|---|---:|---:|']
  for label, s in best.items():
    lines.append(f'| {label} | {s * 1e3 * 1e6 / x.size:.3f} | {s / base:.1f} |')
  return lines


def ptq_accuracy(
  bits: tuple[int, ...] = (2, 3, 4),
  steps: int = 300,
  hidden: tuple[int, ...] = (256, 256),
  cals: list[tuple[str, Any]] | None = None,
  scopes: tuple[str, ...] = ('channel', 'tensor'),
) -> tuple[float, dict[tuple[str, int, str], float]]:
  """Float accuracy and {(scope, bits, calibration label): PTQ accuracy}.

  Trains the main job's digits MLP in float (`experiment.digits()` with
  `steps` and `hidden`), then quantizes its weights (int symmetric with
  `bits`, preserve_zero and preserve_max_val: W2 is the grid {-s, 0, s})
  with one scale per output channel ('channel') or per weight ('tensor'),
  activations float, with each calibration, and evaluates the validation
  accuracy. No retraining.
  """
  from aqtr.train import experiment, models, pax_run, tasks

  cals = cals if cals is not None else list(calibration_variants())
  cfg = experiment.digits()
  cfg.steps, cfg.eval_every, cfg.log_every = steps, steps, steps
  cfg.model = models.mlp(num_classes=10, hidden=hidden)
  exp, template, _ = experiment.split(cfg)
  task = tasks.make(exp)
  res = pax_run.train(
    'float', aqtr.presets.float(), exp, task, template, show_progress=False
  )
  none = aqtr.TensorConfig(numerics=NoNumerics())
  fl = aqtr.DotGeneralRaw(lhs=none, rhs=none)
  tiling = {'channel': tilings.PerChannel(), 'tensor': tilings.PerTensor()}
  out = {}
  for scope in scopes:
    for b in bits:
      for label, cal in cals:
        w = aqtr.TensorConfig(
          numerics=IntSymmetric(bits=b), calibration=cal, tiling=tiling[scope]
        )
        config = aqtr.DotGeneralConfig(
          fwd=aqtr.DotGeneralRaw(lhs=none, rhs=w), dlhs=fl, drhs=fl
        )
        injected, _ = models.inject(template, config)
        module = models.build(injected)
        apply = jax.jit(lambda p, x, m=module: m.apply({'params': p}, x))
        acc = tasks.evaluate_logits(
          lambda x, a=apply: a(res.params, x), task.eval_set, 'accuracy'
        )
        out[(scope, b, label)] = acc['accuracy']
  return res.final['accuracy'], out


def ptq_table(steps: int) -> list[str]:
  cals = list(calibration_variants())
  base, acc = ptq_accuracy(steps=steps, cals=cals)
  keys = sorted(
    {(s, b) for s, b, _ in acc}, key=lambda k: (k[0] != 'channel', k)
  )
  lines = [
    f'float accuracy {100 * base:.1f}% (digits MLP 64-256-256-10, '
    f'{steps} steps)',
    '',
    '| calibration | ' + ' | '.join(f'W{b} per {s}' for s, b in keys) + ' |',
    '|---|' + '---:|' * len(keys),
  ]
  for label, _ in cals:
    cells = ' | '.join(f'{100 * acc[(s, b, label)]:.1f}%' for s, b in keys)
    lines.append(f'| {label} | {cells} |')
  return lines


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument('--lm-steps', type=int, default=150)
  p.add_argument('--digits-steps', type=int, default=300)
  p.add_argument('--rounds', type=int, default=5)
  p.add_argument(
    '--tables',
    nargs='+',
    default=['sqnr', 'time', 'ptq'],
    choices=['sqnr', 'time', 'ptq'],
  )
  args = p.parse_args()
  print(f'CPU: {host.cpu_model()}; jax {jax.__version__}; {jax.devices()[0]}')
  if 'sqnr' in args.tables:
    rng = np.random.default_rng(0)
    shape = (256, 1024)
    data = {
      'N(0,1)': [(rng.standard_normal(shape).astype(np.float32), 1)],
      'Laplace': [(rng.laplace(size=shape).astype(np.float32), 1)],
    }
    weights, acts, info = lm_tensors(args.lm_steps)
    print(info)
    data['LM weights'], data['LM acts'] = weights, acts
    print('\n'.join(sqnr_table(data)))
  if 'time' in args.tables:
    print('\n'.join(timing_table(args.rounds)))
  if 'ptq' in args.tables:
    print('\n'.join(ptq_table(args.digits_steps)))


if __name__ == '__main__':
  main()
