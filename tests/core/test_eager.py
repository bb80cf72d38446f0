"""`core.eager.compiled_when_eager`: one program per eager call."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import aqtr
from aqtr.core import codecs
from aqtr.core.eager import compiled_when_eager
from aqtr.numerics import Nf4

COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'


@contextlib.contextmanager
def compiles():
  """Counts XLA compiles in the block: `with compiles() as n: ...; n[0]`."""
  n = [0]

  def listener(event, duration, **kw):
    del duration, kw
    if event == COMPILE_EVENT:
      n[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield n
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _traced_counter():
  traces = []

  @compiled_when_eager
  def f(x, scale, *, name='f'):
    traces.append(name)
    return {'y': x * scale, 'name_len': jnp.asarray(len(name))}

  return f, traces


def test_eager_call_traces_once_per_shape_and_static_values():
  f, traces = _traced_counter()
  x = jnp.arange(4.0)
  assert f(x, 2.0)['y'].tolist() == [0.0, 2.0, 4.0, 6.0]
  f(x + 1, 2.0)
  assert traces == ['f']  # Same shapes and static values: the cache.
  f(jnp.arange(5.0), 2.0)
  f(x, 3.0, name='g')
  assert traces == ['f', 'f', 'g']


def test_equal_static_values_of_other_types_do_not_share_a_trace():
  f, traces = _traced_counter()
  x = jnp.ones(2)
  f(x, 2)
  f(x, 2.0)
  f(x, True)
  assert len(traces) == 3


def test_inside_a_trace_the_function_is_inlined():
  f, _ = _traced_counter()
  jaxpr = jax.make_jaxpr(lambda x: f(x, 2.0)['y'])(jnp.ones(3))
  prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
  assert 'pjit' not in prims and 'jit' not in prims
  g = jax.grad(lambda x: f(x, 3.0)['y'].sum())(jnp.ones(3))
  assert g.tolist() == [3.0, 3.0, 3.0]


def test_unhashable_argument_runs_eagerly():
  calls = []

  @compiled_when_eager
  def f(x, table):
    calls.append(type(x))
    return x + len(table)

  assert f(jnp.ones(2), {1, 2}).tolist() == [3.0, 3.0]  # A set: a leaf.
  assert calls == [type(jnp.ones(2))]  # Concrete, not traced.


def test_numpy_arrays_are_traced_not_static():
  f, traces = _traced_counter()
  f(np.ones(3, np.float32), 2.0)
  f(np.zeros(3, np.float32), 2.0)
  assert traces == ['f']


def test_errors_keep_their_type_and_message():
  @compiled_when_eager
  def f(x, bits):
    if bits not in range(1, 9):
      raise ValueError(f'bits must be in 1..8, got {bits!r}.')
    return x

  for _ in range(2):  # The second call goes to `f` at once.
    with pytest.raises(ValueError) as e:
      f(jnp.ones(2), 9)
    assert str(e.value) == 'bits must be in 1..8, got 9.'
    assert not getattr(e.value, '__notes__', None)  # No note from jit.


def test_a_python_branch_on_a_value_runs_eagerly():
  @compiled_when_eager
  def f(x):
    return x if float(x.sum()) > 0 else -x

  assert f(jnp.ones(2)).tolist() == [1.0, 1.0]
  assert f(-jnp.ones(2)).tolist() == [1.0, 1.0]


def test_eager_quantize_is_one_program_and_equals_the_jitted_call():
  x = jax.random.normal(jax.random.key(0), (24, 40))
  cfg = aqtr.TensorConfig()
  with compiles() as n:
    q = aqtr.quantize(x, cfg)
  assert n[0] == 1
  ref = jax.jit(lambda x: aqtr.quantize(x, cfg))(x)
  np.testing.assert_array_equal(q.qvalue, ref.qvalue)
  np.testing.assert_array_equal(q.scale, ref.scale)
  with compiles() as n:
    xhat = aqtr.fake_quant(x, cfg)
    again = aqtr.fake_quant(x, cfg)
  assert n[0] == 1
  np.testing.assert_array_equal(xhat, again)
  np.testing.assert_array_equal(xhat, jax.jit(aqtr.fake_quant)(x))
  np.testing.assert_array_equal(xhat, q.dequant())


def test_eager_codecs_round_trip_as_one_program_each():
  x = jax.random.normal(jax.random.key(1), (4, 64))
  parts = {'qvalue': Nf4().quantize(x / 3, None), 'scale': jnp.ones((4, 1))}
  with compiles() as n:
    stored = codecs.encode_parts(parts, Nf4())
    back = codecs.decode_parts(stored, Nf4())
  assert n[0] == 2
  assert stored['table4'].dtype == jnp.uint8
  np.testing.assert_array_equal(back['qvalue'], parts['qvalue'])
