"""Calibrations compared: the N(0, 1) clip oracle and PTQ of a digits MLP.

(a) Oracle. For symmetric int quantization at `b` bits (`IntSymmetric`:
levels `k s`, |k| <= qmax = 2^(b-1) - 1, `s = c / qmax`) the mean squared
error of N(0, 1) clipped at `c`,

  MSE(c) = integral (x - s * clip(round(x / s), -qmax, qmax))^2 phi(x) dx,

is computed by quadrature on a fine grid of x and minimized over a grid of
c (Banner et al. 2019, arXiv:1810.05723). The registered `mse`
calibration's choice on N(0, 1) samples is reported next to it.

(b) Post-training quantization. A float digits MLP is trained once per
seed; then every layer's weights (W) or every layer's input activations
(A) are quantized at `bits` with each calibration, per channel (weights:
per output column; activations: per example), and the validation accuracy
is measured. `mean_of_max` is the static range of the `calibration`
freezer (the mean over calibration batches of each layer input's absmax),
applied with the `constant` calibration.

Example:
  >>> import numpy as np
  >>> c, mse = oracle_curve(2, np.array([1.0, 1.22, 1.5]))
  >>> int(np.argmin(mse))
  1
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import aqtr
from aqtr.calibrations import Calibration, Constant
from aqtr.numerics import IntSymmetric
from papers.lib import mlp, tasks

__all__ = ['Shootout', 'oracle', 'oracle_curve', 'ptq', 'sample_choice']

MEAN_OF_MAX = 'mean_of_max'


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shootout:
  """The experiment.

  Attributes:
    oracle_bits: bit widths of the N(0, 1) oracle.
    clips: (lo, hi, step) of the clip grid in sigma.
    samples: N(0, 1) samples given to the `mse` calibration.
    calibrations: name -> Calibration compared in PTQ (and 'mean_of_max',
      the static mean of absmax, added for activations).
    bits: PTQ bit width of the quantized operand.
    calibration_batches: batches of 64 training examples for mean_of_max.
    task: the float model's training (digits).
  """

  oracle_bits: tuple[int, ...] = (2, 3, 4, 8)
  clips: tuple[float, float, float] = (0.5, 5.0, 0.005)
  samples: int = 1 << 16
  calibrations: dict[str, Calibration] = dataclasses.field(
    default_factory=lambda: {'absmax': aqtr.calibrations.AbsMax()}
  )
  bits: int = 2
  calibration_batches: int = 8
  task: tasks.Task = dataclasses.field(default_factory=tasks.Task)

  def __post_init__(self):
    if any(b not in range(2, 9) for b in self.oracle_bits):
      raise ValueError(
        f'Shootout.oracle_bits must be in 2..8, got {self.oracle_bits}.'
      )
    lo, hi, step = self.clips
    if not 0 < lo < hi or step <= 0:
      raise ValueError(
        f'Shootout.clips must be (lo, hi, step) with 0 < lo < hi and step > '
        f'0, got {self.clips}.'
      )
    if self.bits not in range(2, 9):
      raise ValueError(f'Shootout.bits must be in 2..8, got {self.bits}.')
    if MEAN_OF_MAX in self.calibrations:
      raise ValueError(
        f'Shootout.calibrations: {MEAN_OF_MAX!r} is added by the '
        'experiment; use another name.'
      )


def oracle_curve(
  bits: int, clips: np.ndarray, n: int = 200_001, span: float = 10.0
) -> tuple[np.ndarray, np.ndarray]:
  """(clips, MSE of N(0, 1) at each clip) by trapezoid quadrature."""
  x = np.linspace(-span, span, n)
  w = np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi) * (x[1] - x[0])
  w[[0, -1]] *= 0.5
  num = IntSymmetric(bits=bits)
  qmax = float(num.max_value)
  xj, wj = jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32)

  @jax.jit
  def mse(c):
    s = c / qmax
    q = jnp.clip(num.quantize(xj / s), -qmax, qmax) * s
    return jnp.sum(wj * (xj - q) ** 2)

  return clips, np.array([float(mse(jnp.float32(c))) for c in clips])


def oracle(bits: int, clips: tuple[float, float, float]) -> float:
  """The MSE-optimal clip of N(0, 1) at `bits`, in sigma (grid search)."""
  lo, hi, step = clips
  grid = np.arange(lo, hi + step / 2, step)
  c, m = oracle_curve(bits, grid)
  return float(c[np.argmin(m)])


def sample_choice(bits: int, samples: int, seed: int = 0) -> float:
  """The registered `mse` calibration's bound on N(0, 1) samples / sigma."""
  x = jax.random.normal(jax.random.key(seed), (1, samples))
  bound = aqtr.calibrations.Mse().bound_for(x, (1,), IntSymmetric(bits=bits))
  return float(bound.reshape(())) / float(jnp.std(x))


