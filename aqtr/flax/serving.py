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

import jax
import jax.numpy as jnp
import numpy as np

from aqtr import rules as rules_lib
from aqtr.core.boundary import fusion_fenced
from aqtr.core.dimension_numbers import RAGGED
from aqtr.core.ragged_dot import freeze_ragged
from aqtr.flax import common, hosts, intercept, rule_state
from aqtr.flax.finite import check_finite
from aqtr.flax.frozen import store_key
from aqtr.flax.quantized import set_mode, spec_of
from aqtr.flax.session import (
  Session,
  engine_run,
  frozen_entry,
  swapped,
)
from aqtr.flax.sites import WeightSite
from aqtr.freezers import Mode, lifecycle
from aqtr.rules import OpEntry, Report


def trace(model, fn) -> list[Session]:
  """The sessions of the quantized calls `fn` makes (abstractly)."""
  stack = intercept.context().observers
  got: list[Session] = []
  stack.append(got)
  try:
    fn()
  finally:
    stack.remove(got)
  return got


def abstract_call(
  model, variables, args, kwargs, method='__call__', who='aqtr.flax'
):
  """A thunk tracing one call of the model abstractly (no compute)."""
  host = hosts.of(model, variables, who=who)
  fn, state = host.call_fn(args, kwargs, method)
  return lambda: jax.eval_shape(fn, state)


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
  call = abstract_call(model, variables, args, kwargs, who='aqtr.flax.report')
  sessions = trace(model, call)
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


def _freeze_fn(use: WeightSite):
  """w (one op's weight) -> the holder entry of `use`'s op."""

  def freeze(w, kept=None):
    ragged = use.kind == 'ragged_dot'
    if ragged and not rule_state.keeps(use.config):
      parts = freeze_ragged(w, use.config, use.other.shape[-1])
      return frozen_entry(use.config, {'ragged': parts})
    store = []
    kept = kept or {}
    # Stochastic gradients only: CONVERT runs no backward pass, any key.
    need = rule_state.key_need(use.config, Mode.CONVERT)
    key = None if need is None else jax.random.key(0)
    if ragged:  # Per-expert state or static ranges: the life cycle's entry.
      groups = jnp.zeros(use.weight.shape[:1], jnp.int32)
      call = lifecycle.DotCall(
        jnp.zeros(use.other.shape, use.other.dtype),
        w,
        RAGGED,
        use.config,
        key,
        use.op.extra['precision'],
        use.op.extra['preferred_element_type'],
        kept.get('state'),
        groups,
      )
      r = engine_run(call, Mode.CONVERT, None, '', stats=kept.get('stats'))
      return frozen_entry(use.config, r.frozen)

    def dot(lhs, rhs, dn, precision, preferred):
      call = lifecycle.DotCall(
        lhs, rhs, dn, use.config, key, precision, preferred, kept.get('state')
      )
      r = engine_run(call, Mode.CONVERT, None, '', stats=kept.get('stats'))
      store.append(r.frozen)
      return r.out

    other = jnp.zeros(use.other.shape, use.other.dtype)
    if use.side == 'lhs':
      use.op.run(swapped(dot), w, other)
    else:
      use.op.run(dot, other, w)
    return frozen_entry(use.config, store[0])

  return freeze


def _freeze_all(todo: dict, states: dict) -> dict:
  """{where: {op key: entry}} of every weight in `todo`, in one jit;
  `states`: {where: {op key: calibration state}} of stateful ops."""
  fns = {
    where: {u.key: _freeze(u, w, where) for u in uses}
    for where, (uses, w, _) in todo.items()
  }
  weights = {where: w for where, (_, w, _) in todo.items()}

  def run(weights, states):
    return {
      where: {
        k: fn(weights[where], states.get(where, {}).get(k))
        for k, fn in ops.items()
      }
      for where, ops in fns.items()
    }

  return jax.jit(run)(weights, states)


def _freeze(use: WeightSite, w: jax.Array, where: str):
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
  return lambda w, state=None: fn(w.astype(use.weight.dtype), state)


