"""The safetensors format, read one tensor at a time and written likewise.

A file is an 8-byte little-endian header length, a JSON header mapping each
name to its dtype, shape and byte range, then the raw bytes. Reading a tensor
reads only its range (`np.fromfile`, no memory map whose pages would stay
resident), so a checkpoint of any size streams through a bounded buffer;
bfloat16 comes and goes as `ml_dtypes.bfloat16`, as JAX holds it.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

from infra.errors import UserError
from infra.progress import Progress

DTYPES = {'F64': np.float64, 'F32': np.float32, 'F16': np.float16,
          'BF16': ml_dtypes.bfloat16, 'I64': np.int64, 'I32': np.int32,
          'I16': np.int16, 'I8': np.int8, 'U8': np.uint8, 'BOOL': np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class File:
  """One .safetensors file: `entries` (name -> (dtype, shape)), `read(name)`."""

  def __init__(self, path: pathlib.Path):
    self.path = path
    try:
      file_size = path.stat().st_size
      with open(path, 'rb') as f:
        (size,) = struct.unpack('<Q', f.read(8))
        if size > file_size - 8:
          raise ValueError(f'its header length {size:,} exceeds the file\'s '
                           f'{file_size:,} bytes')
        header = json.loads(f.read(size))
    except (OSError, struct.error, ValueError) as e:
      raise UserError(f'{path} is not a readable safetensors file ({e}); '
                      're-download or re-export it') from None
    if not isinstance(header, dict):
      raise self._bad(f'its header is a JSON {type(header).__name__}, not '
                      'an object')
    header.pop('__metadata__', None)
    self._start = 8 + size
    self._ranges, self.entries = {}, {}
    for name, info in header.items():
      dtype, shape, (begin, end) = self._entry(name, info)
      if begin < 0 or end > file_size - self._start:
        raise UserError(f'{path} is truncated (tensor {name} ends at byte '
                        f'{self._start + end:,} of {file_size:,}); '
                        're-download or re-export it')
      self.entries[name] = (dtype, shape)
      self._ranges[name] = (begin, end)

  def _entry(self, name, info):
    """(dtype, shape, (begin, end)) of a header entry, checked."""
    try:
      dtype_name, shape = info['dtype'], tuple(info['shape'])
      begin, end = info['data_offsets']
      if not all(isinstance(x, int) and x >= 0 for x in (*shape, begin, end)):
        raise TypeError
    except (TypeError, KeyError, ValueError):
      raise self._bad(f'tensor {name} has no valid dtype, shape and '
                      f'data_offsets ({json.dumps(info)[:80]})') from None
    if dtype_name not in DTYPES:
      raise UserError(f'{self.path}: tensor {name} has dtype {dtype_name}, '
                      f'not one of {", ".join(DTYPES)}')
    dtype = np.dtype(DTYPES[dtype_name])
    need = int(np.prod(shape)) * dtype.itemsize
    if end - begin != need:
      raise self._bad(f'tensor {name} is {dtype_name} {list(shape)}, '
                      f'{need:,} bytes, but its data_offsets span '
                      f'{end - begin:,}')
    return dtype, shape, (begin, end)

  def _bad(self, what: str) -> UserError:
    return UserError(f'{self.path} has an inconsistent safetensors header '
                     f'({what}); re-download or re-export it')

  def nbytes(self, name: str) -> int:
    begin, end = self._ranges[name]
    return end - begin

  def read(self, name: str) -> np.ndarray:
    dtype, shape = self.entries[name]
    begin, end = self._ranges[name]
    count = (end - begin) // dtype.itemsize
    array = np.fromfile(self.path, dtype, count, offset=self._start + begin)
    if array.size != count:  # Shortened since the header was read.
      raise UserError(f'{self.path} is truncated (tensor {name}); '
                      're-download or re-export it')
    return array.reshape(shape)


def open_checkpoint(directory: pathlib.Path) -> list[File]:
  """The files of a Hugging Face checkpoint: model.safetensors, or the shards
  that model.safetensors.index.json lists."""
  index = directory / 'model.safetensors.index.json'
  if index.exists():
    try:
      shards = sorted(set(json.loads(index.read_text())['weight_map'].values()))
      if not all(isinstance(s, str) for s in shards):
        raise ValueError('weight_map values must be file names')
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise UserError(f'{index} is not a safetensors index ({e})') from None
    missing = [s for s in shards if not (directory / s).exists()]
    if missing:
      raise UserError(f'{directory} lacks the shards {missing} that {index.name} '
                      'lists; download them too')
    return [File(directory / s) for s in shards]
  if (directory / 'model.safetensors').exists():
    return [File(directory / 'model.safetensors')]
  found = sorted(p.name for p in directory.glob('*.bin'))
  raise UserError(
      f'{directory} has no model.safetensors (or index); '
      + (f'it has {found}: convert PyTorch .bin weights to safetensors first, '
         'e.g. with transformers save_pretrained' if found else
         'give the folder of a Hugging Face checkpoint'))


def write(directory: pathlib.Path, tensors: Iterable[tuple[str, np.ndarray]],
          shapes: dict[str, tuple[np.dtype, tuple]],
          max_shard_bytes: int = 5 << 30) -> list[str]:
  """Writes `tensors` (given one at a time, in the order of `shapes`) as
  model.safetensors, or as shards and their index when they exceed
  max_shard_bytes; returns the file names."""
  shards, current, size = [], [], 0
  for name, (dtype, shape) in shapes.items():
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if current and size + nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += nbytes
  shards.append(current)
  files = (['model.safetensors'] if len(shards) == 1 else
           [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors'
            for i in range(len(shards))])
  total = sum(int(np.prod(s)) * np.dtype(d).itemsize
              for d, s in shapes.values())
  weight_map = {}
  with Progress('writing weights', total, unit='MB', scale=1e6) as bar:
    tensors = _counted(tensors, shapes, bar)
    for file, names in zip(files, shards):
      _write_file(directory / file, names, shapes, tensors)
      weight_map.update({name: file for name in names})
  if len(files) > 1:
    (directory / 'model.safetensors.index.json').write_text(json.dumps(
        {'metadata': {'total_size': total}, 'weight_map': weight_map},
        indent=2))
  return files


def _counted(tensors, shapes, bar: Progress):
  """`tensors`, advancing `bar` by each one's planned size once written."""
  for name, array in tensors:
    yield name, array
    dtype, shape = shapes[name]
    bar.advance(int(np.prod(shape)) * np.dtype(dtype).itemsize)


def _write_file(path: pathlib.Path, names: list[str], shapes,
                tensors: Iterator[tuple[str, np.ndarray]]):
  header, offset = {'__metadata__': {'format': 'pt'}}, 0
  for name in names:
    dtype, shape = shapes[name]
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    header[name] = {'dtype': NAMES[np.dtype(dtype)], 'shape': list(shape),
                    'data_offsets': [offset, offset + nbytes]}
    offset += nbytes
  encoded = json.dumps(header, separators=(',', ':')).encode()
  encoded += b' ' * (-len(encoded) % 8)  # Data aligned to 8 bytes.
  with open(path, 'wb') as f:
    f.write(struct.pack('<Q', len(encoded)) + encoded)
    for name in names:
      got, array = next(tensors)
      dtype, shape = shapes[name]
      if got != name or array.shape != shape:
        raise ValueError(f'tensor {got} {array.shape} came where {name} '
                         f'{shape} was planned')
      f.write(np.ascontiguousarray(array, dtype).tobytes())
