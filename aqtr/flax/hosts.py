"""The one place that picks a host for a model, and knows module kinds.

`of(model, variables)` returns the model's host (`aqtr.flax.host.Host`):
`NnxHost` for an nnx Module, `LinenHost` for a linen Module (with its
variables), and any kind registered with `register` (`aqtr.pax.host`
registers Pax templates). Features (convert, report, sizes, PTQ, LoRA,
checkpoints) ask the host and never test the model kind themselves.
Per module, interception asks here for a module's path (`path_of`, also
for a module bound in a nested `apply`, as Hugging Face Flax LMs bind
their tied head) and its own parameters (`own_params`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  >>> paths, jaxpr = of(m).trace_params(
  ...     type(m).__call__, (jnp.ones((1, 2)),), {})
  >>> paths
  [('bias',), ('kernel',)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flax import nnx

from aqtr.flax import kinds
from aqtr.flax.frozen import is_holder
from aqtr.flax.host import Host
from aqtr.flax.host_linen import LinenHost
from aqtr.flax.host_nnx import NnxHost

__all__ = ['Host', 'of', 'register', 'served']

# (predicate, host class, what to call such a model in errors) of the
# kinds registered beside nnx and linen.
_KINDS: list[tuple[Callable[[Any], bool], type, str]] = []


def register(predicate: Callable[[Any], bool], cls: type, name: str) -> None:
  """Makes `of` build `cls(model, variables)` for models `predicate` takes
  (`name`: the kind in errors, e.g. 'a Pax template')."""
  _KINDS.append((predicate, cls, name))


def of(model, variables=None, *, who: str = 'aqtr', need_variables=True):
  """The host of `model`.

  Args:
    model: an nnx Module, a linen Module, or a registered kind (a Pax
      template once `aqtr.pax` is imported).
    variables: linen / Pax: the model's variables.
    who: the caller, for the errors ('aqtr.flax.convert').
    need_variables: False: an unbound linen module or a Pax template
      without variables is fine (e.g. to copy it or switch its ops' mode);
      a bound linen module reads its scope's.

  Returns:
    The `Host`.

  Raises:
    TypeError: one line naming `who`, for another kind of model or a
      linen module without variables.
  """
  if isinstance(model, Host):
    return model
  if kinds.is_nnx(model):
    return NnxHost(model)
  if kinds.is_linen(model):
    if variables is None and need_variables and model.scope is None:
      raise TypeError(
        f'{who}: a linen model needs variables= (the variables to apply).'
      )
    return LinenHost(model, variables)
  for predicate, cls, name in _KINDS:
    if predicate(model):
      if variables is None and need_variables:
        raise TypeError(f'{who}: {name} needs variables=.')
      return cls(model, variables)
  raise TypeError(
    f'{who}: model must be a flax.linen or flax.nnx Module or a Pax '
    f'template, got {type(model).__name__}.'
  )


def served(served_model, variables=None, *, who: str = 'aqtr'):
  """The host of a served model: nnx model, or linen's (module, variables)
  as `aqtr.flax.convert` returned them (or module, variables= given)."""
  if (
    isinstance(served_model, tuple)
    and len(served_model) == 2
    and variables is None
  ):
    served_model, variables = served_model
  if kinds.is_linen(served_model) and variables is None:
    raise TypeError(
      f'{who}: a linen model needs variables= (the serving variables '
      'aqtr.flax.convert returned).'
    )
  return of(served_model, variables, who=who)


def path_of(module) -> tuple:
  """The module's path (linen: its scope path; nnx: set by `quantize`)."""
  if kinds.is_linen(module):
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
  if not kinds.is_linen(inner) or own:
    return own
  for i, outer in enumerate(stack[1:], 1):
    if kinds.is_bound(outer):
      if outer.scope.root is inner.scope.root:
        continue
      base = path_in_stack(stack[i:])
      if type(outer) is type(inner) and outer.name == inner.name:
        return base  # `outer.apply(...)` bound `inner`: its own path
      return (*base, inner.name or type(inner).__name__)
  return own


def call_prefix(model) -> tuple:
  """The path the ops of a call of `model` start from (linen: the bound
  module's scope path; nnx: the call's own root)."""
  return path_of(model) if kinds.is_linen(model) else ()


def scope_root(module):
  """A bound linen module's root scope (None for nnx or unbound)."""
  if kinds.is_bound(module):
    return module.scope.root
  return None


def own_params(module) -> dict:
  """{name: value} of the module's own parameters (arrays or holders)."""
  if kinds.is_linen(module):
    params = module.variables.get('params', {})
    return {
      k: module.get_variable('params', k)
      for k, v in params.items()
      if not isinstance(v, dict)
    }
  out = {}
  for k, v in vars(module).items():
    if is_holder(v):
      out[k] = v
    elif isinstance(v, nnx.Param):
      out[k] = v.get_value()
  return out
