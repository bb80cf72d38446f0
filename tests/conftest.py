"""Test setup: 8 host CPU devices, strict rank promotion."""

import os

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')

import jax

jax.config.update('jax_numpy_rank_promotion', 'raise')
