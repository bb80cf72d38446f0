"""The one module that knows aqtr's serving trees (the frozen containers).

Everything else in `aqtr.checkpoints` works on `Stored` weights keyed by a
parameter path (a tuple, e.g. ('layers', 0, 'q_proj', 'kernel')). Here:

  read_frozen(served, variables)   {path: Stored} of every frozen kernel,
                                   {path: array} of every float parameter
  config_for(stored)               the DotGeneralConfig serving a Stored
  build(model, weights, ...)       a serving model whose holders carry the
                                   given codes (no float kernel is made)

A frozen kernel of a stock Dense / Linear sits in a holder
(`aqtr.flax.frozen`: nnx `Frozen`, linen `FrozenBox`) as
{op key: {entry: {'rhs': {qvalue, scale[, zero_point]}}}}, the values in
the dot's 'kf' tiled view [1, groups, group, d_out] (scales [1, groups, 1,
d_out]). Codes are int4 / int8 (signed) or uint8 (affine numerics with
unsigned storage). An act-order weight (`Stored.g_idx`) is held with its
rows sorted by group (contiguous groups) and the order as 'perm' (int32
[d_in], serving row j is the checkpoint's row perm[j]): the op serves
x[..., perm] @ w[perm] (`aqtr.freezers.lifecycle`), no float copy.

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

from aqtr import presets
from aqtr.calibrations.minmax import MinMax
from aqtr.checkpoints.stored import CheckpointError, Stored
from aqtr.core import codecs
from aqtr.flax import hosts, serving
from aqtr.flax.frozen import holder_entries, kernel_shape
from aqtr.flax.quantized import quantize
from aqtr.numerics.int_asymmetric import IntAsymmetric
from aqtr.numerics.int_symmetric import IntSymmetric
from aqtr.rules import Rule
from aqtr.tilings.per_channel import PerChannel
from aqtr.tilings.per_tensor import PerTensor
from aqtr.tilings.subchannel import SubChannel

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


def _fewest_bits(lo: int, hi: int, unsigned: bool) -> int:
  for b in range(1, 9):
    if unsigned and 0 <= lo and hi <= 2**b - 1:
      return b
    if not unsigned and -(2 ** (b - 1)) <= lo and hi <= 2 ** (b - 1) - 1:
      return b
  raise CheckpointError(f'codes span [{lo}, {hi}]: more than 8 bits.')


def to_stored(parts: dict, shape: tuple, where: str, bits=None) -> Stored:
  """A holder's parts (the 'kf' view of a [d_in, d_out] kernel) as Stored."""
  if codecs.packed_key(parts) == 'e2m1':
    return _mx_stored(parts, shape, where)
  if codecs.packed_key(parts) == 'table4':
    raise CheckpointError(
      f'{where}: codes of a codebook (nf4) have no layout here; export '
      'int or MXFP4 weights.'
    )
  parts = codecs.decode_parts(parts)  # Packed int4 codes -> int8.
  perm = parts.pop('perm', None)
  q = parts['qvalue']
  if len(shape) != 2:
    raise CheckpointError(
      f'{where}: kernel shape {shape}; the layouts store 2-D [d_in, d_out] '
      'kernels (Dense / Linear).'
    )
  d_in, d_out = shape
  if (
    q.ndim != 4
    or q.shape[0] != 1
    or q.shape[3] != d_out
    or (q.shape[1] * q.shape[2] != d_in)
  ):
    raise CheckpointError(
      f'{where}: frozen codes of shape {q.shape} are not the [1, groups, '
      f'group, d_out] view of a [{d_in}, {d_out}] kernel (stacked layers '
      'or another layout: not exportable).'
    )
  dt = jnp.dtype(q.dtype)
  if not jnp.issubdtype(dt, jnp.integer):
    raise CheckpointError(
      f'{where}: codes of dtype {dt} (float formats such as fp8, NVFP4, '
      'MXFP4 have no int layout here); export int weights.'
    )
  n, t = q.shape[1], q.shape[2]
  codes = np.asarray(jnp.asarray(q).astype(jnp.int16)).reshape(d_in, d_out)
  scale = np.broadcast_to(
    np.asarray(parts['scale'], np.float32), (1, n, 1, d_out)
  ).reshape(n, d_out)
  zp = parts.get('zero_point')
  zero = None
  if zp is not None:
    zero = np.broadcast_to(np.asarray(zp), (1, n, 1, d_out)).reshape(n, d_out)
    zero = zero.astype(np.int16)
  unsigned = dt == jnp.uint8
  vals = [codes] + ([zero] if zero is not None else [])
  lo = min(int(v.min()) for v in vals)
  hi = max(int(v.max()) for v in vals)
  b = bits or _fewest_bits(lo, hi, unsigned)
  if unsigned:
    if zero is None:
      raise CheckpointError(f'{where}: unsigned codes without a zero point.')
    codes, zero = codes - 2 ** (b - 1), zero - 2 ** (b - 1)
  g_idx = None
  if perm is not None:  # Serving row j is the checkpoint's row perm[j].
    perm = np.asarray(perm, np.int64)
    if sorted(perm.tolist()) != list(range(d_in)):
      raise CheckpointError(
        f"{where}: stored row order 'perm' is not a permutation of {d_in} rows."
      )
    codes = codes[np.argsort(perm)]
    g_idx = np.empty(d_in, np.int32)
    g_idx[perm] = np.arange(d_in) // t
    if np.array_equal(g_idx, np.arange(d_in) // t):
      g_idx = None
  return Stored(
    q=codes.astype(np.int8),
    scale=scale,
    zero=None if zero is None else zero.astype(np.int8),
    bits=b,
    group=t,
    g_idx=g_idx,
  )


def _mx_stored(parts: dict, shape: tuple, where: str) -> Stored:
  """E2M1 codes: power-of-two scales in groups of 32 (MXFP4), or NVFP4's
  two-level scales (one float32 product per block) in groups of 16."""
  packed = parts['e2m1']
  q = np.asarray(codecs.unpack(packed, 4, 2 * jnp.shape(packed)[-1]))
  d_in, d_out = shape
  n, t = q.shape[1], q.shape[2]
  scale = np.broadcast_to(
    np.asarray(parts['scale'], np.float32), (1, n, 1, d_out)
  ).reshape(n, d_out)
  m, _ = np.frexp(scale)
  kind = {16: 'nvfp4', 32: 'mxfp4'}.get(t)
  if kind is None or (kind == 'mxfp4' and not (m == 0.5).all()):
    raise CheckpointError(
      f'{where}: E2M1 codes in groups of {t} are neither MXFP4 (groups of '
      '32, power-of-two scales) nor NVFP4 (groups of 16); export those or '
      'int weights.'
    )
  return Stored(
    q=q.reshape(d_in, d_out), scale=scale, bits=4, group=t, kind=kind
  )


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


def config_for(w: Stored):
  """The weight-only DotGeneralConfig whose frozen values hold `w`."""
  if w.kind == 'mxfp4':
    return presets.mxfp4_weight_only()
  if w.kind == 'nvfp4':  # NVFP4 weights (`presets.nvfp4`'s), float inputs.
    base, rhs = presets.mxfp4_weight_only(), presets.nvfp4().fwd.rhs
    return dataclasses.replace(
      base,
      fwd=dataclasses.replace(base.fwd, rhs=rhs),
      dlhs=dataclasses.replace(base.dlhs, rhs=rhs),
    )
  if w.zero is None:
    numerics = IntSymmetric(
      bits=w.bits, storage='int4' if w.bits <= 4 else 'int8'
    )
    cal = None
  else:
    numerics = IntAsymmetric(bits=w.bits, storage='uint8', clip_gradient=False)
    cal = MinMax(po2_scale=False)
  tiling = PerChannel() if w.channelwise else SubChannel(tile_size=w.group)
  base = presets.int8_weight_only()
  fields = {'numerics': numerics, 'tiling': tiling}
  if cal is not None:
    fields['calibration'] = cal
  rhs = dataclasses.replace(base.fwd.rhs, **fields)
  return dataclasses.replace(
    base,
    fwd=dataclasses.replace(base.fwd, rhs=rhs),
    dlhs=dataclasses.replace(base.dlhs, rhs=rhs),
  )


def layers_of(w, where: str) -> list:
  """`w` (a Stored, or a list of them: stacked layers) as a list, checked
  to share one format (bits, group size, symmetry)."""
  ws = w if isinstance(w, list) else [w]
  first = ws[0]
  for i, x in enumerate(ws[1:], 1):
    if (x.kind, x.bits, x.group, x.symmetric) != (
      first.kind,
      first.bits,
      first.group,
      first.symmetric,
    ):
      raise CheckpointError(
        f'{where}[{i}]: bits={x.bits} group={x.group} symmetric='
        f'{x.symmetric}, but layer 0 has bits={first.bits} group='
        f'{first.group} symmetric={first.symmetric}; stacked layers share '
        'one format (fields bits, group_size, sym).'
      )
  return ws


def from_stored(w, like: dict) -> dict:
  """`w` (a Stored, or a list of them: stacked layers, stacked on a
  leading axis) as holder parts shaped and typed like `like`."""
  if not isinstance(w, list):
    return _from_one(w, like)
  n = jax.tree.leaves(like)[0].shape[0]
  if len(w) != n:
    raise CheckpointError(
      f'{len(w)} layers in the checkpoint, the model stacks {n}.'
    )
  one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), like)
  perm = any(x.g_idx is not None for x in w)  # Then every layer has one.
  layers = [_from_one(x, one, perm) for x in w]
  return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def _from_one(w: Stored, like: dict, perm: bool = False) -> dict:
  """`w` as holder parts shaped and typed like the skeleton's `like`
  (stored through the codec of `config_for(w)`'s numerics); an act-order
  `w` (or `perm`: always) adds its row order 'perm'."""
  numerics = config_for(w).fwd.rhs.numerics
  qs = jax.ShapeDtypeStruct(codecs.stored_shape(like), numerics.dtype)
  n, t, d_out = qs.shape[1], qs.shape[2], qs.shape[3]
  if (n * t, d_out) != (w.d_in, w.d_out) or t != w.group:
    raise CheckpointError(
      f'codes [{w.d_in}, {w.d_out}] in groups of {w.group} do not fit the '
      f'model view {qs.shape}.'
    )
  if w.kind in ('mxfp4', 'nvfp4'):
    scale = w.scale.astype(np.float32).reshape(like['scale'].shape)
    codes = jnp.asarray(w.q.astype(np.uint8).reshape(qs.shape))
    return {'e2m1': codecs.pack(codes, 4), 'scale': jnp.asarray(scale)}
  order = np.argsort(w.rows, kind='stable')  # Contiguous groups.
  q = w.q.astype(np.int16)[order]
  zero = None if w.zero is None else w.zero.astype(np.float32)
  if jnp.dtype(qs.dtype) == jnp.uint8:
    q = q + 2 ** (w.bits - 1)
    zero = zero + 2 ** (w.bits - 1)
  out = {
    'qvalue': jnp.asarray(q.reshape(qs.shape)).astype(qs.dtype),
    'scale': jnp.asarray(
      w.scale.astype(np.float32).reshape(like['scale'].shape)
    ),
  }
  if 'zero_point' in like:
    out['zero_point'] = jnp.asarray(zero.reshape(like['zero_point'].shape))
  if perm or w.g_idx is not None:
    out['perm'] = jnp.asarray(order.astype(np.int32))
  return codecs.encode_parts(out, numerics)


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
