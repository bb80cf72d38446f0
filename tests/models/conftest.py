"""Real models: their own code promotes ranks (tests/conftest.py raises)."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _third_party_rank_promotion():
  with jax.numpy_rank_promotion('allow'):
    yield