def _config(cal: Calibration, bits: int, operand: str):
  base = aqtr.presets.float()
  t = aqtr.TensorConfig(
    numerics=IntSymmetric(bits=bits, clip_gradient=False),
    calibration=cal,
    tiling=aqtr.tilings.PerChannel(),
  )
  fwd = dataclasses.replace(base.fwd, **{operand: t})
  return dataclasses.replace(base, fwd=fwd)


@functools.partial(jax.jit, static_argnames=('configs',))
def _apply(params, x, configs):
  for i, (layer, cfg) in enumerate(zip(params, configs, strict=True)):
    x = aqtr.dot_general(x, layer['w'], mlp.DN, cfg) + layer['b'][None]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return x


def _input_absmax(params, x) -> list[float]:
  out = []
  for i, layer in enumerate(params):
    out.append(float(jnp.max(jnp.abs(x))))
    x = x @ layer['w'] + layer['b'][None]
    if i < len(params) - 1:
      x = jax.nn.relu(x)
  return out


def mean_of_max(exp: Shootout, params, data: tasks.Data) -> list[float]:
  """Per layer: mean over calibration batches of max |layer input|."""
  x = jnp.asarray(data.x_train)
  maxes = [
    _input_absmax(params, x[64 * i : 64 * (i + 1)])
    for i in range(exp.calibration_batches)
  ]
  return list(np.mean(maxes, axis=0))


def ptq(exp: Shootout, progress=None) -> list[dict[str, Any]]:
  """Accuracy (%) of the float model and of W / A quantization per
  calibration, averaged over the task's seeds.

  Returns:
    Rows {'calibration', 'W<bits>', 'W sd', 'A<bits>', 'A sd'}; the first
    row is float (no quantization); mean_of_max has no W entry (for a
    weight it is absmax).
  """
  say = progress or (lambda s: None)
  data = tasks.load(exp.task)
  xv, yv = jnp.asarray(data.x_val), np.asarray(data.y_val)
  names = ['float', *exp.calibrations, MEAN_OF_MAX]
  acc = {(n, o): [] for n in names for o in ('lhs', 'rhs')}
  for seed in exp.task.seeds:
    params = mlp.run(exp.task, aqtr.presets.float(), seed, data, False)
    params = params['params']
    n = len(params)

    def score(configs, params=params):
      out = np.asarray(_apply(params, xv, configs))
      return 100 * float((out.argmax(-1) == yv).mean())

    f = score((aqtr.presets.float(),) * n)
    acc[('float', 'lhs')].append(f)
    acc[('float', 'rhs')].append(f)
    for name, cal in exp.calibrations.items():
      for o in ('rhs', 'lhs'):
        acc[(name, o)].append(score((_config(cal, exp.bits, o),) * n))
    bounds = mean_of_max(exp, params, data)
    cfgs = tuple(_config(Constant(bound=b), exp.bits, 'lhs') for b in bounds)
    acc[(MEAN_OF_MAX, 'lhs')].append(score(cfgs))
    say(
      f'seed {seed}: '
      + ', '.join(f'{k}: {v[-1]:.1f}' for k, v in acc.items() if v)
    )
  b = exp.bits
  rows = []
  for name in names:
    w, a = np.array(acc[(name, 'rhs')]), np.array(acc[(name, 'lhs')])
    rows.append(
      {
        'calibration': name,
        f'W{b}': float(w.mean()) if w.size else None,
        'W sd': float(w.std()) if w.size else None,
        f'A{b}': float(a.mean()),
        'A sd': float(a.std()),
      }
    )
  return rows
