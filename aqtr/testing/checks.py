"""Checks shared by the registry contracts: build, static argument, errors.

No pytest: a failed check raises `ContractError` (an AssertionError, so a
test runner reports it as a failure) with a message saying what to fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import fiddle as fdl
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from aqtr import numerics
from aqtr.core.config import DotGeneralConfig, DotGeneralRaw, TensorConfig
from aqtr.core.dot_general import dot_general
from aqtr.core.quantizer import fake_quant
from aqtr.core.registry import UnknownNameError


class ContractError(AssertionError):
  """A registered class breaks its family's contract."""


@contextlib.contextmanager
def raises(*types):
  """Like `pytest.raises(types)`; yields a list that receives the error."""
  got = []
  try:
    yield got
  except types as e:
    got.append(e)
  else:
    raise ContractError(f'expected one of {types} to be raised')


_FLOAT = TensorConfig(numerics=numerics.NoNumerics())
# (lhs shape, rhs shape, dimension numbers). Sizes suit default tilings (the
# first dot's M, N, K, contracted by its backward passes, too).
DOTS = (
  ((128, 256), (256, 128), (((1,), (0,)), ((), ()))),
  ((2, 4, 16, 16), (2, 16, 16, 3), (((2, 3), (1, 2)), ((0,), (0,)))),
)


def check_builds(cls, base):
  """Builds from fdl.Config with defaults; hashable; equal when rebuilt."""
  assert issubclass(cls, base)
  assert cls.__dataclass_params__.frozen
  built = fdl.build(fdl.Config(cls))
  rebuilt = fdl.build(fdl.Config(cls))
  assert type(built) is cls
  assert built == rebuilt == cls()
  assert hash(built) == hash(rebuilt)
  assert {built: 'v'}[rebuilt] == 'v'
  with raises(dataclasses.FrozenInstanceError):
    built.an_attribute = 1
  return built


def check_static_arg(cls, use, x):
  """A static jit argument; an equal, rebuilt instance hits the cache.

  Args:
    cls: the class under test.
    use: `use(instance, x) -> array`, traced under jit.
    x: the array argument.
  """
  traces = []

  @functools.partial(jax.jit, static_argnums=0)
  def f(a, x):
    traces.append(a)
    return use(a, x)

  a = f(fdl.build(fdl.Config(cls)), x)
  b = f(fdl.build(fdl.Config(cls)), x)
  assert len(traces) == 1, 'an equal instance retraced: __hash__/__eq__?'
  np.testing.assert_array_equal(a, b)


def check_bad_fields(cls, bad_fields, *, family, base):
  """Each bad-field example raises TypeError/ValueError naming its fields.

  Args:
    cls: the class under test.
    bad_fields: list of kwargs dicts, or None when there are no examples.
    family: the registry name, for messages.
    base: the family base class; fields it declares need no examples.
  """
  if bad_fields is None:
    raise ContractError(
      f'{family} {cls.__qualname__} has no bad-field examples: add an entry '
      'for its registered name to your BAD_FIELDS table ([] only if it has '
      'no fields of its own).'
    )
  fields = {f.name for f in dataclasses.fields(cls) if f.init}
  inherited = {f.name for f in dataclasses.fields(base)}
  if fields - inherited and not bad_fields:
    raise ContractError(
      f'{family} {cls.__qualname__} has fields '
      f'{sorted(fields - inherited)} but no bad-field examples: add some to '
      'your BAD_FIELDS table.'
    )
  for kwargs in bad_fields:
    unknown = set(kwargs) - fields
    assert not unknown, f'BAD_FIELDS example {kwargs}: no field {unknown}'
    for build in (cls, lambda **kw: fdl.build(fdl.Config(cls, **kw))):
      with raises(TypeError, ValueError) as err:
        build(**kwargs)
      for field in kwargs:
        assert field in str(err[0]), (kwargs, str(err[0]))