def convert(
  model,
  *args,
  variables=None,
  keep: str | None = None,
  check: bool = True,
  **kwargs,
):
  """Freezes a quantized model's weights for serving (PTQ if untrained).

  Records every weight op of one call (abstractly) and quantizes each
  matched weight once with its op's config (the 'weights' freezer: what
  TRAIN computes, so SERVE equals TRAIN). A parameter read only by weight
  operands of quantized ops is replaced by a holder of its frozen values
  (`aqtr.flax.frozen`): the float kernel is gone from the serving tree;
  stacked parameters (scan over layers) are frozen layer by layer
  (`jax.vmap` over their leading axes). A weight derived from a parameter
  (`x @ table.T`) or a parameter also read elsewhere (a tied embedding
  looked up too) keeps the parameter; its op's frozen values go in the
  model's op store. Inside a loop body (scan, while) such ops quantize on
  the fly in SERVE.

  Args:
    model: a quantized model in Mode.TRAIN.
    *args, **kwargs: sample inputs (shapes are what matters).
    variables: linen: the trained variables (nnx: the model holds them).
    keep: a regex over parameter paths ('/'-joined) to keep float: their
      ops quantize on the fly in SERVE.
    check: run the served and the trained model once under `jit` on the
      sample inputs and compare (`check_served`: on CPU bit for bit or an
      error; off CPU a fusion-order difference of a few ULP warns).

  Returns:
    nnx: the serving model (a new one; Mode.SERVE). linen: (serving
    module, serving variables). A Pax template (`aqtr.pax.inject`ed, with
    `variables=`): (serving template in Mode.SERVE, serving variables). An
    nnx model holding `aqtr.flax.nnx` ops: a served copy (their CONVERT).
    A linen model holding `aqtr.flax.linen` ops (built in any mode): (the
    same model with every op in SERVE, `aqtr.flax.linen_convert.
    with_ops_mode`, serving variables); their CONVERT froze the values.
  """
  host = hosts.of(model, variables, who='aqtr.flax.convert')
  if host.by_injection or not hasattr(type(model), 'aqtr_spec'):
    # A Pax template (its injected ops freeze) or a model holding aqtr's
    # own nnx / linen ops (they freeze themselves).
    if keep is not None:
      raise ValueError(
        'aqtr.flax.convert: keep= selects parameters of a model quantized '
        'by rules; leave the op out of the rules (Pax: inject) instead.'
      )
    done = host.freeze_ops(args, kwargs)
    if check:
      check_served(host, done, args, kwargs)
    return done.result()
  spec = spec_of(model)
  if spec.mode is not Mode.TRAIN or spec.converted:
    raise ValueError(
      'aqtr.flax.convert: the model is already converted (Mode.SERVE); '
      'convert the trained model (Mode.TRAIN).'
    )
  rx = _keep_regex(keep)
  sessions = trace(model, abstract_call(model, variables, args, kwargs))
  merge_report(spec, sessions, strict=False)
  groups: dict[tuple, list[WeightSite]] = {}
  float_read: set[tuple] = set()  # read by an op that stays float
  for s in sessions:
    for u in s.uses:
      groups.setdefault(u.param_path, []).append(u)
    for e in s.entries:
      w = s.weights.get(e.path)
      if w is not None and e.config is None:
        float_read.add(w.param_path)
  todo, derived, empty = {}, set(), {}
  for path, uses in groups.items():
    where = '/'.join(map(str, path))
    if rx is not None and any(
      rx.fullmatch(x) for x in rules_lib.spellings(where)
    ):
      continue
    check_finite(host.read_param(path), 'aqtr.flax.convert', where)
    whole = (
      path not in float_read
      and all(u.direct and not u.elsewhere for u in uses)
      and len({u.weight.shape for u in uses}) == 1
    )
    if whole:
      todo[where] = (uses, host.read_param(path), path)
      continue
    derived |= {u.op_path for u in uses if not u.in_loop}
    if path not in float_read and not any(
      u.elsewhere or u.in_loop for u in uses
    ):
      # Read only through derived weights of quantized ops (GPT-2's
      # `kernel.transpose()`): their frozen values are in the op store, so
      # the float parameter leaves the tree (an empty holder).
      w = host.read_param(path)
      empty[path] = ({}, tuple(jnp.shape(w)), jnp.dtype(w.dtype), jnp.ndim(w))
  states = {
    where: {
      u.key: rule_state.kept(model, variables, u)
      for u in uses
      if u.state_at is not None
    }
    for where, (uses, _, _) in todo.items()
  }
  frozen = _freeze_all(todo, states)  # one program for every weight
  holders = {}
  for where, (uses, w, path) in todo.items():
    st = states[where].get(uses[0].key)
    ref = jax.tree.leaves(_entry_shapes(uses[0], st, jnp.ndim(w)))[0]
    shape, dtype = tuple(uses[0].weight.shape), jnp.dtype(w.dtype)
    holders[path] = (frozen[where], shape, dtype, ref.ndim)
  holders.update(empty)
  ops = _freeze_ops(model, variables, args, kwargs, derived)
  done = host.with_frozen(holders, ops)
  done.model = set_mode(done.model, Mode.SERVE, converted_=True)
  if check:
    check_served(host, done, args, kwargs)
  return done.result()


def _keep_regex(keep) -> re.Pattern | None:
  """`convert`'s keep= as a compiled regex (one line when it is not)."""
  if keep is None:
    return None
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


class _Freezer(list):
  """An observer: has each new Session freeze the ops in `wanted`."""

  def __init__(self, wanted):
    super().__init__()
    self.wanted = wanted

  def append(self, session) -> None:
    session.freeze = self.wanted
    super().append(session)


