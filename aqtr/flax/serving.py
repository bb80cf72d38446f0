"""What a quantized stock model does: `report`, `convert`, `sizes`.

`convert` records every weight op of one call of a model quantized by
`aqtr.flax.quantize` (abstractly), quantizes each matched parameter once
with its op's config through `aqtr.flax.quantized.engine_dot` (the
'weights' freezer: exactly TRAIN's quantization) and puts the frozen values
in the parameter's place (`aqtr.flax.frozen`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.flax.quantized import quantize
  >>> from aqtr.rules import Rule
  >>> q = quantize(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), [Rule('int8')])
  >>> x = jnp.ones((2, 4))
  >>> served = convert(q, x)
  >>> bool((served(x) == q(x)).all()), sizes(served).float_kernel_bytes
  (True, 48)
"""

from __future__ import annotations

import re
import warnings

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr import rules as rules_lib
from aqtr.flax import common
from aqtr.flax.frozen import FrozenBox, FrozenKernel, kernel_bytes
from aqtr.flax.quantized import (
  Session,
  WeightUse,
  engine_dot,
  frozen_entry,
  observers,
  set_mode,
  spec_of,
  swapped,
)
from aqtr.freezers import Mode, lifecycle
from aqtr.rules import OpEntry, Report


def trace(model, fn) -> list[Session]:
  """The sessions of the quantized calls `fn` makes (abstractly)."""
  stack = getattr(observers, 'stack', None)
  if stack is None:
    stack = observers.stack = []
  got: list[Session] = []
  stack.append(got)
  try:
    fn()
  finally:
    stack.remove(got)
  return got


def abstract_call(model, variables, args, kwargs, method='__call__'):
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)

    def call(state):
      return getattr(nnx.merge(graphdef, state), method)(*args, **kwargs)

    return lambda: jax.eval_shape(call, state)
  return lambda: jax.eval_shape(
    lambda v: model.apply(v, *args, method=method, **kwargs), variables
  )


def report(model, *args, variables=None, strict=False, **kwargs) -> Report:
  """Every intercepted op of one call of `model(*args, **kwargs)`.

  Traced abstractly (no compute). Rules that set no op are warned about
  (`UserWarning`); with `strict=True` they raise a ValueError.

  Args:
    model: a quantized model (`quantize`).
    *args, **kwargs: sample inputs.
    variables: linen: the variables to apply (nnx: unused).
    strict: raise when a rule sets no op.

  Returns:
    An `aqtr.rules.Report` (the format of `aqtr.pax.inject`'s).
  """
  spec = spec_of(model)
  sessions = trace(model, abstract_call(model, variables, args, kwargs))
  return merge_report(spec, sessions, strict)


def merge_report(spec, sessions, strict) -> Report:
  # A transform may trace a module twice (linen's scan): one entry per op.
  seen: dict[str, tuple[OpEntry, tuple[int, ...]]] = {}
  for s in sessions:
    for e, matched in zip(s.entries, s.matched, strict=True):
      seen.setdefault(e.path, (e, matched))
  hits, wins = [0] * len(spec.rules), [0] * len(spec.rules)
  for e, matched in seen.values():
    for i in matched:
      hits[i] += 1
    if e.rule is not None:
      wins[e.rule] += 1
  entries = tuple(e for e, _ in seen.values())
  rep = Report(entries, spec.rules, tuple(wins), tuple(hits))
  if rep.unused_rules:
    msg = f'aqtr.flax: rules that set no op:\n{rep.unused_text()}'
    if strict:
      raise ValueError(msg)
    warnings.warn(msg, UserWarning, stacklevel=3)
  return rep


def _freeze_fn(use: WeightUse):
  """w (one op's weight) -> the holder entry of `use`'s op."""

  def freeze(w):
    store = []

    def dot(lhs, rhs, dn, precision, preferred):
      call = lifecycle.DotCall(
        lhs, rhs, dn, use.config, None, precision, preferred
      )
      out, fr = engine_dot(call, Mode.CONVERT, None, '')
      store.append(fr)
      return out

    other = jnp.zeros(use.other.shape, use.other.dtype)
    if use.side == 'lhs':
      use.call.run(swapped(dot), w, other)
    else:
      use.call.run(dot, other, w)
    return frozen_entry(use.config, store[0])

  return freeze


