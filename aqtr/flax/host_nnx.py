"""The host protocol (`aqtr.flax.host`) for nnx Modules.

The model holds its variables; frozen weights are `Frozen` holder variables
in place of the kernel and the op store is the model's `aqtr_frozen`
attribute (`aqtr.flax.frozen`); `result()` is the model.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> h = NnxHost(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  >>> h.read_param(('kernel',)).shape
  (2, 3)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from aqtr.flax import host, intercept
from aqtr.flax import nnx as nnx_ops
from aqtr.flax.frozen import STORE, Frozen, is_holder, store_key

__all__ = ['NnxHost']


def _node(model, path):
  for k in path:
    model = model[k] if isinstance(k, int) else getattr(model, k)
  return model


class NnxHost(host.Host):
  """An nnx Module (see `aqtr.flax.host.Host`)."""

  def fresh_copy(self, who: str = 'aqtr') -> nnx.Module:
    """A copy to quantize: interception retargeted, module paths set."""
    model = nnx.clone(self.model)
    intercept.retarget(model)
    for path, m in nnx.iter_modules(model):
      m.aqtr_path = tuple(path)
    return model

  def mode_copy(self) -> nnx.Module:
    """The model whose mode to switch (in place for nnx)."""
    return self.model

  def freeze_ops(self, args, kwargs) -> NnxHost:
    """A served copy of a model holding `aqtr.flax.nnx` ops (their own
    CONVERT, `aqtr.flax.nnx.convert`, on a clone)."""
    if not nnx_ops.ops(self.model):
      return super().freeze_ops(args, kwargs)
    model = nnx.clone(self.model)
    nnx_ops.convert(model, *args, **kwargs)
    return NnxHost(model)

  def ops_in_mode(self, mode):
    if not nnx_ops.ops(self.model):
      return super().ops_in_mode(mode)
    return nnx_ops.set_mode(self.model, mode)

  def call_fn(self, args, kwargs, method='__call__'):
    graphdef, state = nnx.split(self.model)

    def call_nnx(state):
      return getattr(nnx.merge(graphdef, state), method)(*args, **kwargs)

    return call_nnx, state

  def trace_params(self, raw, args, kwargs):
    arrays, rebuild = host.split_inputs(args, kwargs)
    graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    paths = [host.leaf_names(p) for p, _ in flat]
    leaves = [host.abstract(v) for _, v in flat]
    ptree = jax.tree.structure(params)
    rest = jax.tree.map(host.abstract, rest)

    def fn(pleaves, rest, arrays):
      m = nnx.merge(graphdef, jax.tree.unflatten(ptree, pleaves), rest)
      a, k = rebuild(arrays)
      return raw(m, *a, **k)

    return paths, jax.make_jaxpr(fn)(leaves, rest, arrays)

  def signature(self, raw, args, kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    inputs = tuple(host.aval_key(x) for x in leaves)
    try:
      graphdef, state = nnx.split(self.model)
      key = (raw, graphdef, tree, inputs, host.tree_key(state))
      hash(key)
    except TypeError:
      return None
    return key

  def params(self) -> dict[tuple, Any]:
    state = nnx.state(self.model, nnx.Param)
    return {
      tuple(path): v.get_value()
      for path, v in nnx.to_flat_state(state)
      if not isinstance(v, Frozen)
    }

  def with_params(self, params: Mapping[tuple, Any]) -> NnxHost:
    model = nnx.clone(self.model)
    for path, value in params.items():
      _node(model, path).set_value(value)
    return NnxHost(model)

  def param_tree(self) -> dict:
    return nnx.to_pure_dict(nnx.state(self.model, nnx.Param))

  def with_param_tree(self, tree) -> NnxHost:
    model = nnx.clone(self.model)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, tree)
    nnx.update(model, state)
    return NnxHost(model)

  def tree_path(self, path) -> tuple:
    return tuple(path)

  def read_param(self, path):
    return _node(self.model, path).get_value()

  def holders(self):
    return [
      ((*mpath, name), v)
      for mpath, m in nnx.iter_modules(self.model)
      for name, v in vars(m).items()
      if is_holder(v)
    ]

  def with_frozen(self, holders, ops) -> NnxHost:
    served = nnx.clone(self.model)
    for path, (entries, shape, dtype, ref_ndim) in holders.items():
      holder = Frozen.holder(
        entries, shape=shape, dtype=dtype, ref_ndim=ref_ndim
      )
      setattr(_node(served, path[:-1]), path[-1], holder)
    if ops:
      setattr(served, STORE, Frozen(ops))
    return NnxHost(served)

  def put_frozen(self, op_path, holder, entry, parts):
    mpath, param, key = holder
    h = getattr(_node(self.model, mpath), param)
    if not is_holder(h) or key not in h.entries():
      # Kept float, or read through a derived weight: the op store has it.
      store = getattr(self.model, STORE)
      entries = jax.tree.map(lambda x: x, store.get_value())
      entries[store_key(op_path)][key][entry]['rhs'] = parts
      store.set_value(entries)
      return
    entries = jax.tree.map(lambda x: x, h.entries())
    entries[key][entry]['rhs'] = parts
    h.set_raw_value(entries)

  def clone(self) -> nnx.Module:
    return nnx.clone(self.model)

  def leaf(self, path):
    v = _node(self.model, path)
    return v if is_holder(v) else v.get_value()

  def set_leaf(self, path, value) -> None:
    parent = _node(self.model, path[:-1])
    old = getattr(parent, path[-1], None)
    if isinstance(value, nnx.Variable):
      setattr(parent, path[-1], value)
    elif isinstance(old, nnx.Param):
      old.set_value(value)
    else:  # a holder goes back to a float parameter
      setattr(parent, path[-1], nnx.Param(value))

  def leaves(self):
    state = nnx.state(self.model, nnx.Any(nnx.Param, Frozen))
    return [
      (tuple(p), v if is_holder(v) else v.get_value())
      for p, v in nnx.to_flat_state(state)
      if is_holder(v) or not isinstance(v, Frozen)
    ]

  def remove_param(self, path) -> None:
    delattr(_node(self.model, path[:-1]), path[-1])

  def add_param(self, path, value, variable_type) -> None:
    setattr(_node(self.model, path[:-1]), path[-1], variable_type(value))

  def set_holder(self, path, entries) -> None:
    getattr(_node(self.model, path[:-1]), path[-1]).set_raw_value(entries)

  def abstract(self, fn) -> NnxHost:
    return NnxHost(nnx.eval_shape(lambda m: fn(NnxHost(m)).model, self.model))

  def stored_ops(self) -> dict:
    v = getattr(self.model, STORE, None)
    return v.get_value() if isinstance(v, Frozen) else {}

  def frozen_weights(self):
    return super().frozen_weights() + nnx_ops.frozen_kernels(self.model)

  def module_store(self, mpath, name):
    var = getattr(_node(self.model, mpath), name, None)
    return None if var is None else var.get_value()

  def state(self):
    return nnx.state(self.model)

  def result(self):
    return self.model
