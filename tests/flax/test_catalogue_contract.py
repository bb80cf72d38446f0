"""Contract: every registry entry runs through rules on every model kind.

Every registered calibration, numerics, rounding and sparsity
(`catalogue_cases.ENTRIES`) is put on ops of a stock model by rules (one
entry per op path); each run makes the state, takes a jitted train step
(forward and backward stats, learned parameters' gradients), converts
(the calibration state and the weights frozen) and checks serve == train
bit for bit under jit. Model kinds: an nnx stack of `nnx.Linear`, a linen
stack of `nn.Dense`, the stock nnx Llama (scan over layers), a real
third-party model (Hugging Face's Flax Mistral, `tests/models/zoo.py`)
and the stock MoE (`test_catalogue_moe.py`). The default suite runs
three entries of three families on the nnx stack; the whole matrix is
slow.
"""

import os
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import aqtr.flax
from aqtr.rules import Rule

sys.path.insert(0, os.path.dirname(__file__))
import catalogue_cases as cc  # noqa: E402
import stock_models as sm  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'models'))
import zoo  # noqa: E402

W = 32  # divisible by the block formats' 32
X = jax.random.normal(jax.random.key(0), (4, W))
FAST = ('calibrations:delayed_scaling', 'rounding:stochastic', 'schedule:n_m')


class Stack(nnx.Module):
  def __init__(self, n):
    self.layers = nnx.List(
      [nnx.Linear(W, W, rngs=nnx.Rngs(i)) for i in range(n)]
    )

  def __call__(self, x):
    for layer in self.layers:
      x = jnp.tanh(layer(x))
    return x


class LinenStack(nn.Module):
  n: int

  @nn.compact
  def __call__(self, x):
    for i in range(self.n):
      x = jnp.tanh(nn.Dense(W, name=f'layers_{i}')(x))
    return x


def test_entries_cover_every_registry():
  for fam, reg in cc.FAMILIES.items():
    assert {e for e in cc.ENTRIES if e.startswith(fam + ':')} == {
      f'{fam}:{n}' for n in reg.names()
    }


def test_fast_entries_nnx_stack():
  q = cc.nnx_contract(
    Stack(len(FAST)), FAST, [f'layers/{i}' for i in range(len(FAST))], X
  )
  state = q.layers[2].aqtr_state.get_value()['dot_general0']
  assert int(state['fwd.rhs.sparsity']['step']) == 3  # 3 TRAIN calls made


def linen_stack(entries):
  paths = [f'layers_{i}' for i in range(len(entries))]
  cc.linen_contract(LinenStack(len(entries)), entries, paths, X)


@pytest.mark.slow
def test_fast_entries_linen_stack():
  linen_stack(FAST)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(9), ids=lambda c: c[0])
def test_catalogue_nnx_stack(chunk):
  cc.nnx_contract(
    Stack(len(chunk)), chunk, [f'layers/{i}' for i in range(len(chunk))], X
  )


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(9), ids=lambda c: c[0])
def test_catalogue_linen_stack(chunk):
  linen_stack(chunk)


# The stock Llama's weight ops (each runs in every scanned layer).
LLAMA_OPS = (
  'layers/q',
  'layers/kv',
  'layers/o',
  'layers/gate',
  'layers/up',
  'layers/down',
  'head',
)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(7), ids=lambda c: c[0])
def test_catalogue_stock_llama(chunk):
  ids = jax.random.randint(jax.random.key(0), (2, sm.T), 0, sm.VOCAB)
  entries, paths = llama_order(chunk)
  cc.nnx_contract(sm.Llama(nnx.Rngs(0)), entries, paths, ids)


def llama_order(chunk, ops=LLAMA_OPS):
  """(entries, op paths): mx (32-blocks) on the op contracting 32."""
  chunk = list(chunk)
  if 'numerics:mx' in chunk:
    i, j = chunk.index('numerics:mx'), ops.index('layers/down')
    chunk += [''] * (j + 1 - len(chunk))
    chunk[i], chunk[j] = chunk[j], chunk[i]
  pairs = [(e, p) for e, p in zip(chunk, ops, strict=False) if e]
  return [e for e, _ in pairs], [p for _, p in pairs]


# The linen Transformer's weight ops (scan over remat'ed layers).
TRANSFORMER_OPS = (
  'layers/q',
  'layers/k',
  'layers/v',
  'layers/o',
  'layers/up',
  'layers/down',
  'head',
)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(7), ids=lambda c: c[0])
def test_catalogue_linen_transformer(chunk):
  ids = jax.random.randint(jax.random.key(0), (2, sm.T), 0, sm.VOCAB)
  entries, paths = llama_order(chunk, TRANSFORMER_OPS)
  cc.linen_contract(sm.Transformer(state=True), entries, paths, ids)


def test_linen_scan_without_the_state_collection_is_one_line():
  q = aqtr.flax.quantize(
    sm.Transformer(), [Rule(cc.config('calibrations:delayed_scaling'))]
  )
  ids = jnp.zeros((2, sm.T), jnp.int32)
  with pytest.raises(ValueError, match="variable_axes=.*'aqtr_state': 0"):
    q.init(jax.random.key(0), ids)


# A real third-party model: the weight ops of one Hugging Face Mistral
# layer (the other layer and the head stay float).
MISTRAL_OPS = tuple(
  f'inner/model/layers/0/{m}'
  for m in (
    'self_attn/q_proj',
    'self_attn/k_proj',
    'self_attn/v_proj',
    'self_attn/o_proj',
    'mlp/up_proj',
    'mlp/gate_proj',
    'mlp/down_proj',
  )
)


@pytest.mark.slow
@pytest.mark.parametrize('chunk', cc.chunks(7), ids=lambda c: c[0])
def test_catalogue_real_model(chunk):
  z = next(z for z in zoo.MODELS if z.name == 'hf_mistral')
  if not z.available():
    pytest.skip('the models extra is not installed')
  with jax.numpy_rank_promotion('allow'):
    cc.linen_contract(z.build(), list(chunk), MISTRAL_OPS, z.sample())
