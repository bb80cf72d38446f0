"""The one place that knows linen from nnx for intercepted stock models.

Everything interception needs from a model kind lives here: a module's
path (`path_of`, also for a module bound in a nested `apply`, as Hugging
Face Flax LMs bind their tied head), its own parameters (`own_params`),
and `trace_params`: the model's call traced to a jaxpr with its
parameters as explicit inputs, for `aqtr.flax.provenance` to decide which
operands are weights. Features (the session, convert, report) ask these
functions and never test the model kind themselves.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> paths, jaxpr = trace_params(
  ...     m, type(m).__call__, (jnp.ones((1, 2)),), {})
  >>> paths
  [('bias',), ('kernel',)]
"""

from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from aqtr.flax import intercept
from aqtr.flax.common import STATE
from aqtr.flax.frozen import STORE, FrozenBox, FrozenKernel, FrozenOps

__all__ = [
  'call_fn',
  'fresh_copy',
  'frozen_holders',
  'is_linen',
  'mode_copy',
  'own_params',
  'path_of',
  'path_in_stack',
  'read_param',
  'run_jit',
  'scope_root',
  'signature',
  'state_of',
  'stored_ops',
  'trace_params',
  'with_frozen',
]


def is_linen(model) -> bool:
  """Whether `model` is a linen Module (else nnx)."""
  return isinstance(model, nn.Module)


def path_of(module) -> tuple:
  """The module's path (linen: its scope path; nnx: set by `quantize`)."""
  if isinstance(module, nn.Module):
    return tuple(module.path)
  return tuple(getattr(module, 'aqtr_path', ()))


def path_in_stack(stack: list) -> tuple:
  """The path of `stack[0]` (innermost first) within the model called.

  A linen module bound in a nested `apply` (`self.lm_head.apply({'params':
  {'kernel': embedding.T}}, x)`) has an empty scope path of its own: it is
  named after the module that applied it, plus its name there.
  """
  if not stack:
    return ()
  inner = stack[0]
  own = path_of(inner)
  if not isinstance(inner, nn.Module) or own:
    return own
  for i, outer in enumerate(stack[1:], 1):
    if isinstance(outer, nn.Module) and outer.scope is not None:
      if outer.scope.root is inner.scope.root:
        continue
      base = path_in_stack(stack[i:])
      if type(outer) is type(inner) and outer.name == inner.name:
        return base  # `outer.apply(...)` bound `inner`: its own path
      return (*base, inner.name or type(inner).__name__)
  return own


def scope_root(module):
  """A bound linen module's root scope (None for nnx or unbound)."""
  if isinstance(module, nn.Module) and module.scope is not None:
    return module.scope.root
  return None


def fresh_copy(model, who: str):
  """A copy of a float model to quantize (nnx: paths set on its modules).

  Raises a TypeError naming `who` unless `model` is an unbound linen or
  an nnx Module.
  """
  if isinstance(model, nnx.Module):
    model = nnx.clone(model)
    intercept.retarget(model)
    for path, m in nnx.iter_modules(model):
      m.aqtr_path = tuple(path)
    return model
  if isinstance(model, nn.Module):
    if model.scope is not None:
      raise TypeError(f'{who}: pass an unbound linen Module.')
    return model.copy()
  raise TypeError(
    f'{who}: model must be a flax.linen or flax.nnx Module, got '
    f'{type(model).__name__}.'
  )


def mode_copy(model):
  """The model to switch mode on (linen: a copy; nnx: in place)."""
  return model.copy() if isinstance(model, nn.Module) else model


def own_params(module) -> dict:
  """{name: value} of the module's own parameters (arrays or holders)."""
  if isinstance(module, nn.Module):
    params = module.variables.get('params', {})
    return {
      k: module.get_variable('params', k)
      for k, v in params.items()
      if not isinstance(v, dict)
    }
  out = {}
  for k, v in vars(module).items():
    if isinstance(v, FrozenKernel):
      out[k] = v
    elif isinstance(v, nnx.Param):
      out[k] = v.get_value()
  return out


def _names(keypath) -> tuple:
  out = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
  return tuple(out)


def _abstract(x):
  if isinstance(x, jax.Array) or hasattr(x, '__jax_array__'):
    x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x


