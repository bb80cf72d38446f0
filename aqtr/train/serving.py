"""Serving a trained run: frozen weights only, orbax, serve == train.

For a run whose config quantizes the weights (the forward rhs), `check`
  1. freezes the trained params with `aqtr.flax.linen.convert` on the
     model's CONVERT twin (`models.serving_template`): each quantized
     kernel becomes int8/fp8 values + float32 scales in the collection
     'aqtr' and its float copy is dropped from 'params' (an empty
     `FrozenBox`);
  2. saves the serving variables with orbax, plus the run's config
     (Fiddle JSON) next to them;
  3. restores them into a structure made with `jax.eval_shape` (no float
     kernels needed) and checks the saved config against the run's;
  4. runs the SERVE twin on the validation set and compares its logits with
     the training model's (TRAIN mode, float params): serve == train means
     bit-identical logits on every batch.

Example (run by tests/train; ~10 s of compiling):
  >>> import jax, aqtr
  >>> from aqtr.train import experiment, models, serving
  >>> cfg, _ = models.inject(experiment.tiny().model, aqtr.presets.int8())
  >>> cfg.max_len = 8
  >>> x = jax.numpy.zeros((1, 8), int)
  >>> model = models.build(cfg)
  >>> params = jax.jit(model.init)(jax.random.key(0), x)  # doctest: +SKIP
  >>> out = serving.check(
  ...   cfg, params['params'], aqtr.presets.int8(),
  ...   jax.jit(lambda p, x: model.apply({'params': p}, x)), [(x, x)],
  ...   '/tmp/aqtr_serve')  # doctest: +SKIP
  >>> out['serve_equal'], out['kernel_ratio'] < 0.3  # doctest: +SKIP
  (True, True)
"""

from __future__ import annotations

import pathlib
import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

import aqtr
import aqtr.flax.linen as aqtr_linen
from aqtr import fiddle as aqtr_fiddle
from aqtr.flax import checkpoint, common
from aqtr.freezers import Mode
from aqtr.train import models
from aqtr.train.high_precision import HighPrecision

__all__ = ['check', 'restore', 'save']


def save(
  path: str | pathlib.Path,
  variables: Any,
  config: aqtr.DotGeneralConfig,
  model: Any = None,
  keep: HighPrecision | None = None,
) -> pathlib.Path:
  """Writes serving variables (orbax) and the run's config (Fiddle JSON).

  Args:
    path: a folder; it gets `variables/` (orbax, `aqtr.flax.checkpoint`)
      and `config.json` (and `model.json` when `model` is given).
    variables: from `aqtr.flax.linen.convert`.
    config: the DotGeneralConfig the model was trained with.
    model: the float model template (`aqtr-generate` rebuilds the serving
      model from it and `config.json`).
    keep: the blocks the run kept float (`aqtr.train.high_precision`),
      written as `high_precision.json` when it keeps any.

  Returns:
    The absolute folder.
  """
  path = pathlib.Path(path).absolute()
  path.mkdir(parents=True, exist_ok=True)
  checkpoint.save(path / 'variables', variables, force=True)
  (path / 'config.json').write_text(
    aqtr_fiddle.dumps(aqtr_fiddle.as_config(config))
  )
  if keep is not None and keep.any:
    (path / 'high_precision.json').write_text(
      aqtr_fiddle.dumps(aqtr_fiddle.as_config(keep))
    )
  if model is not None:
    try:
      (path / 'model.json').write_text(aqtr_fiddle.dumps(model))
    except Exception as e:  # A custom model may not serialize.
      warnings.warn(f'model.json not written: {e}', stacklevel=2)
  return path


def restore(
  path: str | pathlib.Path,
  like: Any,
  config: aqtr.DotGeneralConfig | None = None,
) -> Any:
  """Reads serving variables written by `save`.

  Args:
    path: the folder `save` wrote.
    like: the serving tree's structure (arrays or ShapeDtypeStructs, with
      empty `FrozenBox` placeholders), e.g. `jax.eval_shape` of the conversion.
    config: if given, must equal the saved config; serving with another
      config than the one trained and converted with raises ValueError.

  Returns:
    The serving variables.
  """
  path = pathlib.Path(path).absolute()
  if config is not None:
    saved = aqtr_fiddle.build(
      aqtr_fiddle.loads((path / 'config.json').read_text())
    )
    if saved != config:
      raise ValueError(
        f'{path}: the checkpoint was converted from a model trained with '
        'another config than the one given; serve with its config.json.'
      )
  return checkpoint.restore(path / 'variables', like)


def check(
  injected: Any,
  params: Any,
  config: aqtr.DotGeneralConfig,
  train_logits: Callable[[Any, np.ndarray], jax.Array],
  eval_set: list[tuple[np.ndarray, np.ndarray]],
  out: str | pathlib.Path,
  collections: dict | None = None,
  model: Any = None,
  keep: HighPrecision | None = None,
) -> dict[str, Any]:
  """Converts, saves, restores and compares serving with training logits.

  Args:
    injected: the run's injected model template.
    params: its trained float params.
    config: the run's DotGeneralConfig.
    train_logits: (params, inputs) -> logits of the training model.
    eval_set: validation (inputs, labels) batches.
    out: the checkpoint folder.
    collections: the model's other trained collections (e.g. the
      calibration state 'aqtr_state'), kept in the serving variables.
    model: the float model template, saved as `model.json` (see `save`).
    keep: the blocks the run kept float (see `save`).

  Returns:
    {'serving_bytes', 'float_bytes', 'kernel_ratio', 'serve_equal' (bit
    for bit on every batch), 'max_abs_diff', 'checkpoint'}.
  """
  conv = models.build(models.serving_template(injected, Mode.CONVERT))
  serve = models.build(models.serving_template(injected, Mode.SERVE))
  x0 = eval_set[0][0]

  def convert(p):
    return aqtr_linen.convert(conv, {'params': p, **(collections or {})}, x0)

  variables = jax.jit(convert)(params)
  report = aqtr.flax.sizes((serve, variables))
  path = save(out, variables, config, model, keep)
  restored = restore(path, jax.eval_shape(convert, params), config)
  serve_logits = jax.jit(serve.apply)
  diff, equal = 0.0, True
  for x, _ in eval_set:
    a = np.asarray(train_logits(params, x))
    b = np.asarray(serve_logits(restored, x))
    equal &= bool(np.array_equal(a, b))
    diff = max(diff, float(np.max(np.abs(a - b))))
  return {
    'serving_bytes': report.serving_bytes,
    'float_bytes': common.nbytes(params),
    'kernel_ratio': report.kernel_ratio,
    'serve_equal': equal,
    'max_abs_diff': diff,
    'checkpoint': str(path),
  }
