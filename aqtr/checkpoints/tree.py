"""The one module that knows aqtr's serving trees (the frozen containers).

Everything else in `aqtr.checkpoints` works on `Stored` weights keyed by a
parameter path (a tuple, e.g. ('layers', 0, 'q_proj', 'kernel')). Here:

  read_frozen(served, variables)   {path: Stored} of every frozen kernel,
                                   {path: array} of every float parameter
  build(model, weights, ...)       a serving model whose holders carry the
                                   given codes (no float kernel is made)

A frozen kernel of a stock Dense / Linear sits in a holder
(`aqtr.flax.frozen`: nnx `Frozen`, linen `FrozenBox`) as
{op key: {entry: {'rhs': {qvalue, scale[, zero_point]}}}}, the values in
the dot's 'kf' tiled view [1, groups, group, d_out] (scales [1, groups, 1,
d_out]). One holder's parts and a `Stored` convert both ways in
`aqtr.checkpoints.parts` (`to_stored`, `from_stored`, and `config_for`,
the config serving a Stored, re-exported here). An act-order weight's op
serves x[..., perm] @ w[perm] (`aqtr.freezers.lifecycle`), no float copy.

Example:
  >>> import numpy as np
  >>> from aqtr.checkpoints.stored import Stored
  >>> cfg = config_for(Stored(q=np.zeros((32, 4), np.int8),
  ...                         scale=np.ones((2, 4), np.float32), group=16))
  >>> cfg.fwd.rhs.tiling, cfg.fwd.rhs.numerics.storage
  (SubChannel(tile_size=16, tile_count=0), 'int4')
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from aqtr.checkpoints.parts import (
  config_for,
  from_stored,
  layers_of,
  to_stored,
)
from aqtr.checkpoints.stored import CheckpointError, Stored
from aqtr.core import codecs
from aqtr.flax import hosts, serving
from aqtr.flax.frozen import holder_entries, kernel_shape
from aqtr.flax.quantized import quantize
from aqtr.rules import Rule
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor

__all__ = [
  'build',
  'config_for',
  'from_stored',
  'layers_of',
  'path_text',
  'read_frozen',
  'with_weight',
]


def path_text(path: tuple) -> str:
  return '/'.join(str(k) for k in path)


def _holders(host):
  """Yields (param path, holder, kernel shape) of every frozen kernel."""
  for path, h in host.holders():
    yield tuple(path), h, kernel_shape(h)


def _parts(holder, where: str) -> dict:
  entries = holder_entries(holder)
  found = [
    e['rhs']
    for op in entries.values()
    for e in op.values()
    if isinstance(e, dict) and 'rhs' in e
  ]
  if not found:
    raise CheckpointError(
      f"{where}: read only through a derived weight (e.g. GPT-2's "
      '`kernel.transpose()`), whose frozen values sit in the op store; a '
      'checkpoint stores the parameter itself: not exportable yet.'
    )
  if len(found) != 1:
    raise CheckpointError(
      f'{where}: read by {len(found)} quantized ops; a checkpoint stores '
      'one quantized weight per kernel.'
    )
  return found[0]


def read_frozen(served, variables=None, bits=None) -> tuple[dict, dict]:
  """({path: Stored} of the frozen kernels, {path: array} of the floats).

  Args:
    served: a converted model (`aqtr.flax.convert`, `aqtr.ptq.quantize`,
      `aqtr.lora.merge`): nnx module, or linen module with `variables`.
    variables: linen: the serving variables.
    bits: the bits written for every weight (None: the fewest holding the
      codes, which the numerics' range gives for a calibrated weight).
  """
  host = hosts.served(served, variables, who='aqtr.checkpoints')
  frozen = {}
  for path, holder, shape in _holders(host):
    where = path_text(path)
    parts = _parts(holder, where)
    if codecs.packed_key(parts) in ('int4', 'uint4'):
      parts = codecs.decode_parts(parts)
    lead = jnp.ndim(parts.get('qvalue', 0)) - 4
    if lead == 1:  # Stacked layers (scan): one Stored per layer.
      n = jnp.shape(parts['qvalue'])[0]
      frozen[path] = [
        to_stored(
          {
            k: v[i] if jnp.ndim(v) == (2 if k == 'perm' else 5) else v
            for k, v in parts.items()
          },
          shape,
          f'{where}[{i}]',
          bits,
        )
        for i in range(n)
      ]
    elif lead > 1:
      raise CheckpointError(
        f'{where}: frozen codes of shape {jnp.shape(parts["qvalue"])} have '
        f'{lead} stacked axes; a checkpoint splits one layer axis only.'
      )
    else:
      frozen[path] = to_stored(parts, shape, where, bits)
  return frozen, host.params()


def with_weight(config, w: Stored, where: str = 'weight'):
  """`config` (an op's, or None) serving the stored weight `w`: its
  weight side (rhs) is `config_for(w)`'s, its input side (lhs) its own."""
  base = config_for(w)
  if config is None or config.is_float:
    return base
  lhs = config.fwd.lhs
  if (
    any(x.g_idx is not None for x in (w if isinstance(w, list) else [w]))
    and lhs.quantized
    and not isinstance(lhs.tiling, PerTensor | PerChannel)
  ):
    raise CheckpointError(
      f'{where}: act-order weight (g_idx): its input is served in group '
      f'order, so input tiling {type(lhs.tiling).__name__} would group '
      'other channels (argument rules): tile the input per tensor or per '
      'token.'
    )
  rhs = base.fwd.rhs
  return dataclasses.replace(
    config,
    fwd=dataclasses.replace(config.fwd, rhs=rhs),
    dlhs=dataclasses.replace(config.dlhs, rhs=rhs),
  )


def _rules(weights: dict, model, rules, args, kwargs, variables) -> list:
  """The rules of the rebuilt model: each stored weight's op (by module
  path, `weight=True`) and, given `rules` (the rules the model was
  quantized by), every other op as those rules set it (ops without a
  weight, e.g. attention under a rule without `weight=True`; ops whose
  weight the checkpoint holds float, e.g. a head tied to the embedding)
  and the input side of the stored weights' ops. Ops of one module are
  told apart by kind and weight only."""
  by_module = {
    path_text(p[:-1]): layers_of(w, path_text(p))[0] for p, w in weights.items()
  }
  ops: dict = {}  # (module, kind or None, weight) -> config
  if rules is not None:
    with warnings.catch_warnings():
      warnings.simplefilter('ignore', UserWarning)  # Rules that set no op.
      rep = serving.report(
        quantize(model, rules), *args, variables=variables, **kwargs
      )
    for e in rep.ops:
      module = e.path.rsplit('/', 1)[0] if '/' in e.path else ''
      w = by_module.get(module) if e.weight else None
      if w is not None:
        key, cfg = (module, None, True), with_weight(e.config, w, e.path)
      elif not e.quantized:
        continue
      else:  # No weight, or one derived from a float tensor (tied heads).
        key, cfg = (module, e.kind, bool(e.weight)), e.config
      if ops.setdefault(key, cfg) != cfg:
        raise CheckpointError(
          f'{e.path}: the rules quantize ops of one module differently '
          '(argument rules); load tells them apart by op kind only.'
        )
  for module, w in by_module.items():
    ops.setdefault((module, None, True), config_for(w))
  by_cfg: dict = {}
  for (module, kind, weight), cfg in ops.items():
    by_cfg.setdefault((cfg, kind, weight), []).append(module)
  return [
    Rule(
      cfg, path='|'.join(re.escape(p) for p in paths), op=kind, weight=weight
    )
    for (cfg, kind, weight), paths in by_cfg.items()
  ]


def build(
  model, weights: dict, floats: dict, args, kwargs, variables=None, rules=None
):
  """The serving model holding `weights` and `floats`, no float kernel made.

  Args:
    model: a float nnx Module or linen Module (its parameters may be
      abstract: `nnx.eval_shape` / `jax.eval_shape` of the init).
    weights: {param path: Stored} of the kernels to freeze.
    floats: {param path: array} of every other parameter.
    args, kwargs: sample inputs of one call (shapes matter).
    variables: linen: the (abstract) variables.
    rules: the rules the exported model was quantized by (None: only the
      stored weights' ops are quantized): they set every other op (e.g.
      attention quantized by a rule without `weight=True`) and the input
      side of the weight ops, so the model serves what was exported.

  Returns:
    nnx: the serving model. linen: (module, serving variables).
  """
  q = quantize(model, _rules(weights, model, rules, args, kwargs, variables))
  host = hosts.of(q, variables, who='aqtr.checkpoints')

  # A weight the checkpoint holds float (a head tied to the embedding)
  # stays a parameter; its op (given rules) quantizes it when serving.
  keep = '|'.join(re.escape(path_text(p)) for p in floats) or None

  def conv(h):
    out = serving.convert(
      h.model, *args, variables=h.variables, check=False, keep=keep, **kwargs
    )
    return hosts.served(out)

  with warnings.catch_warnings():
    warnings.simplefilter('ignore', UserWarning)
    served = host.abstract(conv)
  done = set()
  for path, holder, _ in _holders(served):
    where = path_text(path)
    if path not in weights:
      raise CheckpointError(f'{where}: frozen by the model but not stored.')
    entries = jax.tree.map(lambda x: x, holder_entries(holder))
    for op in entries.values():
      for e in op.values():
        try:
          e['rhs'] = from_stored(weights[path], e['rhs'])
        except CheckpointError as err:
          raise CheckpointError(f'{where}: {err}') from None
    served.set_holder(path, entries)
    done.add(path)
  missing = sorted(path_text(p) for p in weights if p not in done)
  if missing:
    raise CheckpointError(
      f'{missing[0]}: stored quantized, but no quantized op of the model '
      'reads it (check the sample inputs and the name map).'
    )
  new = {}
  for path, like in served.params().items():
    new[path] = _float(floats, path, like)
  return served.with_params(new).result()


def _float(floats, path, like):
  """The checkpoint's tensor for parameter `path`, checked against `like`."""
  where = path_text(path)
  if path not in floats:
    raise CheckpointError(f'{where}: no tensor in the checkpoint maps to it.')
  a = np.asarray(floats[path])
  if tuple(a.shape) != tuple(like.shape):
    raise CheckpointError(
      f'{where}: checkpoint tensor has shape {tuple(a.shape)}, the model '
      f'parameter {tuple(like.shape)}.'
    )
  return jnp.asarray(a, like.dtype)
