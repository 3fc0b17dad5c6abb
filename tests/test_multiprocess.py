"""Several processes on this machine, as on several hosts: `train.main`
launched twice with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
JAX_PROCESS_ID, 2 simulated CPU devices each, against one process with 4.

What these cannot prove: a real pod's network, its hosts' clocks and disks, a
scheduler's launch; the workdir here is one local folder both processes see,
as a shared filesystem would be.
"""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests import host_devices
from lm import checkpoint
from train.metrics import read_metrics

REPO = pathlib.Path(__file__).parent.parent
TINY = ['--config=tiny', '--config.train.log_every=2',
        '--config.train.eval_every=10', '--config.train.checkpoint_every=10']
pytestmark = pytest.mark.slow


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


def _launch(workdir, *args, processes=2, devices=2, **env):
  """`processes` train.main processes on `workdir`, started together."""
  port = _free_port()
  launched = []
  for i in range(processes):
    process_env = host_devices.env(devices, **env)
    if processes > 1:
      process_env.update(JAX_COORDINATOR_ADDRESS=f'localhost:{port}',
                         JAX_NUM_PROCESSES=str(processes),
                         JAX_PROCESS_ID=str(i))
    launched.append(subprocess.Popen(
        [sys.executable, '-m', 'train.main', *TINY, *args,
         f'--workdir={workdir}'], cwd=REPO, env=process_env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True))
  return launched


def _wait(launched, timeout=300):
  """[(exit status, stdout, stderr)] of each process."""
  return [(p.wait(timeout), p.stdout.read(), p.stderr.read())
          for p in launched]


def _run(workdir, *args, **kwargs):
  results = _wait(_launch(workdir, *args, **kwargs))
  for status, _, err in results:
    assert status == 0, err[-3000:]
  return results


def _losses(workdir):
  return [(m['step'], m['loss']) for m in read_metrics(workdir)]


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """tiny's 20 steps in one process with 4 devices, per mesh."""
  runs = {}

  def run(*mesh):
    if mesh not in runs:
      workdir = tmp_path_factory.mktemp('one')
      _run(workdir, *mesh, processes=1, devices=4)
      runs[mesh] = workdir
    return runs[mesh]
  return run


@pytest.mark.parametrize('mesh', [
    (), ('--config.mesh.data=1', '--config.mesh.fsdp=2',
         '--config.mesh.tensor=2')], ids=['data', 'fsdp2_tensor2'])
@pytest.mark.slowest
def test_two_processes_train_to_the_losses_of_one_with_four_devices(
    tmp_path, one_process, mesh):
  """Each process builds only its rows (its half of every batch); process 0
  alone writes the metrics, events and final.json."""
  results = _run(tmp_path, *mesh)
  expected = _losses(one_process(*mesh))
  ours = _losses(tmp_path)
  assert [s for s, _ in ours] == [s for s, _ in expected]  # Each step once.
  np.testing.assert_allclose([l for _, l in ours], [l for _, l in expected],
                             rtol=2e-5)
  assert len(list((tmp_path / 'tensorboard').iterdir())) == 1
  assert json.loads((tmp_path / 'final.json').read_text())['eval_loss'] > 0
  assert 'done: step 20' in results[0][1] and 'done' not in results[1][1]
  assert 'each of 2 processes builds 4 of the 8 rows of a batch' in (
      results[0][1])
  # Written on 4 devices in 2 processes, read here on one (as sampling on a
  # laptop reads a pod's checkpoint).
  _, params, _ = checkpoint.load_workdir(str(tmp_path))
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


@pytest.mark.slowest
def test_a_checkpoint_moves_between_two_processes_and_one(tmp_path):
  """Written by two processes, resumed by one (and the reverse): the
  losses of one process stopped and resumed the same way (10 steps of a
  10-step schedule, then on to 20)."""
  expected = {}
  for first, then in (((1, 4), (1, 4)), ((2, 2), (1, 4)), ((1, 4), (2, 2))):
    workdir = tmp_path / f'{first[0]}_then_{then[0]}'
    _run(workdir, '--config.train.steps=10', processes=first[0],
         devices=first[1])
    results = _run(workdir, processes=then[0], devices=then[1])
    assert 'resuming from step 10' in results[0][1]
    ours = dict(_losses(workdir))
    expected = expected or ours  # The first: one process throughout.
    assert sorted(ours) == sorted(expected)
    np.testing.assert_allclose([ours[s] for s in sorted(ours)],
                               [expected[s] for s in sorted(ours)], rtol=2e-5)


def _wait_for_step(workdir, step, launched, timeout=240):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if (workdir / 'metrics.jsonl').exists() and any(
        m['step'] >= step for m in read_metrics(workdir)):
      return
    assert all(p.poll() is None for p in launched), _wait(launched)
    time.sleep(0.5)
  raise AssertionError(f'no step {step} within {timeout} s')


