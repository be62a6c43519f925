"""Save and restore a converted model: orbax-checkpoint for the parameters, one JSON for the rest, all checksummed.

Layout of a checkpoint directory (format 3)::

  jkv_checkpoint.json   {"format": 3, "config": ModelConfig fields, "tokenizer": Tokenizer.to_dict() or null,
                         "files": {path under the directory: {"bytes": size, "sha256": hex}} for every file
                         orbax wrote, "sha256": hex digest of the other fields in canonical JSON}
  params/               orbax PyTree checkpoint of Params

Saving is atomic: everything is written into the sibling ``<directory>.jkv-partial``, read back and compared,
and one rename makes it ``<directory>``, so a checkpoint exists whole or not at all. The writer holds the partial
directory's lock (``jkv.files``) while it writes, so two processes saving to one directory cannot mix: the first
makes the partial directory, the second refuses in one line (another process is writing it, or the directory
exists and is not empty). A partial directory whose lock no process holds is what a killed save left: loading names
it and what to delete, and the next save to that directory removes it and starts over. orbax's
``*.orbax-checkpoint-tmp*`` inside a target (an older jkv wrote there directly) is named with what to delete.

Restoring verifies every checksum first, so a flipped byte or a truncated file is one line naming the file, and
reads straight into the tree ``jkv.params.abstract(cfg)`` describes: no random init, no conversion.
"""

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import threading
from typing import Callable, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp

from jkv import files
from jkv import params as params_lib
from jkv.config import ModelConfig, RopeScaling
from jkv.tokenizer import Tokenizer

MARKER = "jkv_checkpoint.json"
PARAMS = "params"
FORMAT = 3  # 3: fused projections (jkv.params.Layers); 2: checksums of every file and of the JSON (format 1 had none)
PARTIAL = ".jkv-partial"  # suffix of the directory a save writes before its final rename
ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's own unfinished-save marker (atomicity_types.TMP_DIR_SUFFIX)


def _quiet(msg: str) -> None:
  del msg


def is_checkpoint(path: str) -> bool:
  """Whether ``path`` is a directory written by ``save``."""
  return os.path.isfile(os.path.join(path, MARKER))


def leftover(path: str, command: str = "jkv convert") -> Optional[str]:
  """One line naming what a save (by ``command``) still writing, or interrupted, left at ``path`` (or beside it)
  and what to do, else None."""
  path = os.path.abspath(path)
  found = None
  if os.path.isdir(path) and (path.endswith(PARTIAL) or _holds_orbax_tmp(path)):
    found = path
  elif os.path.exists(path + PARTIAL):
    found = path + PARTIAL
  if found is None:
    return None
  if found.endswith(PARTIAL) and _being_written(found):
    return f"{found} is being written by another process (`{command}`); wait for it to finish, or write elsewhere"
  return (f"{found} is left over from an interrupted `{command}`; delete it (rm -r {shlex.quote(found)}) "
          "and run again")


def _being_written(partial: str) -> bool:
  """Whether a live save holds ``partial`` (it took the lock under its parent's, with the directory made)."""
  with files.locked(os.path.dirname(partial)):
    try:
      return files.is_held(partial)
    except FileNotFoundError:  # renamed into place or removed meanwhile
      return False


def _holds_orbax_tmp(path: str) -> bool:
  dirs = [d for d in (path, os.path.join(path, PARAMS)) if os.path.isdir(d)]
  return any(ORBAX_TMP in name for d in dirs for name in os.listdir(d))


def check_target(directory: str, what: str = "checkpoint", command: str = "jkv convert") -> None:
  """Raise FileExistsError / PermissionError (one line) unless ``save(directory, ...)`` (or another writer of a
  ``what`` through ``atomic_directory``, run by ``command``) can write there.

  Cheap and side-effect free, so that callers can run it before the work that produces the checkpoint. A partial
  directory that a killed save left beside the target is no obstacle: the save removes it.
  """
  directory = os.path.abspath(directory)
  problem = leftover(directory, command)
  if problem and not _stale_partial(directory):
    raise FileExistsError(problem)
  if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
    raise FileExistsError(f"{what} directory {directory} exists and is not empty")
  parent = os.path.dirname(directory)
  while not os.path.exists(parent):  # save creates missing parents: the nearest existing one must be writable
    parent = os.path.dirname(parent)
  if not (os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK)):
    raise PermissionError(f"cannot write a {what} at {directory}: {parent} is not a writable directory")


def _stale_partial(directory: str) -> bool:
  """Whether beside ``directory`` lies a partial directory no live save holds."""
  partial = directory + PARTIAL
  return not directory.endswith(PARTIAL) and os.path.isdir(partial) and not _being_written(partial)


