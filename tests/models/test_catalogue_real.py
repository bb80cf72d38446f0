"""The research catalogue through rules on a real third-party model.

Every registry entry (`tests/flax/catalogue_cases.py`) on the projections
of Hugging Face's Flax Llama (toy size, `zoo.py`): init makes the state,
a jitted train step, convert, serve == train bit for bit. Slow (each chunk
compiles the model).
"""

import os
import sys

import pytest
import zoo

sys.path.insert(0, os.path.join(os.path.dirname(__file__), '..', 'flax'))
import catalogue_cases as cc  # noqa: E402

PROJ = tuple(
  f'inner/model/layers/.*/{p}'
  for p in (
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
@pytest.mark.parametrize('chunk', cc.chunks(len(PROJ)), ids=lambda c: c[0])
def test_catalogue_hf_llama(chunk):
  z = next(m for m in zoo.MODELS if m.name == 'hf_llama_gqa')
  if not z.available():
    pytest.skip(f'{z.package} is not installed')
  cc.linen_contract(z.build(), chunk, PROJ, z.sample())