def _fake_quant_dot(x, w, dn, t):
  """The reference: fake quant on both operands, then lax.dot_general."""
  (lc, rc), (lb, rb) = dn
  fx = fake_quant(x, t, contracting_axes=lc, batch_axes=lb)
  fw = fake_quant(w, t, contracting_axes=rc, batch_axes=rb)
  return lax.dot_general(fx, fw, dn)


def _engine(x, w, dn, fwd, bwd):
  raw = DotGeneralRaw
  # Numerics not meant for gradients (nf4) quantize only the residuals.
  g = bwd if bwd.numerics.for_gradients else _FLOAT
  cfg = DotGeneralConfig(
    fwd=raw(lhs=fwd, rhs=fwd),
    dlhs=raw(lhs=g, rhs=bwd, use_fwd_quant=True),
    drhs=raw(lhs=g, rhs=bwd, use_fwd_quant=True),
  )
  return dot_general(x, w, dn, cfg)


def _value_and_grads(f, x, w, g):
  out, vjp = jax.vjp(f, x, w)
  return (out, *vjp(g))


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _run_dot(x, w, g, dn, t, t_po2, quantized_bwd):
  """Engine and reference values and gradients, in one compilation."""
  r = {
    'engine': _value_and_grads(
      lambda x, w: _engine(x, w, dn, t, _FLOAT), x, w, g
    ),
    'reference': _value_and_grads(
      lambda x, w: _fake_quant_dot(x, w, dn, t), x, w, g
    ),
    'engine_po2': _engine(x, w, dn, t_po2, _FLOAT),
    'reference_po2': _fake_quant_dot(x, w, dn, t_po2),
  }
  if quantized_bwd:  # Every pass quantized by `t` (the gradient operand too).
    r['quantized_bwd'] = _value_and_grads(
      lambda x, w: _engine(x, w, dn, t, t), x, w, g
    )
  return r


def check_in_engine(t, t_po2, *, exact, dots=DOTS):
  """`t` on both forward operands of dot_general vs the reference.

  The reference is fake quant on both operands, then lax.dot_general. With
  float backward passes that reuse the forward quantization, the engine's
  VJP is autodiff of that reference. Gradients with `t` on every pass (the
  gradient operand too) are finite (first dot only).

  Args:
    t: the TensorConfig under test.
    t_po2: the same with power-of-two scales.
    exact: whether the forward with `t_po2` must match bit for bit.
    dots: (lhs shape, rhs shape, dimension numbers) to run; the first one
      also runs with `t` on every pass.
  """
  for seed, (lshape, rshape, dn) in enumerate(dots):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(lshape, np.float32))
    w = jnp.asarray(rng.standard_normal(rshape, np.float32))
    out = jax.eval_shape(lambda x, w, dn=dn: lax.dot_general(x, w, dn), x, w)
    g = jnp.asarray(rng.standard_normal(out.shape, np.float32))
    r = _run_dot(x, w, g, dn, t, t_po2, seed == 0)
    (out, dx, dw), (rout, rdx, rdw) = r['engine'], r['reference']
    np.testing.assert_allclose(out, rout, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(dx, rdx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-5)
    for a in (dx, dw, *r.get('quantized_bwd', ())):
      assert jnp.isfinite(a).all()
    if exact:
      np.testing.assert_array_equal(r['engine_po2'], r['reference_po2'])
    else:
      np.testing.assert_allclose(
        r['engine_po2'], r['reference_po2'], rtol=1e-5, atol=1e-4
      )


def check_registry(module, base, unknown):
  """names() sorted, each resolving to its class; unknown names listed."""
  names = module.names()
  assert names == tuple(sorted(names)) and names
  for name in names:
    cls = module.get(name)
    assert issubclass(cls, base)
    assert cls.registered_name == name
    assert name in module.registry
  with raises(UnknownNameError) as err:
    module.get(unknown)
  assert isinstance(err[0], KeyError)
  assert repr(unknown) in str(err[0])
  assert module.registry.family in str(err[0])
  for name in names:
    assert name in str(err[0])


def run_all(checks, cls, bad_fields) -> None:
  """Runs every check of a family on `cls` (stops at the first failure)."""
  for check in checks:
    check(cls, bad_fields)