def _freeze_all(todo: dict) -> dict:
  """{where: {op key: entry}} of every weight in `todo`, in one jit."""
  fns = {
    where: {u.key: _freeze(u, w, where) for u in uses}
    for where, (uses, w, _, _) in todo.items()
  }
  weights = {where: w for where, (_, w, _, _) in todo.items()}

  def run(weights):
    return {
      where: {k: fn(weights[where]) for k, fn in ops.items()}
      for where, ops in fns.items()
    }

  return jax.jit(run)(weights)


def _freeze(use: WeightUse, w: jax.Array, where: str):
  """The function freezing `w` for `use` (vmapped over stacked axes)."""
  lead = jnp.ndim(w) - len(use.weight.shape)
  if lead < 0 or tuple(jnp.shape(w)[lead:]) != tuple(use.weight.shape):
    raise ValueError(
      f'aqtr.flax.convert: parameter {where} has shape {jnp.shape(w)}, but '
      f'its op read a weight of shape {use.weight.shape} (stacked axes must '
      'lead).'
    )
  fn = _freeze_fn(use)
  for _ in range(lead):
    fn = jax.vmap(fn)
  return lambda w: fn(w.astype(use.weight.dtype))


def convert(
  model,
  *args,
  variables=None,
  keep: str | None = None,
  check: bool = True,
  **kwargs,
):
  """Freezes a quantized model's weights for serving (PTQ if untrained).

  Records every weight op of one call (abstractly), quantizes each matched
  parameter once with its op's config (the 'weights' freezer: what TRAIN
  computes, so SERVE equals TRAIN bit for bit) and puts the frozen values
  in the parameter's place (`aqtr.flax.frozen`): the float kernel is gone
  from the serving tree. Stacked parameters (scan over layers) are frozen
  layer by layer (`jax.vmap` over their leading axes).

  Args:
    model: a quantized model in Mode.TRAIN.
    *args, **kwargs: sample inputs (shapes are what matters).
    variables: linen: the trained variables (nnx: the model holds them).
    keep: a regex over parameter paths ('/'-joined) to keep float (e.g.
      an embedding table that is also looked up): their ops quantize on
      the fly in SERVE.
    check: run the served and the trained model once on the sample inputs
      and raise unless they agree bit for bit (a frozen parameter that
      other code reads too, e.g. a tied embedding's lookup, would read
      zeros: keep it float with `keep`).

  Returns:
    nnx: the serving model (a new one; Mode.SERVE). linen: (serving
    module, serving variables).
  """
  spec = spec_of(model)
  if spec.mode is not Mode.TRAIN or spec.converted:
    raise ValueError(
      'aqtr.flax.convert: the model is already converted (Mode.SERVE); '
      'convert the trained model (Mode.TRAIN).'
    )
  if isinstance(model, nn.Module) and variables is None:
    raise TypeError('aqtr.flax.convert: a linen model needs variables=.')
  sessions = trace(model, abstract_call(model, variables, args, kwargs))
  merge_report(spec, sessions, strict=False)
  groups: dict[tuple, list[WeightUse]] = {}
  for s in sessions:
    for u in s.uses:
      groups.setdefault((*u.module_path, u.param), []).append(u)
  rx = None if keep is None else _keep_regex(keep)
  if isinstance(model, nnx.Module):
    served = nnx.clone(model)
    modules = dict(nnx.iter_modules(served))
  else:
    params = flax.core.unfreeze(variables['params'])
  todo = {}  # where -> (uses, weight, holder's parent, name)
  for path, uses in groups.items():
    where = '/'.join(map(str, path))
    if rx is not None and any(
      rx.fullmatch(s) for s in rules_lib.spellings(where)
    ):
      continue
    if len({u.weight.shape for u in uses}) > 1:
      continue  # read in several shapes: kept float (quantized on the fly)
    if isinstance(model, nnx.Module):
      parent = modules[path[:-1]]
      w = getattr(parent, path[-1]).get_value()
    else:
      parent = params
      for k in path[:-1]:
        parent = parent[k]
      w = nn.meta.unbox(parent[path[-1]])
    todo[where] = (uses, w, parent, path[-1])
  frozen = _freeze_all(todo)  # one compiled program for every weight
  for where, (uses, w, parent, name) in todo.items():
    ref = jax.tree.leaves(_entry_shapes(uses[0]))[0]
    shape, dtype = tuple(uses[0].weight.shape), jnp.dtype(w.dtype)
    if isinstance(model, nnx.Module):
      holder = FrozenKernel(
        frozen[where],
        kernel_shape=shape,
        kernel_dtype=dtype,
        ref_ndim=ref.ndim,
      )
      setattr(parent, name, holder)
    else:
      parent[name] = FrozenBox(
        frozen[where], shape=shape, dtype=dtype, ref_ndim=ref.ndim
      )
  frozen_paths = list(todo)
  if isinstance(model, nnx.Module):
    served = set_mode(served, Mode.SERVE, converted_=True)
    out = None
  else:
    out = dict(variables, params=params)
    served = set_mode(model, Mode.SERVE, converted_=True)
  if check:
    _check(model, variables, served, out, frozen_paths, args, kwargs)
  return served if out is None else (served, out)


