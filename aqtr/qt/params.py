"""Quantized parameters: `QTParam` leaves chosen by path rules.

A parameter tree (e.g. Flax `params`) is quantized leaf by leaf: the first
`Rule` whose regex matches the leaf's path ('Dense_0/kernel',
'layers_0/ffn/wi/kernel') stores it in the rule's `WeightFormat`; other
leaves (embeddings, norms, biases by default) stay float. The stored values
live in the tiled view of the weight as a dot's rhs operand, so
`QTParam.qtensor()` is directly an `aqtr.QTensor` operand for
`aqtr.dot_general` / `aqtr.einsum` (serving with no conversion step).

Example:
  >>> import jax.numpy as jnp
  >>> from aqtr import qt
  >>> params = {'Dense_0': {'kernel': jnp.ones((64, 8)), 'bias': jnp.ones(8)}}
  >>> q, report = qt.quantize_params(params, [qt.Rule()])
  >>> q['Dense_0']['kernel'].qvalue.dtype, report.quantized
  (dtype('int8'), ('Dense_0/kernel',))
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aqtr.core import codecs
from aqtr.core.dimension_numbers import OperandLayout
from aqtr.core.qtensor import ROLE_AXES, QTensor, from_view, to_view
from aqtr.core.quantizer import quantize_scaled
from aqtr.core.rounding import as_typed_key, uniform_grid
from aqtr.qt.formats import WeightFormat, weight_scale

__all__ = [
  'PARAM',
  'QTParam',
  'QuantizationReport',
  'Rule',
  'dequantize',
  'is_qt',
  'path_str',
  'quantize_params',
  'requantize',
  'UPDATE',
  'tree_bytes',
]

PARAM = 'param'
# The role of a QT update; JAX shows it when a tree op pairs the two roles.
UPDATE = (
  'update: a new QTParam from aqtr.qt.quantized_training; apply it with '
  'aqtr.qt.apply_updates, not optax.apply_updates (which would add the '
  'int codes and the scales)'
)


@dataclasses.dataclass(frozen=True)
class QTParam:
  """A weight stored quantized: `w ~ dequant(qvalue) * scale`.

  Attributes:
    qvalue: int8 / float8_e4m3fn values, or int4 packed two per uint8, in
      the tiled view of the weight as a dot's rhs operand.
    scale: float32, broadcastable to the (unpacked) view.
    layout: the weight's operand layout (static).
    form: 'fk' or 'kf', the view's form (static).
    fmt: the WeightFormat (static).
    role: PARAM, or UPDATE for the new parameter `quantized_training`
      returns as its update (static). The two roles are different pytree
      metadata, so tree arithmetic that pairs a parameter with its update
      (`optax.apply_updates`, which would add the integer codes and the
      scales) fails with a structure error that shows UPDATE's text;
      `aqtr.qt.apply_updates` takes the new parameter instead.
  """

  qvalue: jax.Array
  scale: jax.Array
  layout: OperandLayout
  form: str
  fmt: WeightFormat
  role: str = PARAM

  @property
  def shape(self) -> tuple[int, ...]:
    return self.layout.shape

  def values(self) -> jax.Array:
    """The stored values in the tiled view (int4 unpacked to jnp.int4)."""
    if self.fmt.kind != 'int4':
      return self.qvalue
    packed = {_INT4.key: self.qvalue}
    return _INT4.decode(packed, dtype=jnp.int4).reshape(self.view_shape)

  @property
  def view_shape(self) -> tuple[int, ...]:
    tile = self.fmt.group_size or None
    return view_shape(self.layout, self.form, tile)

  def dequant(self, dtype=jnp.float32) -> jax.Array:
    """The float weight in its original layout."""
    v = self.values().astype(jnp.float32) * self.scale
    x3 = from_view(v, self.form)
    return self.layout.from_canonical(x3, self.form).astype(dtype)

  def qtensor(self) -> QTensor:
    """The engine operand: pass it as rhs of `aqtr.dot_general`."""
    return QTensor(self.values(), self.scale, self.layout, self.form)


jax.tree_util.register_dataclass(
  QTParam,
  data_fields=['qvalue', 'scale'],
  meta_fields=['layout', 'form', 'fmt', 'role'],
)


def view_shape(lay: OperandLayout, form: str, tile) -> tuple[int, ...]:
  t = tile or lay.k
  if form == 'fk':
    return (lay.b, lay.k // t, lay.f, t)
  return (lay.b, lay.k // t, t, lay.f)


_INT4 = codecs.Int4()


def pack_int4(q: jax.Array) -> jax.Array:
  """int values in [-8, 7] -> uint8, two per byte (even size; the core's
  'int4' codec over the flattened values)."""
  return _INT4.encode(q.reshape(-1))[_INT4.key]


def unpack_int4(p: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of `pack_int4`: int8 values of `shape`."""
  return _INT4.decode({_INT4.key: p}, dtype=jnp.int8).reshape(shape)


