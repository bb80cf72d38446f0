"""Formats compared at (about) equal bits: SQNR and a served digits MLP.

A format is an operand `TensorConfig`; its storage cost per value counts
the element and the scales,

  bits/value = element bits + scale bits / values per scale
             (+ 32 / tensor size for NVFP4's per-tensor float32 scale),

with float32 scales for int / NF4 groups, an 8-bit E8M0 scale per 32
values for MX (Rouhani et al. 2023, arXiv:2310.10537) and an e4m3 scale
per 16 values for NVFP4. The quantization error is measured as

  SQNR = 10 log10( sum x^2 / sum (x - fake_quant(x))^2 )  dB

on generated data (Gaussian and Student-t, blocks along the last axis)
and on a float-trained MLP's weights; the MLP is then served with each
format's weights (activations float) and its validation loss compared
(the teacher-student regression: its MSE shows weight errors that digits
accuracy hides).

Example:
  >>> import jax.numpy as jnp
  >>> fmt = fmts()['mxfp4']
  >>> bits_per_value(fmt, k=4096)
  4.25
  >>> x = jnp.ones((2, 64)).at[0, 0].set(3.0)
  >>> round(sqnr(x, fmt), 1)
  inf
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr import numerics as nm
from aqtr.calibrations import AbsMax
from aqtr.tilings import PerChannel, SubChannel
from papers.lib import mlp, tasks

__all__ = [
  'Microscaling',
  'bits_per_value',
  'data',
  'fmts',
  'serve',
  'sqnr',
  'sqnr_rows',
]

DISTRIBUTIONS = ('gaussian', 'student_t3')


def _t(numerics, tile: int = 0) -> aqtr.TensorConfig:
  return aqtr.TensorConfig(
    numerics=numerics,
    calibration=AbsMax(),
    tiling=SubChannel(tile_size=tile) if tile else PerChannel(),
  )


def fmts() -> dict[str, aqtr.TensorConfig]:
  """The formats: ~8 bits (int8, MXFP8), ~4-4.5 bits (int4, MXFP4, NVFP4,
  NF4, int4 in groups of 64)."""
  return {
    'int8': _t(nm.IntSymmetric(bits=8)),
    'mxfp8': _t(nm.Mx(element='fp8_e4m3'), 32),
    'int4': _t(nm.IntSymmetric(bits=4)),
    'mxfp4': _t(nm.Mx(element='fp4_e2m1'), 32),
    'nvfp4': _t(nm.NvFp4(), 16),
    'nf4': _t(nm.Nf4(), 64),
    'int4_g64': _t(nm.IntSymmetric(bits=4), 64),
  }


def _element_bits(n) -> float:
  if isinstance(n, nm.Mx):
    e = nm.mx.ELEMENTS[n.element]
    return 8.0 if e is None else 1.0 + sum(e)
  if isinstance(n, nm.NvFp4):
    return 4.0
  if isinstance(n, nm.Codebook):
    return math.log2(len(n.table))
  return float(n.bits)


def bits_per_value(t: aqtr.TensorConfig, k: int, size: int = 0) -> float:
  """Storage bits per value of `t` on a contraction of `k` (size: the
  tensor's element count, for NVFP4's per-tensor scale; 0: ignored)."""
  n = t.numerics
  group = t.tiling.tile_size if isinstance(t.tiling, SubChannel) else k
  scale = 8.0 if isinstance(n, (nm.Mx, nm.NvFp4)) else 32.0
  extra = 32.0 / size if isinstance(n, nm.NvFp4) and size else 0.0
  return _element_bits(n) + scale / group + extra


@functools.partial(jax.jit, static_argnames=('t', 'axis'))
def _energies(x: jax.Array, t: aqtr.TensorConfig, axis: int):
  q = aqtr.fake_quant(x, t, contracting_axes=(axis,))
  return jnp.sum(x * x), jnp.sum((x - q) ** 2)


def sqnr(x: jax.Array, t: aqtr.TensorConfig, axis: int = -1) -> float:
  """SQNR in dB of `t` on `x`, contracting (blocking along) `axis`."""
  signal, err = _energies(x, t, axis)
  return float(10 * jnp.log10(signal / err))


def data(name: str, shape: tuple[int, int], seed: int = 0) -> jax.Array:
  """Generated data: 'gaussian' N(0, 1) or 'student_t3' (3 dof)."""
  key = jax.random.key(seed)
  if name == 'gaussian':
    return jax.random.normal(key, shape)
  if name == 'student_t3':
    return jax.random.t(key, 3.0, shape)
  raise ValueError(f'data: name must be one of {DISTRIBUTIONS}, got {name!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class Microscaling:
  """The experiment.

  Attributes:
    formats: name -> TensorConfig; compared on every source.
    shape: (rows, contraction) of the generated tensors.
    distributions: generated sources, from DISTRIBUTIONS.
    task: the float MLP trained once per seed and served; its
      contractions (input width, hidden widths) must be multiples of 64.
  """

  formats: dict[str, aqtr.TensorConfig] = dataclasses.field(
    default_factory=fmts
  )
  shape: tuple[int, int] = (64, 4096)
  distributions: tuple[str, ...] = DISTRIBUTIONS
  task: tasks.Task = dataclasses.field(default_factory=tasks.Task)

  def __post_init__(self):
    if not self.formats:
      raise ValueError('Microscaling.formats must have >= 1 entry.')
    bad = [d for d in self.distributions if d not in DISTRIBUTIONS]
    if bad:
      raise ValueError(
        f'Microscaling.distributions must be from {DISTRIBUTIONS}, got {bad}.'
      )
    if len(self.shape) != 2 or self.shape[1] % 64:
      raise ValueError(
        'Microscaling.shape must be (rows, k) with k a multiple of 64, got '
        f'{self.shape}.'
      )


def sqnr_rows(exp: Microscaling, weights: list[jax.Array]) -> list[dict]:
  """Per format: bits/value and SQNR on each distribution and on the
  trained `weights` (all layers together, contraction = axis 0)."""
  xs = {d: data(d, exp.shape) for d in exp.distributions}
  rows = []
  for name, t in exp.formats.items():
    row: dict[str, Any] = {
      'format': name,
      'bits/value': bits_per_value(t, exp.shape[1], math.prod(exp.shape)),
    }
    for d, x in xs.items():
      row[f'{d} dB'] = sqnr(x, t)
    e = np.array([_energies(w, t, 0) for w in weights], np.float64)
    row['MLP weights dB'] = 10 * math.log10(e[:, 0].sum() / e[:, 1].sum())
    rows.append(row)
  return rows


def serve(
  params: mlp.Params, t: aqtr.TensorConfig | None, d: tasks.Data
) -> float:
  """The validation loss (MSE, or cross-entropy for digits) with every
  weight in `t` (activations float); `t=None`: float."""
  cfg = aqtr.presets.float()
  if t is not None:
    cfg = dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=t))
  out = mlp.apply_jit(params, jnp.asarray(d.x_val), config=cfg)
  if d.metric == 'mse':
    return float(jnp.mean((out - jnp.asarray(d.y_val)) ** 2))
  logp = jax.nn.log_softmax(out)
  y = jnp.asarray(d.y_val)[:, None]
  return -float(jnp.take_along_axis(logp, y, -1).mean())


def run(exp: Microscaling, progress=None) -> list[dict[str, Any]]:
  """One row per format (plus 'float'): bits/value, SQNRs, served loss and
  its ratio to float (means over the task's seeds; SQNR of seed 0's
  weights)."""
  say = progress or (lambda s: None)
  d = tasks.load(exp.task)
  served = {n: [] for n in ['float', *exp.formats]}
  rows = None
  for seed in exp.task.seeds:
    params = mlp.run(exp.task, aqtr.presets.float(), seed, d, False)['params']
    if rows is None:
      rows = sqnr_rows(exp, [p['w'] for p in params])
    served['float'].append(serve(params, None, d))
    for name, t in exp.formats.items():
      served[name].append(serve(params, t, d))
    say(
      f'seed {seed}: '
      + ', '.join(f'{n} {v[-1]:.4g}' for n, v in served.items())
    )
  out = [{'format': 'float', 'bits/value': 32.0}] + rows
  ref = np.mean(served['float'])
  for row in out:
    row['served loss'] = float(np.mean(served[row['format']]))
    row['loss / float'] = row['served loss'] / ref
  return out
