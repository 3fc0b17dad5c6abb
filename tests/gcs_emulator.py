"""A Google Cloud Storage emulator on localhost for the tests.

gcp-storage-emulator (PyPI), run in this process, in memory, with one bucket.
It ignores the generation preconditions that GCS enforces (ifGenerationMatch,
which the bucket lock and TensorStore rely on), so `start` adds them, as GCS
documents them: a create, overwrite, read or delete whose ifGenerationMatch
is not the object's current generation (0: the object must not exist) fails
with 412; and a download names its generation (x-goog-generation).
Clients find it through STORAGE_EMULATOR_HOST (`environment`).
"""

from __future__ import annotations

import contextlib
import functools
import http
import http.server
import socket

BUCKET = 'bucket'


def _generation(storage, bucket: str, name: str) -> int:
  from gcp_storage_emulator.exceptions import NotFound  # pylint: disable=import-outside-toplevel
  try:
    return int(storage.get_file_obj(bucket, name)['generation'])
  except NotFound:
    return 0


def _with_preconditions(handler):
  def checked(request, response, storage, *args, **kwargs):
    wanted = request.query.get('ifGenerationMatch')
    if wanted is not None:
      name = request.params.get('object_id') or (
          request.query.get('name') or [None])[0] or (
              request.data['meta'].get('name'))  # A multipart upload's.
      if _generation(storage, request.params['bucket_name'],
                     name) != int(wanted[0]):
        response.status = http.HTTPStatus.PRECONDITION_FAILED
        return None
    return handler(request, response, storage, *args, **kwargs)
  checked.checks_preconditions = True
  return checked


def _with_generation_headers(download):
  """A media download names the object's generation in x-goog-generation
  (TensorStore, orbax's storage layer, reads it) and answers
  ifGenerationNotMatch of the current generation with 304."""
  def with_headers(request, response, storage, *args, **kwargs):
    generation = _generation(storage, request.params['bucket_name'],
                             request.params['object_id'])
    if generation:
      response['x-goog-generation'] = str(generation)
      response['x-goog-metageneration'] = '1'
      unless = request.query.get('ifGenerationNotMatch')
      if unless and int(unless[0]) == generation:
        response.status = http.HTTPStatus.NOT_MODIFIED
        return None
    return download(request, response, storage, *args, **kwargs)
  return with_headers


def _add_preconditions():
  from gcp_storage_emulator import server  # pylint: disable=import-outside-toplevel
  from gcp_storage_emulator.handlers import objects  # pylint: disable=import-outside-toplevel
  if getattr(objects.insert, 'checks_preconditions', False):
    return
  for _, handlers in server.HANDLERS:
    for method, handler in list(handlers.items()):
      if handler in (objects.insert, objects.delete):
        handlers[method] = _with_preconditions(handler)
      elif handler in (objects.download, objects.get):  # get: alt=media.
        handlers[method] = _with_preconditions(
            _with_generation_headers(handler))
  objects.insert = _with_preconditions(objects.insert)  # Its other route.


class _Listener(http.server.HTTPServer):
  # One request at a time, as the emulator's own; but TensorStore opens
  # dozens of connections at once, which the default backlog (5) resets.
  request_queue_size = 1024


def _serve(self):
  from gcp_storage_emulator import server  # pylint: disable=import-outside-toplevel
  self._httpd = _Listener((self._host, self._port),  # pylint: disable=protected-access
                          functools.partial(server.RequestHandler,
                                            self._storage))  # pylint: disable=protected-access
  self.is_running.set()
  self._httpd.serve_forever()  # pylint: disable=protected-access


@contextlib.contextmanager
def start():
  """Runs the emulator; yields its URL (http://localhost:PORT)."""
  from gcp_storage_emulator import server  # pylint: disable=import-outside-toplevel
  _add_preconditions()
  server.APIThread.run = _serve
  with socket.socket() as probe:
    probe.bind(('localhost', 0))
    port = probe.getsockname()[1]
  emulator = server.create_server('localhost', port, in_memory=True,
                                  default_bucket=BUCKET)
  emulator.start()
  try:
    yield f'http://localhost:{port}'
  finally:
    emulator.stop()


def environment(url: str) -> dict[str, str]:
  """What a process needs to reach the emulator as it would reach GCS."""
  return {'STORAGE_EMULATOR_HOST': url, 'TENSORSTORE_GCS_HTTP_URL': url,
          # gcsfs otherwise asks the control API (absent here) each bucket's
          # type before falling back to the plain one.
          'GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT': 'false'}