def _freeze_ops(model, variables, args, kwargs, wanted: set) -> dict:
  """The op store: frozen values of the ops in `wanted`, from their own
  weight operands, in one jitted TRAIN call of the model."""
  if not wanted:
    return {}
  fn, state = hosts.of(model, variables).call_fn(args, kwargs)
  stack = intercept.context().observers

  def run(state):
    got = _Freezer(wanted)
    stack.append(got)
    try:
      fn(state)
    finally:
      stack.remove(got)
    out = {}
    for s in got:
      for where, entry in s.collected.items():
        out.setdefault(store_key(where), {}).update(entry)
    return out

  return jax.jit(run)(state)


FUSION_ULP = 64  # the largest fusion-order difference `check` accepts


def check_served(trained: hosts.Host, served: hosts.Host, args, kwargs):
  """Compares the served model's jitted outputs with the trained model's.

  Equal: nothing. On CPU they must be equal bit for bit: both programs
  compute the same function of the same stored codes and scales, and the
  forward puts the scales behind a fusion boundary that XLA keeps
  (`aqtr.core.boundary`), so XLA fuses the rescale after each dot alike in
  both (the optimized HLO after the boundary is the same). One thing still
  moves last bits there: XLA:CPU's concurrency-optimized scheduler orders
  each program's instructions on its own (TRAIN has the quantization's
  too), and the numbers of the same HLO depend on that order (a Hugging
  Face Llama, 4 layers, int4 weights: 3-6 ULP; equal bit for bit with
  `--xla_cpu_enable_concurrency_optimized_scheduler=false`); the error
  says so. Elsewhere that boundary is an `optimization_barrier`, which XLA
  may drop before fusion; LLVM / the GPU compiler may then contract a
  multiply and the add after it into one fused multiply-add in one
  program and not the other: within `FUSION_ULP` units in the last place
  (of the largest output), a `UserWarning` naming the distance. Any other
  difference: a ValueError.
  """
  want = jax.tree.leaves(trained.run_jit(args, kwargs))
  got = jax.tree.leaves(served.run_jit(args, kwargs))
  bad = [
    (a, b)
    for a, b in zip(want, got, strict=True)
    if not bool(jnp.array_equal(a, b, equal_nan=True))
  ]
  if not bad:
    return
  ulp = max(_ulps(a, b) for a, b in bad)
  if ulp <= FUSION_ULP and not fusion_fenced():
    warnings.warn(
      'aqtr.flax.convert: the served model differs from the trained one on '
      f'the sample inputs by up to {ulp} ULP (of the largest output) under '
      f'jit: on {jax.default_backend()}, XLA may fuse the two programs '
      'differently (a fused multiply-add in one of them); each op serves '
      'what it trains.',
      UserWarning,
      stacklevel=3,
    )
    return
  hint = ''
  if ulp <= FUSION_ULP and jax.default_backend() == 'cpu':
    hint = (
      " (XLA:CPU's concurrency-optimized scheduler orders the two programs "
      'differently and can move last bits: with XLA_FLAGS=--xla_cpu_enable_'
      'concurrency_optimized_scheduler=false they should agree)'
    )
  raise ValueError(
    'aqtr.flax.convert: the served model differs from the trained one on '
    f'the sample inputs by up to {ulp} ULP (of the largest output) under '
    f'jit{hint}; pass check=False to accept it, and report the model to aqtr.'
  )


def _ulps(a, b) -> int:
  """max |a - b| in units in the last place of max |a| (rounded up).

  Measured against the largest output, not element by element: a value
  near zero that moves by a rounding of its neighbours is not millions of
  its own ULP apart.
  """
  a, b = np.asarray(a), np.asarray(b)
  if not np.issubdtype(a.dtype, np.floating):
    return int(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
  if not (np.isfinite(a).all() and np.isfinite(b).all()):
    return np.iinfo(np.int64).max
  a64, b64 = a.astype(np.float64), b.astype(np.float64)
  unit = np.spacing(np.max(np.abs(a)).astype(a.dtype)).astype(np.float64)
  return int(
    np.ceil(np.max(np.abs(a64 - b64)) / max(unit, np.finfo(a.dtype).tiny))
  )


def _entry_shapes(use: WeightSite, state=None, ndim=None):
  """The shapes of one layer's entry (`state`: maybe stacked, `ndim`:
  the stacked weight's rank)."""
  lead = 0 if ndim is None else ndim - len(use.weight.shape)
  state = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(jnp.shape(x)[lead:], x.dtype), state
  )
  return jax.eval_shape(_freeze_fn(use), use.weight, state)


def sizes(served, variables=None) -> common.Report:
  """Bytes of a served model: float kernels removed, frozen, whole tree.

  Args:
    served: a converted model (`convert`).
    variables: linen: the serving variables `convert` returned.
  """
  host = hosts.served(served, variables, who='aqtr.flax.sizes')
  weights = host.frozen_weights()
  removed = sum(b for b, _ in weights)
  frozen = common.nbytes([p for _, p in weights])
  frozen += common.nbytes(host.stored_ops())
  return common.Report(removed, frozen, common.nbytes(host.state()))


__all__ = ['convert', 'report', 'sizes']