def is_qt(x) -> bool:
  return isinstance(x, QTParam)


def _quantize(w: jax.Array, lay: OperandLayout, fmt: WeightFormat, key):
  form = lay.natural_form()
  tile = fmt.group_size or None
  x4 = to_view(lay.to_canonical(w.astype(jnp.float32), form), form, tile)
  n = fmt.numerics
  axes = (ROLE_AXES[form]['k'],)
  bound = fmt.tensor_config().calibration.bound_for(x4, axes, n)
  s = weight_scale(bound, fmt)
  # The core's rounding step (the numerics clip x / s to +-qmax).
  noise = None if key is None else uniform_grid(key, x4.shape, bits=16)
  q = quantize_scaled(x4, s, n, noise=noise)
  if key is not None:
    # Each group's largest |w| keeps the top code (nearest: its v lies
    # within 2^-16 of qmax, as `weight_scale` rounds s up). Stochastic
    # rounding could take it one code down, and then the engine's
    # re-calibration of the dequantized weight (max|q s| / qmax) would no
    # longer give back s: serving `qtensor()` would differ from training.
    q = jnp.where(jnp.abs(x4) == bound, quantize_scaled(x4, s, n), q)
  if fmt.kind == 'int4':
    q = pack_int4(q)
  return QTParam(q, s, lay, form, fmt)


_quantize_jit = jax.jit(_quantize, static_argnums=(1, 2))


def requantize(p: QTParam, w: jax.Array, key=None) -> QTParam:
  """`w` (the weight in p's layout) quantized in p's format, scale anew.

  Args:
    p: the current parameter (gives layout and format).
    w: the new float weight.
    key: PRNG key for stochastic rounding; None: round to nearest.
  """
  if not is_qt(p):
    raise TypeError(f'requantize: p must be an aqtr.qt.QTParam, got {p!r}.')
  if tuple(jnp.shape(w)) != p.shape:
    raise ValueError(
      f'requantize: w has shape {tuple(jnp.shape(w))} but p stores a weight '
      f"of shape {p.shape}; pass the new weight in p's shape."
    )
  if not jnp.issubdtype(jnp.result_type(w), jnp.floating):
    raise TypeError(
      f'requantize: w must be a float array, got {jnp.result_type(w)}.'
    )
  return _quantize(w, p.layout, p.fmt, as_typed_key(key))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """Parameters whose path matches `pattern` are stored in `fmt`.

  Attributes:
    pattern: a regex searched in the '/'-joined parameter path.
    fmt: the WeightFormat (default int8 per channel).
    name: shown in reports (default: the pattern).

  Example:
    >>> Rule(pattern=r'ffn/.*/kernel$').fmt.kind
    'int8'
  """

  pattern: str = r'(^|/)kernel$'
  fmt: WeightFormat = dataclasses.field(default_factory=WeightFormat)
  name: str = ''

  def __post_init__(self):
    if not isinstance(self.pattern, str):
      raise TypeError(f'Rule.pattern must be a str, got {self.pattern!r}.')
    try:
      re.compile(self.pattern)
    except re.error as e:
      raise ValueError(
        f'Rule.pattern is not a valid regex: {self.pattern!r} ({e}).'
      ) from None
    if not isinstance(self.fmt, WeightFormat):
      raise TypeError(f'Rule.fmt must be a WeightFormat, got {self.fmt!r}.')

  @property
  def label(self) -> str:
    return self.name or self.pattern


