"""The host protocol (`aqtr.flax.host`) for linen Modules.

A linen model is a module plus its variables; frozen weights are
`FrozenBox`es in the 'params' collection at the kernel's name and the op
store is the collection 'aqtr_frozen' (`aqtr.flax.frozen`); `result()` is
(module, variables). Inside a call the host of the bound module reads its
variables from its scope.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn
  >>> m = nn.Dense(3)
  >>> h = LinenHost(m, m.init(jax.random.key(0), jnp.ones((1, 2))))
  >>> sorted(h.params())
  [('bias',), ('kernel',)]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import flax
import flax.linen as nn
import jax

from aqtr.flax import host, linen_convert
from aqtr.flax.common import STATE
from aqtr.flax.frozen import STORE, FrozenBox, is_holder, store_key
from aqtr.freezers import Mode

__all__ = ['LinenHost', 'unbound']


def _is_box(x) -> bool:
  # A holder; a kernel an explicit op removed reads as zeros, like a param.
  return is_holder(x)


def unbound(model: nn.Module) -> nn.Module:
  """An unbound deep copy of a (maybe bound) linen module."""
  return model.clone(parent=None, _deep_clone=True, _reset_names=True)


def _flat_params(variables) -> dict[tuple, Any]:
  params = flax.core.unfreeze(variables.get('params', {}))
  return flax.traverse_util.flatten_dict(
    params, is_leaf=lambda _, x: _is_box(x)
  )


class LinenHost(host.Host):
  """A linen Module and its variables (see `aqtr.flax.host.Host`)."""

  def fresh_copy(self, who: str = 'aqtr') -> nn.Module:
    """A copy to quantize (the module must be unbound)."""
    if self.model.scope is not None:
      raise TypeError(f'{who}: pass an unbound linen Module.')
    return self.model.copy()

  def mode_copy(self) -> nn.Module:
    """The model whose mode to switch (a copy for linen)."""
    return self.model.copy()

  def freeze_ops(self, args, kwargs) -> LinenHost:
    """The served model of a linen model built from `aqtr.flax.linen` ops:
    their own CONVERT (`linen_convert.convert`, run with every op in
    CONVERT), then the same model with every op in SERVE."""
    convert = linen_convert.with_ops_mode(self.model, Mode.CONVERT)
    serving = linen_convert.serving_or_none(
      convert, self._variables(), *args, **kwargs
    )
    if serving is None:
      return super().freeze_ops(args, kwargs)
    return LinenHost(
      linen_convert.with_ops_mode(self.model, Mode.SERVE), serving
    )

  def ops_in_mode(self, mode):
    return linen_convert.with_ops_mode(self.model, mode)

  def call_fn(self, args, kwargs, method='__call__'):
    model, variables = self.model, self.variables
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

  def _variables(self) -> dict:
    if self.variables is not None:
      return dict(self.variables)
    return dict(self.model.variables)  # bound: its scope's

  def trace_params(self, raw, args, kwargs):
    arrays, rebuild = host.split_inputs(args, kwargs)
    variables = self._variables()
    params = variables.pop('params', {})
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]
    pleaves = [(p, v) for p, v in flat if not _is_box(v)]
    boxes = [(p, v) for p, v in flat if _is_box(v)]
    paths = [host.leaf_names(p) for p, _ in pleaves]
    leaves = [host.abstract(v) for _, v in pleaves]
    rest = jax.tree.map(host.abstract, (variables, [v for _, v in boxes]))
    ptree = jax.tree.structure(params, is_leaf=_is_box)
    kinds = [_is_box(v) for _, v in flat]
    scope = self.model.scope
    rngs = {name: jax.random.key(0) for name in getattr(scope, 'rngs', {})}
    free = unbound(self.model)

    def fn(pleaves, rest, arrays):
      others, boxed = rest
      it, ib = iter(pleaves), iter(boxed)
      got = [next(ib) if k else next(it) for k in kinds]
      v = dict(others, params=jax.tree.unflatten(ptree, got))
      a, k = rebuild(arrays)
      # By name when it is one: linen's method wrapper (compact names) runs.
      named = getattr(type(free), raw.__name__, None) is not None
      method = raw.__name__ if named else functools.partial(_call, raw)
      out, _ = free.apply(v, *a, method=method, rngs=rngs, mutable=True, **k)
      return out

    return paths, jax.make_jaxpr(fn)(leaves, rest, arrays)

  def signature(self, raw, args, kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    inputs = tuple(host.aval_key(x) for x in leaves)
    try:
      state = jax.tree.map(host.aval_key, self._variables())
      key = (raw, unbound(self.model), tree, inputs, host.tree_key(state))
      hash(key)
    except TypeError:
      return None
    return key

  def params(self) -> dict[tuple, Any]:
    return {
      path: nn.meta.unbox(v)
      for path, v in _flat_params(self._variables()).items()
      if not _is_box(v)
    }

  def with_params(self, params: Mapping[tuple, Any]) -> LinenHost:
    variables = flax.core.unfreeze(self._variables())
    for path, value in params.items():
      node = variables['params']
      for k in path[:-1]:
        node = node[k]
      old = node[path[-1]]
      if isinstance(old, nn.meta.AxisMetadata):
        value = old.replace_boxed(value)
      node[path[-1]] = value
    return LinenHost(self.model, variables)

  def param_tree(self) -> dict:
    return dict(self._variables())

  def with_param_tree(self, tree) -> LinenHost:
    return LinenHost(self.model, dict(tree))

  def tree_path(self, path) -> tuple:
    return ('params', *path)

  def read_param(self, path):
    node = self._variables()['params']
    for k in path:
      node = node[k]
    return nn.meta.unbox(node)

  def holders(self):
    return [
      (path, v)
      for path, v in _flat_params(self._variables()).items()
      if _is_box(v)
    ]

  def with_frozen(self, holders, ops) -> LinenHost:
    variables = self._variables()
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
    return LinenHost(self.model, out)

  def put_frozen(self, op_path, holder, entry, parts):
    mpath, param, key = holder
    self.variables = flax.core.unfreeze(self.variables)
    node = self.variables['params']
    for k in mpath:
      node = node[k]
    box = node[param]
    if not _is_box(box) or key not in box.entries():
      # Kept float, or read through a derived weight: the op store has it.
      ops = self.variables[STORE]['ops']
      ops[store_key(op_path)][key][entry]['rhs'] = parts
      return
    entries = jax.tree.map(lambda x: x, box.entries())
    entries[key][entry]['rhs'] = parts
    node[param] = box.replace(frozen=entries)

  def clone(self) -> nn.Module:
    return self.model.copy()

  def _parent(self, path) -> dict:
    self.variables = flax.core.unfreeze(self._variables())
    node = self.variables['params']
    for k in path[:-1]:
      node = node[k]
    return node

  def leaf(self, path):
    v = self._parent(path)[path[-1]]
    return v if _is_box(v) else nn.meta.unbox(v)

  def set_leaf(self, path, value) -> None:
    self._parent(path)[path[-1]] = value

  def leaves(self):
    return [
      (p, v if _is_box(v) else nn.meta.unbox(v))
      for p, v in _flat_params(self._variables()).items()
    ]

  def remove_param(self, path) -> None:
    self._parent(path).pop(path[-1])

  def add_param(self, path, value, variable_type) -> None:
    del variable_type  # linen parameters are plain arrays in 'params'
    self._parent(path)[path[-1]] = value

  def set_holder(self, path, entries) -> None:
    self.variables = flax.core.unfreeze(self.variables)
    node = self.variables['params']
    for k in path[:-1]:
      node = node[k]
    node[path[-1]] = node[path[-1]].replace(frozen=entries)

  def stored_ops(self) -> dict:
    if self.variables is not None:
      return dict(self.variables.get(STORE, {})).get('ops', {})
    model = self.model
    if model.scope is not None and model.has_variable(STORE, 'ops'):
      return model.get_variable(STORE, 'ops')
    return {}

  def frozen_weights(self):
    explicit = linen_convert.frozen_kernels(self._variables())
    return super().frozen_weights() + explicit

  def module_store(self, mpath, name):
    variables = self._variables()
    node = variables.get(name, variables.get('params', {}))
    for k in mpath:
      node = node.get(k) if hasattr(node, 'get') else None
    if name not in variables and hasattr(node, 'get'):
      node = node.get(name)
    return node

  def state(self):
    return self._variables()

  def result(self):
    return self.model, self.variables


def _call(raw, module, *args, **kwargs) -> Any:
  return raw(module, *args, **kwargs)
