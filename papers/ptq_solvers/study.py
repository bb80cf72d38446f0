"""The PTQ study: a float LM, then RTN / mse / GPTQ / AWQ / SmoothQuant.

Trains the main job's Pax-style byte LM (`aqtr.train`) in float, then
post-training quantizes its weights with `aqtr.ptq.quantize` on every
grid of `Study.grids` (numerics x tiling) and every method of
`Study.methods`, and serves each solution (the ordinary frozen serving
tree) on the validation split: bits per byte (bpc) per (grid, method).
`Study.formats` adds GPTQ and RTN on 4-bit codebook / float formats (nf4,
fp4 e2m1, NVFP4). The SmoothQuant part injects activation outliers with
an exactly equivalent rescaling (`aqtr.ptq.outliers`: the float model is
unchanged), then serves W8A8 (int8 x int8 dots, per-tensor activations)
with and without smoothing.

Claims (GPTQ, Frantar et al. 2022, arXiv 2210.17323; AWQ, Lin et al.
2023, arXiv 2306.00978; SmoothQuant, Xiao et al. 2022, arXiv
2211.10438): at 4 and 3 bits GPTQ and AWQ close most of round to
nearest's gap to float; smoothing makes W8A8 work where activation
outliers break per-tensor int8.

Example:
  >>> Study().grids[:2]
  ('w8', 'w4')
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import fiddle as fdl
import jax

import aqtr
import aqtr.pax
import aqtr.ptq as ptq
from aqtr import calibrations
from aqtr.core.config import TensorConfig
from aqtr.numerics.fp import Fp
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.numerics.nf4 import Nf4
from aqtr.numerics.nvfp4 import NvFp4
from aqtr.ptq import fold, outliers, smoothquant
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.subchannel import SubChannel
from aqtr.train import experiment, models, pax_run, tasks

__all__ = ['FORMATS', 'GRIDS', 'METHODS', 'Study', 'run', 'weight_config']


def _int(bits: int) -> IntSymmetric:
  return IntSymmetric(
    bits=bits,
    preserve_zero=True,
    preserve_max_val=True,
    clip_gradient=False,
    storage='int4' if bits <= 4 else 'int8',
  )


def _tiles(size: int | None):
  return PerChannel() if size is None else SubChannel(tile_size=size)


# name -> (numerics, tile size along d_in (None: per output channel)).
GRIDS: dict[str, tuple[Callable[[], Any], int | None]] = {
  'w8': (lambda: _int(8), None),
  'w4': (lambda: _int(4), None),
  'w4g128': (lambda: _int(4), 128),
  'w4g32': (lambda: _int(4), 32),
  'w3g128': (lambda: _int(3), 128),
  'w3g32': (lambda: _int(3), 32),
}
# 4-bit formats other than int4: GPTQ on their grids, against RTN.
FORMATS: dict[str, tuple[Callable[[], Any], int | None]] = {
  'nf4 g64': (Nf4, 64),
  'e2m1 g32': (lambda: Fp(exponent_bits=2, mantissa_bits=1), 32),
  'nvfp4': (NvFp4, 16),
}
# method -> (ptq method name, calibration of the grid's scales).
METHODS = {
  'rtn': ('rtn', 'absmax'),
  'mse': ('rtn', 'mse'),
  'gptq': ('gptq', 'absmax'),
  'awq': ('awq', 'absmax'),
}


def weight_config(numerics, tile: int | None, calibration: str = 'absmax'):
  """Weight-only DotGeneralConfig: `numerics` on the weight, float else."""
  cal = calibrations.get(calibration)()
  if calibration == 'absmax':
    cal = calibrations.AbsMax(clip_scale=1.0, po2_scale=False)
  w = dataclasses.replace(
    aqtr.presets.int4_weight_only().fwd.rhs,
    numerics=numerics,
    tiling=_tiles(tile),
    calibration=cal,
  )
  assert isinstance(w, TensorConfig)
  cfg = aqtr.presets.int4_weight_only()
  return dataclasses.replace(
    cfg,
    fwd=dataclasses.replace(cfg.fwd, rhs=w),
    dlhs=dataclasses.replace(cfg.dlhs, rhs=w),
  )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Study:
  """The PTQ study's settings.

  Attributes:
    lm: the float LM's experiment (`aqtr.train.experiment.Experiment`,
      runs ignored): model, steps, data.
    calibration_batches: batches of the training stream the solvers see.
    grids: `GRIDS` names (weight-only integer grids).
    methods: `METHODS` names, run on every grid.
    formats: `FORMATS` names (GPTQ and RTN on each).
    outlier_channels: channels per norm given outliers (SmoothQuant).
    outlier_factors: their factors (powers of two: exact).
    alpha: SmoothQuant's migration strength.
  """

  lm: Any = None
  calibration_batches: int = 16
  grids: tuple[str, ...] = ('w8', 'w4', 'w4g128', 'w3g128', 'w3g32')
  methods: tuple[str, ...] = ('rtn', 'mse', 'gptq', 'awq')
  formats: tuple[str, ...] = ('nf4 g64', 'e2m1 g32', 'nvfp4')
  outlier_channels: int = 4
  outlier_factors: tuple[float, ...] = (32.0, 64.0)
  alpha: float = 0.5

  def __post_init__(self):
    for field, known, got in (
      ('grids', GRIDS, self.grids),
      ('methods', METHODS, self.methods),
      ('formats', FORMATS, self.formats),
    ):
      bad = [g for g in got if g not in known]
      if bad:
        raise ValueError(
          f'Study.{field}: unknown {bad}; choose from {sorted(known)}.'
        )
    if self.calibration_batches < 1:
      raise ValueError(
        'Study.calibration_batches must be >= 1, got '
        f'{self.calibration_batches}.'
      )


def _rules(cfg):
  return [aqtr.pax.Rule(cfg, tag=aqtr.pax.tags.WeightOp)]


def _bpc(fn, task) -> float:
  return tasks.evaluate_logits(jax.jit(fn), task.eval_set, task.metric)['bpc']


def _served_bpc(served, task) -> float:
  tmpl, variables = served
  module = fdl.build(tmpl)
  return _bpc(lambda x: module.apply(variables, x), task)


def _float_lm(study: Study, say):
  exp, template, _ = experiment.split(study.lm)
  task = tasks.make(exp)
  t0 = time.perf_counter()
  r = pax_run.train(
    'float',
    aqtr.presets.float(),
    exp,
    task,
    template,
    show_progress=False,
  )
  say(
    f'float LM: {exp.steps} steps in {time.perf_counter() - t0:.0f} s, '
    f'val bpc {r.final["bpc"]:.4f}'
  )
  batches = task.batches()
  calib = [next(batches)[0] for _ in range(study.calibration_batches)]
  return template, {'params': r.params}, task, calib, r


def run(study: Study, progress=None) -> dict[str, list[dict[str, Any]]]:
  """Runs the study; returns {'weights': rows, 'formats': rows,
  'smoothquant': rows, 'float': [row], 'curve': [val records]}."""
  say = progress or (lambda s: None)
  template, variables, task, calib, r = _float_lm(study, say)
  base = r.final['bpc']
  curve = [h for h in r.history if 'bpc' in h]

  def one(cfg, method):
    t0 = time.perf_counter()
    served, rep = ptq.quantize(
      template, _rules(cfg), calib, variables=variables, method=method
    )
    bpc = _served_bpc(served, task)
    err = [(x.error, x.rtn_error) for x in rep.layers]
    return {
      'bpc': bpc,
      'gap': bpc - base,
      'error': sum(e for e, _ in err) / len(err),
      'seconds': time.perf_counter() - t0,
    }

  weights = []
  for g in study.grids:
    numerics, tile = GRIDS[g]
    for m in study.methods:
      name, cal = METHODS[m]
      res = one(weight_config(numerics(), tile, cal), name)
      weights.append({'grid': g, 'method': m, **res})
      say(f'{g:8s} {m:5s} bpc {res["bpc"]:.4f} ({res["seconds"]:.0f} s)')
  formats = []
  for f in study.formats:
    numerics, tile = FORMATS[f]
    for m in ('rtn', 'gptq'):
      res = one(weight_config(numerics(), tile), m)
      formats.append({'grid': f, 'method': m, **res})
      say(f'{f:8s} {m:5s} bpc {res["bpc"]:.4f}')
  sq = _smoothquant(study, template, variables, task, calib, base, say)
  return {
    'float': [{'bpc': base, 'val_loss': r.final['val_loss']}],
    'weights': weights,
    'formats': formats,
    'smoothquant': sq,
    'curve': curve,
  }


def _smoothquant(study, template, variables, task, calib, base, say):
  """W8A8 per tensor on the outlier LM, without and with smoothing."""
  params = variables['params']
  fm = fold.detect(params)
  params2, where = outliers.inject(
    params,
    fm,
    channels=study.outlier_channels,
    factors=study.outlier_factors,
  )
  v2 = {'params': params2}
  module = models.build(template)
  same = _bpc(lambda x: module.apply(v2, x), task)
  rows = [{'run': 'float, outliers injected', 'bpc': same}]
  rules = _rules(smoothquant.w8a8('tensor'))
  for name, method, opts in (
    ('W8A8 per tensor, RTN', 'rtn', {}),
    ('W8A8 per tensor, SmoothQuant', 'smoothquant', {'alpha': study.alpha}),
  ):
    served, _ = ptq.quantize(
      template, rules, calib, variables=v2, method=method, **opts
    )
    rows.append({'run': name, 'bpc': _served_bpc(served, task)})
  w = {'run': 'W8A8 per tensor, RTN (no outliers)'}
  served, _ = ptq.quantize(template, rules, calib, variables=variables)
  w['bpc'] = _served_bpc(served, task)
  rows.append(w)
  for row in rows:
    row['gap %'] = 100 * (row['bpc'] - base) / base
    say(f'{row["run"]:36s} bpc {row["bpc"]:.4f} ({row["gap %"]:+.2f} %)')
  del where
  return rows


def closed(rows, grid: str, method: str) -> float:
  """The fraction of RTN's gap to float that `method` closes on `grid`."""
  by = {(r['grid'], r['method']): r['gap'] for r in rows}
  rtn = by[(grid, 'rtn')]
  return math.nan if rtn <= 0 else 1 - by[(grid, method)] / rtn