@pytest.mark.parametrize('signalled', [slice(None), slice(1, 2)],
                         ids=['every_process', 'one_process'])
@pytest.mark.slowest
def test_sigterm_saves_once_and_resumes(tmp_path, signalled):
  """SIGTERM to every process, or to one (the others learn of it at the
  next step they all log): all stop at the same step and save it once.
  Stopping at different steps left one in the save's barrier and another
  in its next step, both waiting forever (2 runs in 5 under load)."""
  launched = _launch(tmp_path, '--config.train.steps=2000')
  _wait_for_step(tmp_path, 4, launched)
  for p in launched[signalled]:
    p.send_signal(signal.SIGTERM)
  results = _wait(launched)
  assert [status for status, _, _ in results] == [143, 143], results
  stopped = checkpoint.restore_latest(str(tmp_path))[0]
  assert f'stopped at step {stopped}; checkpoint saved' in results[0][1]
  results = _run(tmp_path, '--config.train.steps=30')
  assert f'resuming from step {stopped}' in results[0][1]
  steps = [s for s, _ in _losses(tmp_path)]
  assert steps == sorted(set(steps)) and steps[-1] == 30


@pytest.mark.slowest
@pytest.mark.parametrize('lost', [1, 0], ids=['worker', 'coordinator'])
def test_a_lost_peer_ends_the_survivor_in_one_line(tmp_path, lost):
  """A process killed (as its host would vanish) ends the other within the
  heartbeat timeout and some seconds, with one line naming what was lost
  and how to resume, and exit status 1; the workdir then resumes."""
  launched = _launch(tmp_path, '--config.train.steps=2000',
                     GQA_LAB_HEARTBEAT_TIMEOUT='5')
  _wait_for_step(tmp_path, 12, launched)  # Step 10's checkpoint is saved.
  os.killpg(launched[lost].pid, signal.SIGKILL)  # The watcher and its child.
  killed_at = time.monotonic()
  survivor = launched[1 - lost]
  status = survivor.wait(60)
  assert time.monotonic() - killed_at < 5 + 30
  err = survivor.stderr.read()
  assert status == 1
  lines = [l for l in err.splitlines() if l.startswith('error')]
  assert len(lines) == 1 and err.rstrip().endswith(lines[0]), err[-3000:]
  for dump in ('Traceback', 'Fatal Python error', 'Check failure', 'F1'):
    assert dump not in err, err[-3000:]
  what = ('process 1 of this run stopped answering' if lost == 1 else
          "lost contact with the run's coordinator")
  assert lines[0].startswith('error: ') and what in lines[0], lines[0]
  resumes = re.search(r'rerun the same command on every host to resume '
                      r'from step (\d+)$', lines[0])
  assert resumes and int(resumes.group(1)) >= 10, lines[0]
  results = _run(tmp_path, '--config.train.steps=30')
  assert f'resuming from step {resumes.group(1)}' in results[0][1]


def _children(pid: int) -> list[int]:
  """The PIDs whose parent is `pid` (from /proc)."""
  found = []
  for stat in pathlib.Path('/proc').glob('[0-9]*/stat'):
    try:
      fields = stat.read_text().rsplit(')', 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
      continue
    if int(fields[1]) == pid:  # state, ppid, ...
      found.append(int(stat.parent.name))
  return found


def _alive(pid: int) -> bool:
  """Running (a zombie, dead but not yet reaped, is not)."""
  try:
    return (pathlib.Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1]
            .split()[0] != 'Z')
  except (FileNotFoundError, ProcessLookupError):
    return False


@pytest.mark.slowest
def test_kill_9_of_a_launched_process_leaves_none_of_the_run_alive(tmp_path):
  """SIGKILL to the PID a user or a scheduler sees (the watcher of process
  1) cannot be passed on to the child that trains; that child, orphaned,
  trained on with the other process (both still training 75 s later). Now
  it dies with its watcher, and process 0 ends on the lost peer in one
  line: within a minute no process of the launch is alive."""
  launched = _launch(tmp_path, '--config.train.steps=2000',
                     GQA_LAB_HEARTBEAT_TIMEOUT='5')
  _wait_for_step(tmp_path, 4, launched)
  trainers = {p.pid: _children(p.pid) for p in launched}
  assert all(len(c) == 1 for c in trainers.values()), trainers
  everyone = [pid for p, c in trainers.items() for pid in (p, *c)]
  launched[1].kill()  # The launched PID only, not its process group.
  deadline = time.monotonic() + 60
  while any(map(_alive, everyone)) and time.monotonic() < deadline:
    time.sleep(0.5)
  try:
    assert not [pid for pid in everyone if _alive(pid)]
  finally:
    for pid in everyone:
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
  status, _, err = _wait(launched[:1])[0]
  assert status == 1, err[-3000:]
  assert err.rstrip().splitlines()[-1].startswith(
      'error: process 1 of this run stopped answering'), err[-3000:]