@dataclasses.dataclass(frozen=True)
class QuantizationReport:
  """Which parameters each rule quantized.

  Attributes:
    quantized: paths stored quantized.
    kept_float: paths left float.
    by_rule: rule label -> paths it quantized.
    unused_rules: labels of rules that matched no parameter.
  """

  quantized: tuple[str, ...]
  kept_float: tuple[str, ...]
  by_rule: dict[str, tuple[str, ...]]
  unused_rules: tuple[str, ...]


def path_str(path) -> str:
  """'/'-joined keys of a tree path ('params/Dense_0/kernel')."""
  parts = []
  for e in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(e, attr):
        parts.append(str(getattr(e, attr)))
        break
    else:
      parts.append(str(e))
  return '/'.join(parts)


def quantize_params(
  params,
  rules: Sequence[Rule] = (Rule(),),
  *,
  strict: bool = False,
  key: jax.Array | None = None,
):
  """Stores the parameters the rules select as QTParams.

  Args:
    params: a tree of float arrays.
    rules: first matching rule wins; default: every 'kernel' in int8.
    strict: raise when a rule selects no parameter (else a warning).
    key: PRNG key for stochastic rounding of the initial values; None:
      round to nearest.

  Returns:
    (quantized tree, QuantizationReport).
  """
  rules = tuple(rules)
  for r in rules:
    if not isinstance(r, Rule):
      raise TypeError(f'rules must hold aqtr.qt.Rule values, got {r!r}.')
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_qt)
  key = as_typed_key(key)
  by_rule = {r.label: [] for r in rules}
  out, kept, done = [], [], []
  for i, (path, leaf) in enumerate(leaves):
    name = path_str(path)
    rule = next((r for r in rules if re.search(r.pattern, name)), None)
    if rule is None or is_qt(leaf):
      out.append(leaf)
      (done if is_qt(leaf) else kept).append(name)
      if rule is not None:
        by_rule[rule.label].append(name)
      continue
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      raise TypeError(
        f'parameter {name!r} matched rule {rule.label!r} but has dtype '
        f'{jnp.result_type(leaf)}; only float parameters can be quantized.'
      )
    lay = rule.fmt.layout(tuple(jnp.shape(leaf)), name)
    k = None if key is None else jax.random.fold_in(key, i)
    out.append(_quantize_jit(jnp.asarray(leaf), lay, rule.fmt, k))
    by_rule[rule.label].append(name)
    done.append(name)
  unused = tuple(label for label, ps in by_rule.items() if not ps)
  if unused:
    msg = f'aqtr.qt: rules {list(unused)} selected no parameter.'
    if strict:
      raise ValueError(msg + ' (strict=True)')
    warnings.warn(msg, stacklevel=2)
  report = QuantizationReport(
    quantized=tuple(done),
    kept_float=tuple(kept),
    by_rule={k: tuple(v) for k, v in by_rule.items()},
    unused_rules=unused,
  )
  return jax.tree_util.tree_unflatten(treedef, out), report


def dequantize(params, dtype=jnp.float32):
  """Every QTParam replaced by its float weight; other leaves unchanged."""
  return jax.tree.map(
    lambda x: x.dequant(dtype) if is_qt(x) else x, params, is_leaf=is_qt
  )


def tree_bytes(tree) -> int:
  """Bytes held by the arrays of a tree (packed int4 counts half a byte)."""
  return sum(
    int(x.nbytes) for x in jax.tree.leaves(tree) if hasattr(x, 'nbytes')
  )
