"""Helpers of the aqtr.pax tests: a tiny LM and a jaxpr dot counter."""

import collections
import functools

import fiddle as fdl
import jax
import jax.numpy as jnp

import aqtr.pax
from aqtr.core.lowering import is_dot, sub_jaxprs
from aqtr.pax import templates

VOCAB, D_MODEL, LAYERS, HEADS, HIDDEN, SEQ = 32, 32, 2, 2, 64, 16


def tiny_lm(**kw) -> fdl.Config:
  """The test LM config: d_model 32, 2 layers, seq 16."""
  args = dict(
    vocab_size=VOCAB,
    d_model=D_MODEL,
    num_layers=LAYERS,
    num_heads=HEADS,
    hidden_dim=HIDDEN,
    max_len=SEQ,
  )
  return templates.transformer_lm(**{**args, **kw})


def tokens(batch: int = 2, seed: int = 0) -> jax.Array:
  return jax.random.randint(jax.random.key(seed), (batch, SEQ), 0, VOCAB)


def dot_dtypes(jaxpr) -> collections.Counter:
  """Counts dot_general eqns by (lhs dtype, rhs dtype), recursively."""
  found = collections.Counter()
  for eqn in jaxpr.eqns:
    if is_dot(eqn):
      lhs, rhs = eqn.invars[:2]
      found[(str(lhs.aval.dtype), str(rhs.aval.dtype))] += 1
    for sub in sub_jaxprs(eqn):
      found += dot_dtypes(sub)
  return found


def int8_dots(jaxpr) -> int:
  return dot_dtypes(jaxpr)[('int8', 'int8')]


def grad_jaxpr(cfg: fdl.Config, ids: jax.Array | None = None):
  """The jaxpr of jax.grad of the next-token loss of the built model."""
  model = fdl.build(cfg)
  ids = tokens() if ids is None else ids
  params = zeros_like_init(model, ids)

  def loss(p):
    logits = model.apply(p, ids, rngs={'quant': jax.random.key(1)})
    return aqtr.pax.next_token_loss(logits, ids)

  return jax.make_jaxpr(jax.grad(loss))(params).jaxpr


_JITTED = {}


def _jitted(model, name: str, method):
  """One jitted function per (model, init|apply, method): compiled once."""
  key = (id(model), name, method)
  if key not in _JITTED:
    fn = functools.partial(getattr(model, name), method=method)
    _JITTED[key] = (model, jax.jit(fn))
  return _JITTED[key][1]


def init(model, *args, method=None, seed: int = 0):
  """Jitted `model.init` (eager linen is slow on CPU)."""
  return _jitted(model, 'init', method)(jax.random.key(seed), *args)


def apply(model, variables, *args, method=None, rngs=None):
  """Jitted `model.apply`, reused across calls with the same model."""
  return _jitted(model, 'apply', method)(variables, *args, rngs=rngs)


def zeros_like_init(model, *args):
  """Zero variables shaped like `model.init(...)`, without compiling init."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), *args)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


@functools.cache
def float_lm():
  """The built float test LM and its initial variables (shared by tests)."""
  model = fdl.build(tiny_lm())
  return model, init(model, tokens())
