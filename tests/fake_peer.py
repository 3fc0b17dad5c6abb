"""A stand-in for a training process, for tests/test_faults.py's watcher
tests: follows its watcher as train.main's child does, writes its arguments
to stderr, one a line, then exits with the status named by the environment's
FAKE_PEER_EXIT ('abort': SIGABRT; 'hang': prints its PID on stdout and
sleeps), after FAKE_PEER_LINGER seconds (as a process waits at its exit for
the run's others). FAKE_PEER_POLL: follow the watcher by polling, as where
Linux's parent-death signal is missing."""

import os
import sys
import time

from infra import peers

if __name__ == '__main__':
  if os.environ.get(peers.WATCHED):
    if os.environ.get('FAKE_PEER_POLL'):
      peers._parent_death_signal = lambda signum: False  # pylint: disable=protected-access
    peers.follow_watcher(os.environ, poll_seconds=0.1)
  for line in sys.argv[1:]:
    print(line, file=sys.stderr)
  sys.stderr.flush()
  time.sleep(float(os.environ.get('FAKE_PEER_LINGER', '0')))
  end = os.environ.get('FAKE_PEER_EXIT', '0')
  if end == 'abort':
    os.abort()
  if end == 'hang':
    print(os.getpid(), flush=True)
    time.sleep(600)
  sys.exit(int(end))
