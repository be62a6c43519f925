"""Files that several processes may write at once: a lock per directory, and writes that land whole.

Every file jkv writes where two processes may meet (the default model in the cache directory, a checkpoint, the
outputs of ``jkv compare``, ``jkv frontier`` and ``jkv eval passkey --plot``) is written under a name no other
process uses (``temporary_path``) and renamed into place, so a reader sees the old file or the new one, never half
of one. Read-modify-write sequences (a frontier sweep adding its row) and checks followed by a write (a checkpoint's
target is empty, then its partial directory is made) hold ``locked(directory)``: ``fcntl.flock`` on the directory
itself, so no lock file is left beside the outputs, and a process that dies holding it releases it (the kernel
drops a dead process's locks), so a killed run never blocks the next one. The locks are advisory: they order jkv's
own writers (POSIX hosts; on a network file system only where it supports ``flock``).

A process killed outright (SIGKILL) while writing leaves its temporary file, hidden (``.NAME.<random>.jkv-tmp.EXT``)
and never read: in the cache directory the next process to take the lock removes it; beside other outputs it stays
until deleted. An interrupt (SIGINT) removes it as the stack unwinds.
"""

import contextlib
import fcntl
import os
import secrets
import sys
import threading
from typing import Optional, Sequence

TEMPORARY = ".jkv-tmp"  # in every temporary name: what a process killed while writing leaves is recognizable


def temporary_path(path: str) -> str:
  """A name beside ``path`` that no other process uses: hidden, random, same extension (matplotlib reads the image
  format from it). ``.model.gguf`` -> ``..model.3f9a0c1b2d4e.jkv-tmp.gguf``."""
  root, ext = os.path.splitext(os.path.basename(path))
  return os.path.join(os.path.dirname(os.path.abspath(path)), f".{root}.{secrets.token_hex(6)}{TEMPORARY}{ext}")


def is_temporary(name: str) -> bool:
  """Whether a file name is one ``temporary_path`` makes."""
  return name.startswith(".") and TEMPORARY in name


@contextlib.contextmanager
def locked(directory: str, waiting: Optional[str] = None):
  """Hold the exclusive lock of ``directory`` (which must exist) for the block. When another process holds it,
  ``waiting`` (if given) is printed to stderr once, and the call blocks until the lock is free. Re-entrant within a
  thread (``flock`` would block on a second descriptor of the same directory); other threads wait as processes do."""
  fd = os.open(directory, os.O_RDONLY)
  held = _held.__dict__.setdefault("keys", set())
  st = os.fstat(fd)
  key = (st.st_dev, st.st_ino)
  if key in held:
    os.close(fd)
    yield
    return
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if waiting:
        print(waiting, file=sys.stderr, flush=True)
      fcntl.flock(fd, fcntl.LOCK_EX)
    held.add(key)
    try:
      yield
    finally:
      held.discard(key)
  finally:
    os.close(fd)  # releases the lock


_held = threading.local()  # (device, inode) of the directories this thread holds the lock of


def try_lock(directory: str) -> Optional[int]:
  """The descriptor of ``directory`` holding its exclusive lock (close it to release), or None when another
  process holds it."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    return None
  return fd


def is_held(directory: str) -> bool:
  """Whether a live process holds the lock of ``directory``."""
  fd = try_lock(directory)
  if fd is None:
    return True
  os.close(fd)
  return False


@contextlib.contextmanager
def written_together(paths: Sequence[str]):
  """Yield a ``temporary_path`` for each of ``paths``; once the block has written them all, rename each into place,
  holding the lock of their directory so that two processes' sets do not interleave. On any failure, an interrupt
  included, the temporary files are removed and ``paths`` stay as they were."""
  partial = [temporary_path(p) for p in paths]
  try:
    yield partial
    with contextlib.ExitStack() as stack:
      for directory in sorted({os.path.dirname(p) for p in partial}):  # sorted: one order, no deadlock
        stack.enter_context(locked(directory))
      for src, dst in zip(partial, paths):
        os.replace(src, dst)
  finally:
    for p in partial:
      if os.path.exists(p):
        os.remove(p)
