"""The results file (OUT) of `serve.generate`: what a rerun keeps, what it
regenerates, and what it refuses.

Reuse is keyed by content, never by a path or an id alone:
- OUT.settings.json records the run's settings and the fingerprint of the
  checkpoint's parameters (`lm.checkpoint.fingerprint`); a rerun under
  other settings, or with another checkpoint at the same path (a workdir
  trained again), is refused in one line (`check_settings`).
- Each result records the hash of its request ("request": prompt, per-line
  settings, seed; `serve.prompts.request_hash`); a rerun regenerates a
  request whose hash changed (an edited prompt, another "max_new_tokens").
- The last line for an id wins: a regenerated request's line is appended,
  and the line it replaces is dropped when the run ends (`plan`,
  `compact`); an error line is dropped at a rerun's start, so that the
  request is retried; a last line cut short by a kill is dropped.

OUT is never held in memory: it is read a line at a time, and a rerun keeps
one 8-byte digest and one hash per id.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import pathlib

from serve import prompts as prompts_lib
from infra.errors import UserError

STDIO = '-'  # --out=- streams the results to stdout.


def check_paths(prompts: pathlib.Path, out: pathlib.Path):
  """--out must not be --prompts (a rerun would read results as prompts),
  nor a device (OUT.lock and OUT.settings.json go beside OUT)."""
  if str(out) == STDIO:
    return
  if out.absolute().parts[1:2] in (('dev',), ('proc',)):
    raise UserError(f'--out={out} is a device; give a file for the results, '
                    'or --out=- to stream them to stdout (no resuming)')
  if str(prompts) == STDIO:
    return
  if out.resolve() == prompts.resolve() or (
      out.exists() and prompts.exists() and out.samefile(prompts)):
    raise UserError(f'--out={out} is the --prompts file; give another file '
                    'for the results')
  if out.exists() and not out.is_file():
    raise UserError(f'--out={out} is not a file; give a file for the results')


def settings_path(out: pathlib.Path) -> pathlib.Path:
  return out.with_name(out.name + '.settings.json')


# Recorded in OUT.settings.json to say where the results came from, not
# compared: the same parameters (`checkpoint`) from a workdir moved, or
# saved at another step, make the same texts.
INFORMATION = frozenset({'workdir', 'step'})


def check_settings(out: pathlib.Path, settings: dict, holds_results: bool):
  """Refuses (one line naming the first difference) an OUT holding results
  made under other settings or from another checkpoint (OUT.settings.json
  records them), and an OUT holding anything without that record (not this
  command's: not to be appended to)."""
  path = settings_path(out)
  if not path.exists() and out.exists() and out.stat().st_size:
    raise UserError(f'--out={out} is a file this command did not write (no '
                    f'{path.name} beside it); give a new file for the '
                    'results')
  if not holds_results:
    return  # A new OUT, or one holding only errors (they are retried).
  try:
    made = json.loads(path.read_text(encoding='utf-8'))
  except FileNotFoundError:
    raise UserError(f'--out={out} holds results with no record of their '
                    f'settings ({path.name}); give another --out') from None
  except (OSError, json.JSONDecodeError) as e:
    raise UserError(f'{path} cannot be read ({e}); give another --out'
                    ) from None
  if made.get('checkpoint') != settings['checkpoint']:
    raise UserError(
        f'--out={out} holds results of another checkpoint (parameters '
        f'{made.get("checkpoint") or "not fingerprinted"}, now '
        f'{settings["checkpoint"]}: the workdir trained again, or another '
        f'one); give another --out, or delete {out.name} to generate them '
        'all again')
  for name, value in settings.items():
    if name not in INFORMATION and made.get(name) != value:
      raise UserError(
          f'--out={out} holds results made with {name}={made.get(name)!r}, '
          f'not {value!r}; rerun with the same settings or give another '
          '--out')


def key(entry: dict) -> str:
  """What a result line is about: its request's id as JSON, or 'line N'
  for a prompt line that had no usable id."""
  if 'id' in entry:
    return json.dumps(entry['id'])
  return f'line {entry.get("line")}'


@dataclasses.dataclass
class Plan:
  """What OUT holds: `done`, {id digest: request hash} of the results a
  rerun keeps; `drop`, the line numbers (0-based) that `compact` removes."""
  done: dict[int, str] = dataclasses.field(default_factory=dict)
  drop: set[int] = dataclasses.field(default_factory=set)


def plan(out: pathlib.Path, retry_errors: bool) -> Plan:
  """Reads OUT a line at a time. The last line for a key wins, and the
  lines it replaces are dropped; retry_errors (a rerun's start): error
  lines are dropped too, so that their requests run again. A last line
  without its newline (cut short by a kill) is dropped."""
  found, last = Plan(), {}
  if not out.exists():
    return found
  with out.open(encoding='utf-8') as f:
    for number, line in enumerate(f):
      if not line.endswith('\n'):
        found.drop.add(number)
        break
      try:
        entry = json.loads(line)
      except json.JSONDecodeError:
        continue  # Not ours to judge: kept.
      if not isinstance(entry, dict):
        continue
      k = prompts_lib.digest(key(entry))
      if k in last:
        found.drop.add(last[k])
      last[k] = number
      if 'error' in entry:
        found.done.pop(k, None)
        if retry_errors:
          found.drop.add(number)
      else:
        found.done[k] = entry.get('request')
  return found


def compact(out: pathlib.Path, drop: set[int]):
  """OUT without the lines numbered in `drop`, replaced at once (a
  temporary file renamed over it, so that a kill leaves the old file or
  the new one), streamed a line at a time."""
  if not drop:
    return
  tmp = out.with_name(f'.{out.name}.tmp')
  with out.open(encoding='utf-8') as source, tmp.open(
      'w', encoding='utf-8') as target:
    for number, line in enumerate(source):
      if number not in drop:
        target.write(line)
  os.replace(tmp, out)


def write_settings(out: pathlib.Path, settings: dict):
  """OUT.settings.json replaced at once by `settings`."""
  path = settings_path(out)
  tmp = path.with_name(f'.{path.name}.tmp')
  tmp.write_text(json.dumps(settings, indent=1) + '\n', encoding='utf-8')
  os.replace(tmp, path)


class Lock:
  """OUT.lock held (flock) while a run writes OUT: a second is refused.
  Removed when the run ends, refused or not: nothing is left beside OUT
  but its settings."""

  def __init__(self, out: pathlib.Path):
    self.path = out.with_name(out.name + '.lock')

  def __enter__(self):
    while True:
      self.file = self.path.open('a+', encoding='utf-8')
      try:
        fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError:
        self.file.seek(0)
        holder = self.file.read().strip() or 'another process'
        self.file.close()
        raise UserError(f'{self.path.name[:-5]} is being written by '
                        f'{holder}; wait for it to end or give another '
                        '--out') from None
      # The holder before us may have removed the file we opened as it
      # ended: then lock the one at the path now.
      try:
        if os.stat(self.path).st_ino == os.fstat(self.file.fileno()).st_ino:
          break
      except FileNotFoundError:
        pass
      self.file.close()
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f'serve.generate pid {os.getpid()}\n')
    self.file.flush()
    return self

  def __exit__(self, *exc):
    self.path.unlink(missing_ok=True)  # Still held: no one else has it.
    self.file.close()  # Releases the lock.


def disk_full(out: pathlib.Path, e: OSError) -> UserError | None:
  """The one line for a write that failed for lack of space, else None."""
  if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
    return None
  return UserError(f'cannot write {out} ({e.strerror or e}); free space and '
                   'rerun the same command: the results written are kept '
                   'and the rest are done')
