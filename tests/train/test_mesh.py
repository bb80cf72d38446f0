"""Training on the 8-device host mesh: losses equal the one-device run."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import aqtr
from aqtr.train import experiment, loop, mesh, models, pax_run, tasks

pytestmark = pytest.mark.skipif(
  jax.device_count() != 8, reason='needs 8 host devices (tests/conftest.py)'
)


def _setup(shape=()):
  cfg = experiment.tiny()
  cfg.steps, cfg.log_every, cfg.eval_every, cfg.mesh = 3, 1, 3, shape
  exp, template, _ = experiment.split(cfg)
  return exp, template, tasks.make(exp)


def _losses(shape, config):
  exp, template, task = _setup(shape)
  r = pax_run.train('run', config, exp, task, template, show_progress=False)
  return [h['train_loss'] for h in r.history if 'train_loss' in h], r.params


def _per_example_losses(config):
  """One device, the same 3 steps, each example's forward and backward
  compiled at batch 1 (`lax.map`): the same math as the batched step, with
  the per-example float sums in the order XLA picks for batch 1, as on a
  data-parallel mesh."""
  exp, template, task = _setup()
  module = models.build(models.inject(template, config)[0])
  tx = loop.optimizer(exp)

  @jax.jit
  def step(p, opt, x, y):
    def loss_fn(p):
      def one(xi):
        return module.apply({'params': p}, xi[None])[0]

      return tasks.cross_entropy(jax.lax.map(one, x), y)

    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, opt = tx.update(grads, opt, p)
    return optax.apply_updates(p, updates), opt, loss

  params = loop.init_params(template, task, exp.seed)
  opt, batches, out = tx.init(params), task.batches(), []
  for _ in range(3):
    params, opt, loss = step(params, opt, *next(batches))
    out.append(float(loss))
  return out


def _check(shape):
  """int8 per-channel on a mesh vs one device, 3 Adam steps.

  Steps 1-2 agree to 1e-6 (measured <= 1.7e-7). Step 3 differs by ~3.5e-5
  relative (both meshes) because of float summation order, not the mesh:
  XLA compiles a per-example float reduction (softmax sums, the P.V
  einsum) into code whose summation order depends on the batch shape, so a
  device holding 1 (or 4) examples gets last-bit differences from the
  8-example program; an int8 rounding of a backward operand near a
  rounding boundary then flips, and Adam carries the changed gradient into
  step 3. The same one-device step with each example compiled at batch 1
  (no mesh, no collective) moves step 3 by 1.2e-4, so the mesh's drift is
  asserted to be within that float-order sensitivity of the quantized
  model, and within 1e-5 when the model is float (slow test).
  """
  config = aqtr.presets.int8()
  want, _ = _losses((), config)
  got, sharded = _losses(shape, config)
  assert len(got) == len(want) == 3
  np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6, err_msg=str(shape))
  reorder = np.abs(np.subtract(_per_example_losses(config), want))
  drift = np.abs(np.subtract(got, want))
  assert np.all(drift <= np.maximum(reorder, 1e-5 * np.abs(want))), (
    shape,
    drift,
    reorder,
  )
  return sharded


def test_data_x_model_parallel_losses_equal_one_device():
  sharded = _check((2, 4))
  specs = {str(p.sharding.spec) for p in jax.tree.leaves(sharded)}
  assert any('model' in s for s in specs), specs  # Really split.


@pytest.mark.slow
def test_data_parallel_losses_equal_one_device():
  _check((8,))


@pytest.mark.slow
@pytest.mark.parametrize('shape', [(8,), (2, 4)])
def test_float_mesh_losses_equal_one_device(shape):
  """Without int8 roundings to flip, the float order alone: <= 1e-6."""
  want, _ = _losses((), aqtr.presets.float())
  got, _ = _losses(shape, aqtr.presets.float())
  np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=str(shape))


@pytest.mark.parametrize(
  'shape, match',
  [((3,), 'has 3 devices'), ((2, 2, 2), '1 or 2 ints'), ((0,), '>= 1')],
)
def test_bad_mesh_is_an_error(shape, match):
  with pytest.raises(ValueError, match=match):
    mesh.make(shape)


def test_experiment_checks_mesh_shape():
  cfg = experiment.tiny()
  cfg.mesh = (2, 2, 2)
  with pytest.raises(ValueError, match='mesh must be'):
    experiment.split(cfg)


_ONE_PROCESS = """
from aqtr.train import mesh
mesh.initialize_distributed()
import jax, jax.numpy as jnp, aqtr
m = mesh.make((8,))
x = jax.device_put(jnp.ones((16, 8)), mesh.batch_sharding(m))
y = aqtr.dot_general(x, jnp.ones((8, 4)), (((1,), (0,)), ((), ())),
                     aqtr.presets.int8())
print(jax.distributed.is_initialized(), jax.process_count(), float(y.sum()))
"""


def test_distributed_code_path_with_one_process():
  with socket.socket() as s:
    s.bind(('localhost', 0))
    port = s.getsockname()[1]
  env = dict(
    os.environ,
    XLA_FLAGS='--xla_force_host_platform_device_count=8 '
    + os.environ.get('AQTR_TEST_XLA_FLAGS', ''),
    JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
    JAX_NUM_PROCESSES='1',
    JAX_PROCESS_ID='0',
    PYTHONPATH=str(pathlib.Path(aqtr.__file__).parents[1]),
  )
  out = subprocess.run(
    [sys.executable, '-c', _ONE_PROCESS],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )
  assert out.stdout.split()[-3:] == ['True', '1', str(16 * 4 * 8.0)]