def _is_array(x) -> bool:
  return isinstance(x, jax.Array | jax.ShapeDtypeStruct) or (
    hasattr(x, 'shape') and hasattr(x, 'dtype') and hasattr(x, 'ndim')
  )


def _split_inputs(args, kwargs):
  """(array leaves, rebuild(arrays) -> (args, kwargs)) of a call's inputs."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, x in enumerate(leaves) if _is_array(x)]

  def rebuild(arrays):
    got = list(leaves)
    for i, a in zip(where, arrays, strict=True):
      got[i] = a
    return jax.tree.unflatten(tree, got)

  return [_abstract(leaves[i]) for i in where], rebuild


def trace_params(model, raw, args, kwargs):
  """(parameter leaf paths, jaxpr) of `raw(model, *args, **kwargs)`.

  The jaxpr's first inputs are the parameter leaves (their paths, module
  path then name, are returned in that order), then the other variables
  and the array inputs. Frozen holders are not parameters. Run it with
  an interception handler active that marks operands
  (`aqtr.flax.provenance.mark`).
  """
  arrays, rebuild = _split_inputs(args, kwargs)
  if isinstance(model, nn.Module):
    return _trace_linen(model, raw, arrays, rebuild)
  return _trace_nnx(model, raw, arrays, rebuild)


def signature(model, raw, args, kwargs):
  """A hashable key of a call (None when something in it is unhashable).

  Two calls with the same key trace to the same jaxpr: the model's
  structure and static attributes, the shapes and dtypes of its variables
  and of the array inputs, and the other inputs by value.
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  inputs = tuple(_aval_key(x) for x in leaves)
  try:
    if isinstance(model, nn.Module):
      state = jax.tree.map(_aval_key, dict(model.variables))
      key = (raw, _unbound(model), tree, inputs, _tree_key(state))
    else:
      graphdef, state = nnx.split(model)
      key = (raw, graphdef, tree, inputs, _tree_key(state))
    hash(key)
  except TypeError:
    return None
  return key


def _unbound(model):
  return model.clone(parent=None, _deep_clone=True, _reset_names=True)


def _aval_key(x):
  if _is_array(x):
    return ('array', tuple(x.shape), str(x.dtype))
  return x


def _tree_key(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(_aval_key(x) for x in leaves)


def _trace_nnx(model, raw, arrays, rebuild):
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  paths = [_names(p) for p, _ in flat]
  leaves = [_abstract(v) for _, v in flat]
  ptree = jax.tree.structure(params)
  rest = jax.tree.map(_abstract, rest)

  def fn(pleaves, rest, arrays):
    m = nnx.merge(graphdef, jax.tree.unflatten(ptree, pleaves), rest)
    a, k = rebuild(arrays)
    return raw(m, *a, **k)

  return paths, jax.make_jaxpr(fn)(leaves, rest, arrays)


def _is_box(x) -> bool:
  return isinstance(x, FrozenBox)


def _trace_linen(model, raw, arrays, rebuild):
  variables = dict(model.variables)
  params = variables.pop('params', {})
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
  pleaves = [(p, v) for p, v in flat if not _is_box(v)]
  boxes = [(p, v) for p, v in flat if _is_box(v)]
  paths = [_names(p) for p, _ in pleaves]
  leaves = [_abstract(v) for _, v in pleaves]
  rest = jax.tree.map(_abstract, (variables, [v for _, v in boxes]))
  ptree = jax.tree.structure(params, is_leaf=_is_box)
  kinds = [_is_box(v) for _, v in flat]
  names = getattr(model.scope, 'rngs', {})
  rngs = {name: jax.random.key(0) for name in names}
  unbound = _unbound(model)

  def fn(pleaves, rest, arrays):
    others, boxed = rest
    it, ib = iter(pleaves), iter(boxed)
    got = [next(ib) if k else next(it) for k in kinds]
    v = dict(others, params=jax.tree.unflatten(ptree, got))
    a, k = rebuild(arrays)
    # By name when it is one: linen's method wrapper (compact names) runs.
    named = getattr(type(unbound), raw.__name__, None) is not None
    method = raw.__name__ if named else functools.partial(_call, raw)
    out, _ = unbound.apply(v, *a, method=method, rngs=rngs, mutable=True, **k)
    return out

  return paths, jax.make_jaxpr(fn)(leaves, rest, arrays)


def _call(raw, module, *args, **kwargs) -> Any:
  return raw(module, *args, **kwargs)


def stored_ops(model) -> dict:
  """The model's op store (`aqtr.flax.frozen`): {op key: {...}} or {}."""
  if isinstance(model, nn.Module):
    if model.scope is not None and model.has_variable(STORE, 'ops'):
      return model.get_variable(STORE, 'ops')
    return {}
  v = getattr(model, STORE, None)
  return v.get_value() if isinstance(v, FrozenOps) else {}


def read_param(model, variables, path: tuple):
  """The float value of the parameter at `path` (module path, name)."""
  if isinstance(model, nn.Module):
    node = variables['params']
    for k in path:
      node = node[k]
    return nn.meta.unbox(node)
  node = model
  for k in path:
    node = node[k] if isinstance(k, int) else getattr(node, k)
  return node.get_value()


def call_fn(model, variables, args, kwargs, method='__call__'):
  """A thunk running one call of the model (for `jax.eval_shape` / jit)."""
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)

    def call_nnx(state):
      return getattr(nnx.merge(graphdef, state), method)(*args, **kwargs)

    return call_nnx, state
  # Calibration state: TRAIN updates it. A key for configs rounding their
  # gradients stochastically (these forward-only calls draw none).
  mutable = [STATE] if STATE in (variables or {}) else False
  spec = getattr(type(model), 'aqtr_spec', None)
  rngs = None if spec is None else {spec.rng_stream: jax.random.key(0)}

  def call_linen(v):
    out = model.apply(
      v, *args, method=method, mutable=mutable, rngs=rngs, **kwargs
    )
    return out[0] if mutable else out

  return call_linen, variables


