"""The host protocol: what every feature needs from a model, once per kind.

A host wraps one model (a linen Module with its variables, an nnx Module,
a Pax template with its variables) and answers, for every feature above
it (`aqtr.flax.convert`, `report`, `sizes`, the PTQ calibration pass and
solvers, `aqtr.lora`, `aqtr.checkpoints`), the same questions in the same
conventions:

  fresh_copy     a copy of the float model to quantize by rules
  mode_copy      the model whose interception mode to switch
  program        a pure function `(state, *inputs) -> outputs` and its state
  call_fn        one call with given inputs, as `(fn(state), state)`
  run_jit        that call under `jit`, inputs as arguments
  trace_params   the call as a jaxpr with the parameters as explicit inputs
  signature      a hashable key of a call (same key, same jaxpr)
  params         the float parameters, {path tuple: array}
  with_params    a host of the same model holding other float parameters
  param_tree     the float parameters as one nested dict (fold maps, PTQ)
  read_param     one parameter's float value
  holders        the frozen holders, [(path tuple, holder)]
  with_frozen    a host whose parameters are replaced by frozen holders
  freeze_ops     the served model of a model whose own ops freeze (Pax)
  ops_in_mode    the model with its own ops (explicit, injected) in a mode
  set_holder     put entries in one frozen holder (checkpoint import)
  leaf, leaves, set_leaf, add_param, remove_param
                 read / replace / add what sits at a parameter path (LoRA)
  abstract       run a host -> host function abstractly (shapes only)
  put_frozen     replace one frozen op's stored values (PTQ solvers)
  stored_ops     the op store's content
  state          every array the model holds (what `sizes` counts)
  result         what a feature returns: nnx: the model; linen and Pax:
                 (module or template, variables)

Implemented once per kind: `aqtr.flax.host_nnx.NnxHost`,
`aqtr.flax.host_linen.LinenHost`, `aqtr.pax.host.TemplateHost`;
`aqtr.flax.hosts.of(model, variables)` is the one place that picks one.
Features never test the model kind themselves.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.flax import hosts
  >>> h = hosts.of(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
  >>> sorted(h.params())
  [('bias',), ('kernel',)]
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

import flax.core
import jax
import jax.numpy as jnp

from aqtr.flax.frozen import kernel_bytes
from aqtr.freezers import Mode

__all__ = [
  'Host',
  'abstract',
  'aval_key',
  'is_array',
  'leaf_names',
  'split_inputs',
  'tree_key',
]


class Host(abc.ABC):
  """One model seen by aqtr's features (see the module docstring).

  Attributes:
    model: the model (nnx Module, linen Module, Pax template).
    variables: linen / Pax: its variables (nnx: None, the model holds them).
  """

  # Rules reach the model's ops by injection into its template
  # (`aqtr.pax.inject`), not by interception (`aqtr.flax.quantize`).
  by_injection: bool = False

  def __init__(self, model: Any, variables: Any = None):
    self.model, self.variables = model, variables

  def fresh_copy(self, who: str = 'aqtr') -> Any:
    """A copy of the float model to quantize by rules."""
    raise TypeError(
      f'{who}: a {type(self.model).__name__} is quantized by injection '
      '(aqtr.pax.inject), not by interception rules.'
    )

  def mode_copy(self) -> Any:
    """The model whose mode to switch (nnx: itself; linen: a copy)."""
    raise TypeError(f'{type(self.model).__name__}: no interception mode.')

  # -- calls ----------------------------------------------------------------
  @abc.abstractmethod
  def call_fn(
    self, args: tuple, kwargs: Mapping, method: str = '__call__'
  ) -> tuple[Callable[[Any], Any], Any]:
    """(fn(state) -> outputs of one call, the model's state)."""

  def program(self, method: str = '__call__'):
    """(fn(state, *args, **kwargs) -> outputs, state): the pure model."""
    _, state = self.call_fn((), {}, method)

    def fn(state, *args, **kwargs):
      return self.call_fn(args, kwargs, method)[0](state)

    return fn, state

  def run_jit(self, args: tuple, kwargs: Mapping):
    """One call under `jit`, its array inputs as arguments (as a serving
    loop passes them; closed over, XLA would fold input-only work)."""
    arrays, rebuild = split_inputs(args, kwargs, abstract_=False)

    def run(state, arrays):
      a, k = rebuild(arrays)
      return self.call_fn(a, k)[0](state)

    _, state = self.call_fn(args, kwargs)
    return jax.jit(run)(state, arrays)

  @abc.abstractmethod
  def trace_params(self, raw, args: tuple, kwargs: Mapping):
    """(parameter leaf paths, jaxpr) of `raw(model, *args, **kwargs)`.

    The jaxpr's first inputs are the parameter leaves (paths: module path
    then name, in that order), then the other variables and the array
    inputs. Frozen holders are not parameters.
    """

  @abc.abstractmethod
  def signature(self, raw, args: tuple, kwargs: Mapping):
    """A hashable key of a call (None when something is unhashable)."""

  # -- parameters -------------------------------------------------------------
  @abc.abstractmethod
  def params(self) -> dict[tuple, Any]:
    """{parameter path: float value} (frozen holders excluded)."""

  @abc.abstractmethod
  def with_params(self, params: Mapping[tuple, Any]) -> Host:
    """A host of a copy of the model whose float parameters at the given
    paths are replaced (the others kept)."""

  @abc.abstractmethod
  def param_tree(self) -> dict:
    """The float parameters as one nested dict, as fold maps and solvers
    name them (nnx: the pure dict of its Params; linen / Pax: the
    variables, 'params/...')."""

  @abc.abstractmethod
  def with_param_tree(self, tree: Mapping) -> Host:
    """A host of a copy of the model holding `tree` (`param_tree`'s
    layout)."""

  @abc.abstractmethod
  def tree_path(self, path: tuple) -> tuple:
    """The `param_tree` path of the parameter at `path`."""

  def read_param(self, path: tuple):
    """The float value of the parameter at `path`."""
    got = self.params()
    if tuple(path) not in got:
      raise KeyError(f'no float parameter at {"/".join(map(str, path))}')
    return got[tuple(path)]

  # -- frozen values ----------------------------------------------------------
  @abc.abstractmethod
  def holders(self) -> list[tuple[tuple, Any]]:
    """[(parameter path, frozen holder)] of a served model."""

  @abc.abstractmethod
  def with_frozen(self, holders: Mapping, ops: Mapping) -> Host:
    """A host of the served model.

    Args:
      holders: parameter path -> (entries, kernel shape, dtype, ref_ndim):
        the parameter becomes a frozen holder (`aqtr.flax.frozen`).
      ops: the op store's content ({store key: {op key: entries}}).
    """

  @abc.abstractmethod
  def clone(self) -> Any:
    """A copy of the model (nnx: `nnx.clone`; linen: the module copied)."""

  @abc.abstractmethod
  def leaf(self, path: tuple) -> Any:
    """What sits at parameter `path`: the float array, or a frozen holder."""

  @abc.abstractmethod
  def set_leaf(self, path: tuple, value: Any) -> None:
    """Puts `value` (an array or a holder) at `path`, in place."""

  @abc.abstractmethod
  def leaves(self) -> list[tuple[tuple, Any]]:
    """[(path, float array or frozen holder)] of every parameter."""

  @abc.abstractmethod
  def remove_param(self, path: tuple) -> None:
    """Removes the parameter at `path`, in place."""

  @abc.abstractmethod
  def add_param(self, path: tuple, value: Any, variable_type: type) -> None:
    """Adds a new parameter at `path`, in place (nnx: a `variable_type`
    Variable, e.g. LoRA's `Adapter`; linen: in 'params')."""

  @abc.abstractmethod
  def set_holder(self, path: tuple, entries: Mapping) -> None:
    """Puts `entries` in the frozen holder at `path` (in place)."""

  def abstract(self, fn: Callable[[Host], Host]) -> Host:
    """`fn(self)` run abstractly: the host it returns, arrays as shapes
    (e.g. a serving tree to fill from a checkpoint, no compute).

    This default serves hosts that keep (model, variables): the model `fn`
    returns is kept aside, its variables traced by `jax.eval_shape`.
    """
    box = []

    def run(v):
      done = fn(type(self)(self.model, v))
      box.append(done.model)
      return done.variables

    out = jax.eval_shape(run, self.variables)
    return type(self)(box[0], flax.core.unfreeze(out))

  def freeze_ops(self, args: tuple, kwargs: Mapping) -> Host:
    """The served model of a model whose own ops freeze (injected Pax ops
    switched to CONVERT, then SERVE; `aqtr.flax.nnx` ops' own CONVERT)."""
    raise ValueError(
      f'{type(self.model).__name__} is not quantized: call '
      'aqtr.flax.quantize(model, rules) first.'
    )

  def ops_in_mode(self, mode: Mode) -> Any:
    """The model with its own aqtr ops in `mode` (nnx: in place; linen:
    a copy, `aqtr.flax.linen_convert.with_ops_mode`; Pax: a template
    copy)."""
    del mode
    raise ValueError(
      f'{type(self.model).__name__} is not quantized: call '
      'aqtr.flax.quantize(model, rules) first.'
    )

  @abc.abstractmethod
  def put_frozen(self, op_path: str, holder: tuple, entry: str, parts):
    """Replaces the stored rhs `parts` of one frozen op, in place.

    Args:
      op_path: the op's path ('layer/dense/dot_general0').
      holder: (module path, parameter name, op key) of the parameter
        whose holder keeps the op's entries (Pax: ()).
      entry: the freezer entry's name (`aqtr.freezers.lifecycle`).
      parts: the new rhs parts ({'qvalue', 'scale', ...}).
    """

  @abc.abstractmethod
  def stored_ops(self) -> dict:
    """The op store's content ({} when there is none)."""

  def frozen_weights(self) -> list[tuple[int, Any]]:
    """(bytes of the float kernel, its frozen arrays) per frozen weight:
    the holders `convert` put in (and the kernels explicit aqtr ops
    removed)."""
    return [(kernel_bytes(h), h.entries()) for _, h in self.holders()]

  @abc.abstractmethod
  def module_store(self, mpath: tuple, name: str) -> Any:
    """The value a module keeps under `name` (rule ops' state), or None.

    nnx: the module's Variable attribute `name`. linen: the module's part
    of the collection `name` when the variables have one, else its
    parameter `name` (learned calibration parameters live with 'params').
    """

  @abc.abstractmethod
  def state(self) -> Any:
    """Every array the model holds."""

  @abc.abstractmethod
  def result(self) -> Any:
    """nnx: the model; linen / Pax: (module or template, variables)."""


def is_array(x) -> bool:
  """An array or an abstract array (anything with shape, dtype, ndim)."""
  return isinstance(x, jax.Array | jax.ShapeDtypeStruct) or (
    hasattr(x, 'shape') and hasattr(x, 'dtype') and hasattr(x, 'ndim')
  )


def abstract(x):
  """The ShapeDtypeStruct of an array (anything else unchanged)."""
  if isinstance(x, jax.Array) or hasattr(x, '__jax_array__'):
    x = jnp.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  if hasattr(x, 'shape') and hasattr(x, 'dtype'):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)
  return x


def split_inputs(args, kwargs, abstract_: bool = True):
  """(array leaves, rebuild(arrays) -> (args, kwargs)) of a call's inputs."""
  leaves, tree = jax.tree.flatten((args, kwargs))
  where = [i for i, x in enumerate(leaves) if is_array(x)]

  def rebuild(arrays):
    got = list(leaves)
    for i, a in zip(where, arrays, strict=True):
      got[i] = a
    return jax.tree.unflatten(tree, got)

  pick = abstract if abstract_ else (lambda x: x)
  return [pick(leaves[i]) for i in where], rebuild


def leaf_names(keypath) -> tuple:
  """A key path as names and indices."""
  out = []
  for k in keypath:
    if isinstance(k, jax.tree_util.DictKey):
      out.append(k.key)
    elif isinstance(k, jax.tree_util.SequenceKey):
      out.append(k.idx)
  return tuple(out)


def aval_key(x):
  """A hashable stand-in for an array: ('array', shape, dtype)."""
  if is_array(x):
    return ('array', tuple(x.shape), str(x.dtype))
  return x


def tree_key(tree):
  """A hashable key of a tree of arrays (structure, shapes, dtypes)."""
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple(aval_key(x) for x in leaves)
