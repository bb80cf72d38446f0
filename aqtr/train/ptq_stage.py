"""The `ptq` stage of the main job: post-training quantization of the float run.

After the runs, every method of `Experiment.ptq` (`aqtr.ptq`: 'rtn',
'gptq', ...) quantizes the trained 'float' run's parameters in every
weight format of `Experiment.ptq_formats` (`FORMATS`): calibration on the
first `ptq_batches` training batches, the serving tree `aqtr.ptq.quantize`
returns, evaluated on the validation set like every run. Each pair adds a
summary row 'ptq:<method>:<format>' and writes the per-layer report
(output error of RTN and of the method, seconds) to
`<out>/ptq/<method>_<format>.txt`.

  aqtr-train --config=set:ptq="('rtn','gptq')" \\
             --config=set:ptq_formats="('w4g128','w3g128')"

Example:
  >>> sorted(FORMATS)[:3]
  ['e2m1g32', 'nf4', 'nvfp4']
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import pathlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

import aqtr
import aqtr.pax
import aqtr.ptq
from aqtr.flax import common
from aqtr.train import models, tasks

__all__ = ['check_fields', 'FORMATS', 'run']


def _weight_only(numerics: str, tile: int = 0, **kw) -> aqtr.DotGeneralConfig:
  cfg = aqtr.presets.int8_weight_only()
  tiling = aqtr.tilings.get('subchannel')(tile_size=tile) if tile else None
  rhs = dataclasses.replace(
    cfg.fwd.rhs,
    numerics=aqtr.numerics.get(numerics)(**kw),
    tiling=tiling or cfg.fwd.rhs.tiling,
  )
  return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, rhs=rhs))


# Weight formats of the `ptq` stage (weight-only; g128: groups of 128
# inputs): name -> config factory.
FORMATS: dict[str, Callable[[], aqtr.DotGeneralConfig]] = {
  'w8': aqtr.presets.int8_weight_only,
  'w4': aqtr.presets.int4_weight_only,
  'w4g128': functools.partial(
    _weight_only, 'int_symmetric', 128, bits=4, storage='int4'
  ),
  'w3g128': functools.partial(_weight_only, 'int_symmetric', 128, bits=3),
  'nf4': functools.partial(_weight_only, 'nf4', 64),
  'e2m1g32': functools.partial(
    _weight_only, 'fp', 32, exponent_bits=2, mantissa_bits=1
  ),
  'nvfp4': functools.partial(_weight_only, 'nvfp4', 16),
}


def run(exp, task, template, float_run, out: pathlib.Path, say) -> list:
  """The stage's summary rows (see the module docstring).

  Args:
    exp: the Experiment.
    task: its Task.
    template: the float model template.
    float_run: the trained 'float' run (`loop.RunResult`).
    out: the job's output folder.
    say: print-like.

  Returns:
    One row per (method, format), keyed like the job's summary rows.
  """
  calib = [
    jnp.asarray(x) for x, _ in itertools.islice(task.batches(), exp.ptq_batches)
  ]
  variables = {'params': float_run.params, **float_run.collections}
  folder = out / 'ptq'
  folder.mkdir(exist_ok=True)
  rows = []
  for fmt in exp.ptq_formats:
    rules = [aqtr.pax.Rule(FORMATS[fmt](), tag=aqtr.pax.tags.WeightOp)]
    for method in exp.ptq:
      name = f'ptq:{method}:{fmt}'
      t0 = time.perf_counter()
      try:
        (tmpl, sv), rep = aqtr.ptq.quantize(
          template, rules, calib, variables=variables, method=method
        )
      except ValueError as e:  # E.g. a group size the model cannot take.
        say(f'  {name}: FAILED: {e}', flush=True)
        rows.append({'run': name, 'status': str(e), 'failure': 'FAILED'})
        continue
      secs = time.perf_counter() - t0
      model = models.build(tmpl)
      logits = jax.jit(functools.partial(model.apply, sv))
      ev = tasks.evaluate_logits(logits, task.eval_set, task.metric)
      (folder / f'{method}_{fmt}.txt').write_text(str(rep) + '\n')
      say(
        f'  {name}: {task.metric} {ev[task.metric]:.4f} '
        f'({len(rep.layers)} weight ops in {secs:.1f} s)',
        flush=True,
      )
      rows.append(
        {
          'run': name,
          'val loss': ev['val_loss'],
          task.metric: ev[task.metric],
          'serving KB': common.nbytes(sv) / 1024,
          'status': 'ok',
        }
      )
  return rows


def check_fields(exp) -> None:
  """Raises one line for a bad `ptq` / `ptq_formats` of Experiment `exp`."""
  for field, allowed in (
    ('ptq', aqtr.ptq.methods.names()),
    ('ptq_formats', sorted(FORMATS)),
  ):
    value = getattr(exp, field)
    if isinstance(value, list | str):
      value = (value,) if isinstance(value, str) else tuple(value)
      object.__setattr__(exp, field, value)
    if not isinstance(value, tuple) or any(v not in allowed for v in value):
      raise ValueError(
        f'{field} must be a tuple of names in {allowed}, got {value!r}.'
      )
  if exp.ptq and 'float' not in exp.runs:
    raise ValueError(
      f"ptq={exp.ptq} quantizes the trained 'float' run: add 'float' to runs."
    )
