"""QT on a stock model: params that live quantized, read by rule ops.

`aqtr.qt` keeps chosen params only quantized (no float master copy);
on a model quantized by rules (`aqtr.flax.quantize`) with
`aqtr.qt.formats.dot_config(fmt)` on the ops that read them, TRAIN
re-quantizes the dequantized weight to exactly the stored values and
`convert` freezes exactly them: what QT trains is what SERVE reads. A
param QT keeps quantized must be read by quantized ops only: `check`
says in one line when one is read by a float op or outside weight
operands (an embedding lookup), or by no op at all.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> from aqtr import qt
  >>> from aqtr.flax import Rule, quantize
  >>> m = quantize(nn.Dense(4), Rule(qt.formats.dot_config(qt.int8())))
  >>> x = jnp.ones((2, 8))
  >>> v = m.init(jax.random.key(0), x)
  >>> _, rep = qt.quantize_params(v['params'], [qt.Rule()])
  >>> check(m, rep, x, variables=v)
"""

from __future__ import annotations

from aqtr.flax import serving

__all__ = ['check']


def _paths(chosen) -> tuple[str, ...]:
  got = getattr(chosen, 'quantized', chosen)
  if isinstance(got, str) or not all(isinstance(p, str) for p in got):
    raise TypeError(
      'aqtr.flax.qt_rules.check: pass the QuantizationReport of '
      'aqtr.qt.quantize_params (or its .quantized paths), got '
      f'{type(chosen).__name__}.'
    )
  return tuple(got)


def check(model, chosen, *args, variables=None, **kwargs) -> None:
  """Raises one line unless quantized ops alone read the QT params.

  Args:
    model: a model quantized by rules (`aqtr.flax.quantize`).
    chosen: the `aqtr.qt.quantize_params` report (or its `.quantized`
      param paths, 'module/.../name').
    *args, **kwargs: sample inputs (traced abstractly, no compute).
    variables: linen: the model's variables (nnx: unused).

  Raises:
    ValueError: a chosen param is read by a float op, outside weight
      operands, or by no op.
  """
  fn = serving.abstract_call(model, variables, args, kwargs)
  reads: dict[str, list] = {}
  for s in serving.trace(model, fn):
    configs = {e.path: e.config for e in s.entries}
    for where, w in s.weights.items():
      path = '/'.join(map(str, w.param_path))
      reads.setdefault(path, []).append(
        (where, configs.get(where) is not None, w.elsewhere)
      )
  for path in _paths(chosen):
    got = reads.get(path)
    if not got:
      raise ValueError(
        f'{path}: QT keeps this param quantized, but no op of the model '
        'reads it as a weight; keep it float in the QT rules (qt.Rule '
        'pattern).'
      )
    for where, quantized, elsewhere in got:
      if not quantized:
        raise ValueError(
          f'{where}: QT keeps param {path!r} quantized, but this op reads '
          'it in float (no rule quantizes it); add a rule for the op '
          '(Rule(aqtr.qt.formats.dot_config(fmt), path=...)) or keep the '
          'param float in the QT rules.'
        )
      if elsewhere:
        raise ValueError(
          f'{path}: QT keeps this param quantized, but the model also reads '
          'it outside weight operands (e.g. an embedding lookup); keep it '
          'float in the QT rules.'
        )
