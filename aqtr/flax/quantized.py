"""Quantize a stock Flax model by rules, without editing its code.

`quantize(model, rules)` returns a copy of a linen or nnx model whose
matched ops run through aqtr: every `lax.dot_general`, `jnp.einsum`,
`jnp.matmul` / `@`, `jnp.dot`, `lax.conv_general_dilated` and
`lax.ragged_dot` executed inside a module whose path (or an ancestor's) a
rule matches (`aqtr.rules.Rule`, first match wins) becomes `aqtr`'s op with
the rule's config (`aqtr.flax.intercept` catches the calls). An operand
computed from the model's parameters alone (a parameter, its transpose,
an `astype`, a slice ...; `aqtr.flax.analysis` decides on the jaxpr, the
same under every transform) is the weight; the config's `rhs` quantizes
it (operands are swapped when the weight is the lhs). The parameter
tree is the float model's: a float checkpoint loads.

Modes (`aqtr.Mode`): TRAIN quantizes on the fly (QAT: forward and both
gradients); `convert(model, ...)` runs CONVERT once (`aqtr.freezers`'
'weights' freezer: int8 / int4 / fp8 values + scales, exactly TRAIN's
quantization) and puts the frozen values in place of each matched float
kernel, or in the model's op store (`aqtr.flax.frozen`); the returned
model serves (SERVE) bit for bit equal to TRAIN. Stochastic rounding
draws its keys, and stateful calibrations keep their state, in the
model's Flax variables (`aqtr.flax.rule_state`).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from aqtr.rules import Rule
  >>> q = quantize(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), [Rule('int8')])
  >>> q(jnp.ones((2, 4))).shape
  (2, 8)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
from flax import nnx

from aqtr import rules as rules_lib
from aqtr.flax import analysis, common, hosts, intercept, kinds, rule_state
from aqtr.flax.session import Session, Spec
from aqtr.freezers import Mode, lifecycle


def intercepting(method, session, who: str, hint: str):
  """`method` with `session(...)`'s interception active for its duration.

  Args:
    method: the model class's method (a plain function, maybe wrapped by
      flax's method handler).
    session: (model, the weights of this call (`aqtr.flax.analysis`)) ->
      the handler of its intercepted ops.
    who: the caller, for the error ('aqtr.flax.quantize').
    hint: the error's remedy.
  """
  raw = method
  while hasattr(raw, 'method_handler_wrapped'):
    raw = raw.__wrapped__
  if not inspect.isfunction(raw):
    raise TypeError(
      f'{who}: {getattr(raw, "__qualname__", raw)!r} is not a plain Python '
      f'function ({type(raw).__name__}, e.g. already jitted): its float ops '
      f'are captured and interception cannot run. {hint}'
    )

  @functools.wraps(raw)
  def call(self, *args, aqtr_key=None, **kwargs):
    if intercept.is_active():
      return raw(self, *args, **kwargs)
    weights = analysis.analyze(self, raw, args, kwargs)
    s = session(self, weights)
    s.root = self
    spec = getattr(type(self), 'aqtr_spec', None)
    if spec is not None:
      s.base_key = rule_state.base_key(self, spec, aqtr_key)
      if any(rule_state.needs_state(c) for c in spec.configs):
        s.traced = rule_state.traced(self)
    with intercept.active(s):
      return raw(self, *args, **kwargs)

  return call


def _intercepting(method):
  return intercepting(
    method,
    lambda model, weights: Session(
      type(model).aqtr_spec,
      weights,
      stored=hosts.of(model, need_variables=False).stored_ops(),
    ),
    'aqtr.flax.quantize',
    'Quantize the module before wrapping it in jax.jit / nnx.jit.',
  )


def _subclass(base: type, spec: Spec) -> type:
  ns = {'aqtr_spec': spec, 'aqtr_base': base}
  for name in spec.methods:
    if not isinstance(name, str) or not callable(getattr(base, name, None)):
      raise ValueError(
        f'aqtr.flax.quantize: methods= names {name!r}, which is not a method '
        f'of {base.__name__}; name the methods that start a model call, '
        "e.g. methods=('__call__',)."
      )
    ns[name] = _intercepting(getattr(base, name))
  return type(base.__name__, (base,), ns)


def _spec(rules, methods, rng_stream=rule_state.STREAM) -> Spec:
  rules = rules_lib.as_rules(rules, 'aqtr.flax.quantize')
  configs = []
  for i, r in enumerate(rules):
    c = rules_lib.built(rules_lib.resolve(r.config), f'rule {i} {r.label()}')
    if c is not None:
      lifecycle.validate(c)
    configs.append(c)
  if not isinstance(rng_stream, str) or not rng_stream:
    raise TypeError(
      f'aqtr.flax.quantize: rng_stream must be a stream name, got '
      f"{rng_stream!r}; e.g. rng_stream='aqtr'."
    )
  return Spec(
    rules, tuple(configs), Mode.TRAIN, tuple(methods), rng_stream=rng_stream
  )


def quantize(
  model,
  rules,
  *,
  methods=('__call__',),
  rngs=None,
  rng_stream: str = rule_state.STREAM,
):
  """A copy of `model` (linen or nnx) whose matched ops run quantized.

  Args:
    model: a linen Module (unbound) or an nnx Module, built from stock
      layers and raw JAX ops; it is not changed.
    rules: `aqtr.rules.Rule`s in priority order (or one, or {path regex:
      config}); the first that matches an op sets its config.
    methods: the methods that start a model call (interception is active
      for their duration, covering every submodule they run).
    rngs: nnx only: an `nnx.Rngs` with the stream `rng_stream`, kept by
      the model (attribute `aqtr_rngs`) for stochastic rounding: one draw
      per call (linen: pass `rngs={rng_stream: key}` to apply).
    rng_stream: the stream of stochastic rounding's keys ('aqtr'). A call
      may pass `aqtr_key=key` instead.

  Returns:
    The quantized model in Mode.TRAIN: the same class name and parameter
    tree; train it as the float model.

  Raises:
    ValueError: a rule's config does not build or is invalid, or `model`
      is already quantized.
    TypeError: `model` is no Flax module, or a method cannot be
      intercepted (already jitted).
  """
  intercept.check_targets()
  if hasattr(type(model), 'aqtr_spec'):
    raise ValueError(
      f'aqtr.flax.quantize: {type(model).__name__} is already quantized; '
      'quantize the float model again, or use aqtr.flax.set_mode.'
    )
  spec = _spec(rules, methods, rng_stream)
  who = 'aqtr.flax.quantize'
  model = hosts.of(model, who=who, need_variables=False).fresh_copy(who)
  if rngs is not None:
    if kinds.is_linen(model) or not isinstance(rngs, nnx.Rngs):
      raise TypeError(
        'aqtr.flax.quantize: rngs= takes an nnx.Rngs for an nnx model; '
        f"linen models get keys from apply(..., rngs={{'{rng_stream}': key}})."
      )
    if rng_stream not in rngs:
      raise ValueError(
        f'aqtr.flax.quantize: rngs has no stream {rng_stream!r}; pass '
        f'nnx.Rngs({rng_stream}=seed).'
      )
    model.aqtr_rngs = rngs
  model.__class__ = _subclass(type(model), spec)
  return model


def spec_of(model):
  spec = getattr(type(model), 'aqtr_spec', None)
  if spec is None:
    raise ValueError(
      f'{type(model).__name__} is not quantized: call aqtr.flax.quantize.'
    )
  return spec


def set_mode(model, mode: Mode, *, converted_=None):
  """`model` (quantized) in `mode` (nnx: in place; returns the model).

  A model quantized by rules switches its interception mode. A model
  built from aqtr's own ops (`aqtr.flax.nnx`, `aqtr.flax.linen`, injected
  Pax templates) switches every op (its host's `ops_in_mode`): nnx in
  place, linen a copy whose ops read the mode off its class, Pax a copy
  of the template.
  """
  common.check_mode(mode)
  if not hasattr(type(model), 'aqtr_spec'):
    host = hosts.of(model, who='aqtr.flax.set_mode', need_variables=False)
    return host.ops_in_mode(mode)
  if mode not in (Mode.TRAIN, Mode.CALIBRATE, Mode.SERVE):
    raise ValueError(
      f'mode: interception runs Mode.TRAIN, CALIBRATE and SERVE, got {mode}; '
      'CONVERT is aqtr.flax.convert(model, ...).'
    )
  spec = spec_of(model)
  converted = spec.converted if converted_ is None else converted_
  spec = dataclasses.replace(spec, mode=mode, converted=converted)
  model = hosts.of(model, need_variables=False).mode_copy()
  model.__class__ = _subclass(type(model).aqtr_base, spec)
  return model


def calibrate(model, batches, *, variables=None):
  """Records static ranges: runs `model` in Mode.CALIBRATE on `batches`.

  Ops whose config freezes a side with the 'calibration' freezer
  (`aqtr.freezers.configure(cfg, lhs='calibration')`) keep the running
  mean of its bound (nnx: `aqtr.flax.nnx.Stats` variables 'aqtr_stats';
  linen: the collection 'aqtr_stats'); `convert` freezes it, so SERVE
  quantizes those activations with a static scale. Stateful calibrations
  update their state too. Each batch runs under `jit`.

  Args:
    model: a quantized model in Mode.TRAIN.
    batches: an iterable of inputs: an array, or a tuple of the call's
      positional arguments.
    variables: linen: the model's variables (nnx: unused).

  Returns:
    nnx: the model (updated in place, back in Mode.TRAIN). linen: the new
    variables.

  Example:
    >>> import jax.numpy as jnp, aqtr
    >>> from flax import nnx
    >>> cfg = aqtr.freezers.configure(aqtr.presets.int8(), lhs='calibration')
    >>> q = quantize(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), [rules_lib.Rule(cfg)])
    >>> q = calibrate(q, [jnp.ones((2, 4))])
    >>> int(q.aqtr_stats.get_value()['dot_general0']['lhs']['count'])
    1
  """
  spec = spec_of(model)
  if spec.mode is not Mode.TRAIN or spec.converted:
    raise ValueError(
      'aqtr.flax.calibrate: calibrate the quantized model in Mode.TRAIN '
      '(before aqtr.flax.convert).'
    )
  linen = kinds.is_linen(model)
  if linen and variables is None:
    raise TypeError('aqtr.flax.calibrate: a linen model needs variables=.')
  cal = set_mode(model, Mode.CALIBRATE)
  n = 0
  try:
    if linen:
      cols = [common.STATS, common.STATE]
      step = jax.jit(lambda v, a: cal.apply(v, *a, mutable=cols)[1])
    else:
      step = nnx.jit(lambda m, a: m(*a))
    for batch in batches:
      args = batch if isinstance(batch, tuple) else (batch,)
      if linen:
        variables = {**variables, **step(variables, args)}
      else:
        step(cal, args)
      n += 1
  finally:
    if not linen:
      set_mode(cal, Mode.TRAIN)
  if n == 0:
    raise ValueError(
      'aqtr.flax.calibrate: batches is empty; pass sample inputs.'
    )
  return variables if linen else model


__all__ = ['calibrate', 'intercepting', 'quantize', 'set_mode', 'spec_of']
