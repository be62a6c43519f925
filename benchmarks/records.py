"""Committed benchmark results: merging a run's records into a JSON list, and rendering a table into the README.

Each benchmark keeps its records in benchmarks/results/*.json (one list, a record per measured configuration) and
its table in a marked section of benchmarks/README.md, so a rerun replaces its own rows and nothing else.
"""

import json
import os
import pathlib
import re

README = pathlib.Path(__file__).resolve().parent / "README.md"


def kernel_record_key(record) -> tuple:
  """What identifies a kernel timing (kernel_decode.py, mgpu_decode.py, mgpu_ab.py): implementation, batch, length
  and configuration; a rerun replaces the records with the same key."""
  return record["impl"], record["batch"], record["seq_len"], json.dumps(record["config"], sort_keys=True)


def merge_file(path: pathlib.Path, new: list, key) -> list:
  """The records in ``path`` (if any) that no record of ``new`` replaces (same ``key(record)``), then ``new``."""
  old = json.loads(path.read_text()) if path.exists() else []
  replaced = {key(r) for r in new}
  return [r for r in old if key(r) not in replaced] + new


def save(out: pathlib.Path, new: list, key) -> list:
  """Merge ``new`` into ``out`` (``merge_file``) and write it; on the device machine ($OUT set) also write the same
  records to a copy under $OUT, where the device tool brings files back: the whole file, the records the tree
  carried there included, so the copy can replace the committed file (a copy of only the new records once did,
  and dropped the earlier runs). Returns the merged records of ``out``."""
  records = merge_file(out, new, key)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(records, indent=1))
  if os.environ.get("OUT"):
    pathlib.Path(os.environ["OUT"], out.name).write_text(json.dumps(records, indent=1))
  return records


def write_readme_section(name: str, table: str, heading: str, readme: pathlib.Path = README) -> None:
  """Put ``table`` between ``<!-- name:begin -->`` and ``<!-- name:end -->`` in the README, replacing what was
  there; the first time, append the section under ``heading``."""
  begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
  section = f"{begin}\n{table}\n{end}"
  text = readme.read_text() if readme.exists() else "# Benchmarks\n"
  if begin in text:
    text = re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: section, text, flags=re.S)
  else:
    text = text.rstrip("\n") + f"\n\n{heading}\n\n{section}\n"
  readme.write_text(text)