def with_frozen(model, variables, holders: dict, ops: dict):
  """(model, variables) with frozen holders and the op store put in.

  Args:
    model, variables: the quantized model (nnx: variables unused).
    holders: parameter path -> (entries, kernel shape, dtype, ref_ndim):
      the parameter is replaced by a holder (`aqtr.flax.frozen`).
    ops: the op store's content ({store key: {op key: entries}}).

  Returns:
    nnx: (a new model, None); linen: (the model, new variables).
  """
  if isinstance(model, nnx.Module):
    served = nnx.clone(model)
    for path, (entries, shape, dtype, ref_ndim) in holders.items():
      parent = served
      for k in path[:-1]:
        parent = parent[k] if isinstance(k, int) else getattr(parent, k)
      holder = FrozenKernel(
        entries, kernel_shape=shape, kernel_dtype=dtype, ref_ndim=ref_ndim
      )
      setattr(parent, path[-1], holder)
    if ops:
      setattr(served, STORE, FrozenOps(ops))
    return served, None
  params = flax.core.unfreeze(variables['params'])
  for path, (entries, shape, dtype, ref_ndim) in holders.items():
    parent = params
    for k in path[:-1]:
      parent = parent[k]
    parent[path[-1]] = FrozenBox(
      entries, shape=shape, dtype=dtype, ref_ndim=ref_ndim
    )
  out = dict(variables, params=params)
  if ops:
    out[STORE] = {'ops': ops}
  return model, out


def run_jit(model, variables, args, kwargs):
  """One call of the model under `jit` (its outputs).

  The array inputs are arguments of the jitted function, as in a serving
  loop (closed over, XLA would fold what depends on them alone).
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, x in enumerate(leaves) if _is_array(x)]

  def run(state, arrays):
    got = list(leaves)
    for i, a in zip(where, arrays, strict=True):
      got[i] = a
    a, k = jax.tree.unflatten(tree, got)
    fn, _ = call_fn(model, variables, a, k)
    return fn(state)

  _, state = call_fn(model, variables, args, kwargs)
  return jax.jit(run)(state, [leaves[i] for i in where])


def frozen_holders(model, variables) -> list:
  """The frozen holders in a served model's tree."""
  if isinstance(model, nnx.Module):
    return [
      v
      for _, m in nnx.iter_modules(model)
      for v in vars(m).values()
      if isinstance(v, FrozenKernel)
    ]
  return [
    x
    for x in jax.tree.leaves(variables, is_leaf=_is_box)
    if isinstance(x, FrozenBox)
  ]


def state_of(model, variables):
  """The whole tree a served model holds (nnx: its state)."""
  return nnx.state(model) if isinstance(model, nnx.Module) else variables