def _keep_regex(keep) -> re.Pattern:
  """`convert`'s keep= as a compiled regex (one line when it is not)."""
  if not isinstance(keep, str):
    raise TypeError(
      f'aqtr.flax.convert: keep must be a regex string, got {keep!r}.'
    )
  try:
    return re.compile(keep)
  except re.error as e:
    raise ValueError(
      f'aqtr.flax.convert: keep={keep!r} is not a valid regex ({e}); fix '
      'it, or pass re.escape(path) to keep one literal parameter path.'
    ) from None


def _run(model, variables, args, kwargs):
  if isinstance(model, nnx.Module):
    return nnx.jit(lambda m: m(*args, **kwargs))(model)
  return jax.jit(lambda v: model.apply(v, *args, **kwargs))(variables)


def _check(model, variables, served, served_vars, frozen, args, kwargs):
  want = jax.tree.leaves(_run(model, variables, args, kwargs))
  got = jax.tree.leaves(_run(served, served_vars, args, kwargs))
  same = all(
    bool(jnp.array_equal(a, b, equal_nan=True))
    for a, b in zip(want, got, strict=True)
  )
  if not same:
    raise ValueError(
      'aqtr.flax.convert: the served model differs from the trained one on '
      'the sample inputs: a frozen parameter is also read outside its '
      f'quantized ops (frozen: {", ".join(frozen)}). Keep it float with '
      'keep=<regex>, or pass check=False.'
    )


def _entry_shapes(use: WeightUse):
  return jax.eval_shape(_freeze_fn(use), use.weight)


def sizes(served, variables=None) -> common.Report:
  """Bytes of a served model: float kernels removed, frozen, whole tree."""
  if isinstance(served, tuple) and len(served) == 2 and variables is None:
    served, variables = served  # linen: what convert returned
  if isinstance(served, nn.Module) and variables is None:
    raise TypeError(
      'aqtr.flax.sizes: a linen model needs variables= (the served '
      'variables aqtr.flax.convert returned with the module).'
    )
  if isinstance(served, nnx.Module):
    tree = nnx.state(served)
    holders = [
      v
      for _, m in nnx.iter_modules(served)
      for v in vars(m).values()
      if isinstance(v, FrozenKernel)
    ]
  else:
    tree = variables
    holders = [
      x
      for x in jax.tree.leaves(
        variables, is_leaf=lambda x: isinstance(x, FrozenBox)
      )
      if isinstance(x, FrozenBox)
    ]
  removed = sum(kernel_bytes(h) for h in holders)
  frozen = sum(common.nbytes(h.entries()) for h in holders)
  return common.Report(removed, frozen, common.nbytes(tree))


__all__ = ['convert', 'report', 'sizes']