@contextlib.contextmanager
def atomic_directory(directory: str, what: str = "checkpoint", command: str = "jkv convert",
                     progress: Callable[[str], None] = _quiet):
  """Yields ``<directory>.jkv-partial`` to write into, holding its lock; when the block ends, one rename makes it
  ``directory`` (which may exist empty), so what was written exists whole or not at all. Any failure, an interrupt
  included, removes the partial directory before the exception propagates.

  The target is checked (``check_target``), a killed save's partial directory removed, and the new one made and
  locked under the parent directory's lock: of several processes saving to one ``directory`` at once, one writes,
  the others raise FileExistsError in one line. ``progress`` hears of a leftover removed.
  """
  directory = os.path.abspath(directory)
  partial = directory + PARTIAL
  parent = os.path.dirname(directory)
  os.makedirs(parent, exist_ok=True)
  with files.locked(parent):
    check_target(directory, what, command)
    if os.path.isdir(partial):  # check_target found no live writer of it
      progress(f"removing {partial}, left over from an interrupted `{command}` ...")
      shutil.rmtree(partial)
    os.mkdir(partial)
    hold = files.try_lock(partial)  # a new directory: nobody else holds it
  try:
    yield partial
    with files.locked(parent):
      if os.path.exists(directory) and os.listdir(directory):  # a writer that does not take the lock
        raise FileExistsError(f"{what} directory {directory} exists and is not empty")
      os.rename(partial, directory)  # replaces an empty directory too (POSIX rename)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise
  finally:
    os.close(hold)


def save(directory: str, cfg: ModelConfig, params: params_lib.Params, tokenizer: Optional[Tokenizer] = None,
         progress: Callable[[str], None] = _quiet) -> None:
  """Write ``(cfg, params, tokenizer)`` to a new ``directory`` (it must not exist or be empty), atomically.

  ``progress`` receives one line per stage (saving, verifying). Any failure, an interrupt included, removes the
  partial directory before the exception propagates.
  """
  with atomic_directory(directory, progress=progress) as partial:
    progress(f"saving to {partial} ...")
    _save_params(os.path.join(partial, PARAMS), params)
    meta = {"format": FORMAT, "config": dataclasses.asdict(cfg),
            "tokenizer": None if tokenizer is None else tokenizer.to_dict(), "files": file_digests(partial, PARAMS)}
    write_sealed_json(os.path.join(partial, MARKER), meta)
    progress("verifying the saved checkpoint ...")
    _check_equal(partial, restore(partial)[1], params)


def _save_params(path: str, params: params_lib.Params) -> None:
  def write():
    with ocp.StandardCheckpointer() as ckptr:  # leaving waits for its writes
      ckptr.save(path, params)
  finished_before_interrupt(write)


def finished_before_interrupt(fn: Callable[[], None]) -> None:
  """Run ``fn`` (an orbax save) to its end on a thread of its own while the caller waits; an interrupt of the
  caller waits for it, then propagates.

  orbax writes from threads of its own, and KeyboardInterrupt lands in the main thread only: raised inside orbax's
  save, it left writes already started running, with nothing left to wait for them, and they wrote on into the
  partial directory its cleanup had removed (a convert interrupted just after it started saving, on 2 loaded cores,
  left files behind 2 times of 25). On a thread of its own the save is never cut in half. A second interrupt stops
  the wait (``jkv`` exits at once then).

  The thread runs ``fn`` only once the caller has said ``go``: an interrupt inside ``Thread.start`` (it waits for
  the new thread to begin) left the caller not knowing whether ``fn`` would run, and the cleanup ran beside a save
  that then made the partial directory again (CI's failure; 4 of 9 interrupts sent on the "saving to" line left it,
  0 of 22 now, 10 of them beside two busy processes).
  """
  go, done, cancelled, failure = threading.Event(), threading.Event(), [], []

  def run():
    go.wait()
    try:
      if not cancelled:
        fn()
    except BaseException as e:  # raised again in the caller's thread
      failure.append(e)
    finally:
      done.set()
  # An Event, not Thread.join: Python 3.11's join, interrupted, marks the thread stopped (it takes the lock the
  # running thread holds for its release), so a second join returned at once and the cleanup ran beside the save.
  try:
    threading.Thread(target=run, name="jkv-save", daemon=True).start()
    go.set()
    done.wait()
  except KeyboardInterrupt:
    if go.is_set():  # fn runs, or ran: wait for its end
      done.wait()
    else:  # fn never runs: a thread that started returns at once
      cancelled.append(True)
      go.set()
    raise
  if failure:
    raise failure[0]


def restore(directory: str) -> tuple[ModelConfig, params_lib.Params, Optional[Tokenizer]]:
  """Read a directory written by ``save``; the parameters come back in the saved dtype.

  Raises ValueError (one line naming the file) when a checksum does not match or a file is missing or truncated.
  """
  cfg, tokenizer = read_config(directory)
  return cfg, restore_params(directory, cfg), tokenizer


