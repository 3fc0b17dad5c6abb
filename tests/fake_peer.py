"""A stand-in for a training process, for tests/test_faults.py's watcher
tests: writes its arguments to stderr, one a line, then exits with the
status named by the environment's FAKE_PEER_EXIT ('abort': SIGABRT)."""

import os
import sys

if __name__ == '__main__':
  for line in sys.argv[1:]:
    print(line, file=sys.stderr)
  end = os.environ.get('FAKE_PEER_EXIT', '0')
  if end == 'abort':
    os.abort()
  sys.exit(int(end))
