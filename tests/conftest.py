"""Test setup: 8 host CPU devices, strict rank promotion."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import hypothesis
import jax

jax.config.update('jax_numpy_rank_promotion', 'raise')

# CI runs the property tests on a fixed set of examples (reproducible);
# locally hypothesis explores new ones each run.
hypothesis.settings.register_profile('ci', derandomize=True, database=None)
if os.environ.get('CI'):
  hypothesis.settings.load_profile('ci')