def read_config(directory: str) -> tuple[ModelConfig, Optional[Tokenizer]]:
  """The config and tokenizer of a directory written by ``save``, every file's checksum verified; nothing of jax
  runs (a caller may still set what XLA reads when its first device starts)."""
  directory = os.path.abspath(directory)
  meta = _read_meta(directory)
  verify_files(directory, meta["files"])
  return _config(meta["config"]), None if meta["tokenizer"] is None else Tokenizer.from_dict(meta["tokenizer"])


def restore_params(directory: str, cfg: ModelConfig) -> params_lib.Params:
  """The parameters of a directory written by ``save`` (``read_config``'s ``cfg``), in the saved dtype."""
  # Name the device: the sharding recorded at save time names the saving machine's device (say a CPU).
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), params_lib.abstract(cfg))
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(os.path.join(os.path.abspath(directory), PARAMS), target)


def _read_meta(directory: str) -> dict:
  """The marker's JSON, its format and own checksum checked."""
  path = os.path.join(directory, MARKER)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{directory} is not a jkv checkpoint (no {MARKER})")
  try:
    with open(path, encoding="utf-8") as f:
      meta = json.load(f)
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is damaged ({e}); convert the source again") from None
  if not isinstance(meta, dict) or "format" not in meta:
    raise ValueError(f"{path} is damaged (no format field); convert the source again")
  if meta["format"] == 1:
    raise ValueError(f"{directory}: checkpoint format 1 (written by an older jkv) carries no checksums; convert "
                     f"the source again (this jkv reads format {FORMAT})")
  if meta["format"] == 2:
    raise ValueError(f"{directory}: checkpoint format 2 (written by an older jkv) stores the q/k/v and gate/up "
                     f"projections apart; convert the source again (this jkv reads format {FORMAT})")
  if meta["format"] != FORMAT:
    raise ValueError(f"{directory}: checkpoint format {meta['format']!r}, this jkv reads format {FORMAT}")
  sealed = meta.pop("sha256", None)
  if sealed != json_digest(meta):
    raise ValueError(f"{path} is damaged (checksum mismatch); convert the source again")
  return meta


def verify_files(directory: str, files: dict, remedy: str = "convert the source again") -> None:
  """Every file the manifest lists exists with its size and sha256; else one line naming the first bad one and
  ``remedy``."""
  for rel, want in sorted(files.items()):
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
      raise ValueError(f"{path} is missing; {remedy}")
    size = os.path.getsize(path)
    if size != want["bytes"]:
      raise ValueError(f"{path} is damaged ({'truncated: ' if size < want['bytes'] else ''}{size} bytes, the "
                       f"manifest says {want['bytes']}); {remedy}")
  rels = sorted(files)
  for rel, digest in zip(rels, _sha256_all([os.path.join(directory, r) for r in rels])):
    if digest != files[rel]["sha256"]:
      raise ValueError(f"{os.path.join(directory, rel)} is damaged (sha256 mismatch); {remedy}")


def file_digests(directory: str, under: str) -> dict:
  """{path relative to directory: {"bytes", "sha256"}} for every file under ``directory/under``."""
  paths = [os.path.join(root, name) for root, _, names in os.walk(os.path.join(directory, under)) for name in names]
  return {os.path.relpath(p, directory): {"bytes": os.path.getsize(p), "sha256": d}
          for p, d in zip(paths, _sha256_all(paths))}


def _sha256_all(paths: list) -> list:
  """sha256 hex digests of the files, several at once (hashlib releases the GIL; one core hashes ~0.5 GB/s)."""
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    return list(pool.map(_sha256, paths))


def _sha256(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def json_digest(data: dict) -> str:
  """sha256 of ``data`` as canonical JSON (sorted keys, no spaces): equal after a dump/load round trip."""
  return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_sealed_json(path: str, data: dict) -> None:
  """``data`` plus ``"sha256"``, its ``json_digest``, written to ``path`` and synced to the disk."""
  with open(path, "w") as f:
    json.dump({**data, "sha256": json_digest(data)}, f)
    f.flush()
    os.fsync(f.fileno())


def _config(fields: dict) -> ModelConfig:
  fields = dict(fields)
  if fields["rope_scaling"] is not None:
    fields["rope_scaling"] = RopeScaling(**fields["rope_scaling"])
  fields["eos_ids"] = tuple(fields["eos_ids"])
  return ModelConfig(**fields)


def _check_equal(directory: str, restored: params_lib.Params, params: params_lib.Params) -> None:
  """The parameters read back from ``directory`` are bit for bit the ones saved."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(params)):
    if np.asarray(a).tobytes() != np.asarray(b).tobytes():  # bits, so that NaN equals NaN
      raise OSError(f"{directory}: parameter {jax.tree_util.keystr(path)} reads back different from what was "
                    "saved (a failing disk?)")
