"""Prefill once, ask many (jkv.saved_cache): a document prefilled and saved, loaded and continued by a question,
gives the tokens of one chunked prefill of document + question whose chunk boundary falls at the end of the
document's whole chunks, for every method; a cache that does not belong to the run, or is damaged or half written,
is refused in one line."""

import dataclasses
import json
import os
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import api
from jkv import cli
from jkv import generate as gen
from jkv import prefill as prefill_lib
from jkv import saved_cache
from jkv.attention import choose_impl
from jkv.cache import CacheSpec, KVCache, abstract_bytes
from jkv.config import ModelConfig
from jkv.methods import make_method
from jkv.params import init_random

CFG = ModelConfig(architecture="llama", vocab_size=128, embed=64, ffw_size=128, num_layers=2, q_heads=4, kv_heads=2,
                  head_dim=64, max_position=1024, dtype="float32")
CAPACITY = 384  # the same in every run compared: one shape of every buffer, and the runs share compiled calls
NEW = 6
IMPL = choose_impl("auto")  # what generate runs here: a saved cache holds the layout of the impl it was saved with
# (options, document tokens, the whole chunks of it the cache saved holds): a document is a few tokens past 128 whole
# chunks (the tail is fed after the save, and by every run that loads it), so that its prefill is the reference's
# first chunk (one compiled call); dense's chunks are single tokens, and its 48 fewer than its prefill bucket, so the
# arrays saved are cut below what its prefill wrote.
METHODS = {
    "dense": ({}, 48, 48),
    "kivi": (dict(bits=2, residual=32), 149, 128),
    "ott": (dict(group_size=16, residual=32), 137, 128),
    "zipcache": (dict(salient_ratio=0.5), 150, 128),
    "specache": (dict(residual=32, fetch_rows=16), 133, 128),
}


@pytest.fixture(scope="module")
def params():
  return init_random(CFG, jax.random.key(1), scale=0.15)


@pytest.fixture(scope="module")
def saved(params, tmp_path_factory):
  """saved(name) -> (directory, document ids, what was written, the saving run's tokens): the method's document
  prefilled by generate and saved, once."""
  found = {}

  def save(name):
    if name not in found:
      options, n, head = METHODS[name]
      doc = _ids(n, seed=len(name))
      directory = str(tmp_path_factory.mktemp("caches") / name)
      res = gen.generate(params, CFG, [doc], method=make_method(name, **options), max_new_tokens=NEW, eos_ids=(),
                         capacity=CAPACITY, prefill_chunk=head, save_cache=directory)
      found[name] = (directory, doc, res.stats["cache_saved"], res.tokens)
    return found[name]
  return save


def _ids(n, seed):
  return np.random.default_rng(seed).integers(2, CFG.vocab_size, n).tolist()


@pytest.mark.parametrize("name", list(METHODS))
def test_a_saved_document_continued_by_a_question_equals_one_chunked_prefill(params, saved, name):
  """A question continues a saved document: the tokens are those of one chunked generate of document + question
  with the chunk boundary at the end of the document's whole chunks (the saving run's own tokens those of the
  document alone, chunked so), the last prompt token's logits those of that chunked prefill, and the bytes held the
  same; the arrays were saved cut to the held capacity."""
  options, n, head = METHODS[name]
  method = make_method(name, **options)
  directory, doc, written, answered = saved(name)
  question = _ids(20, seed=7)
  run = dict(method=method, max_new_tokens=NEW, eos_ids=(), capacity=CAPACITY, prefill_chunk=head)
  loaded = gen.generate(params, CFG, [question], cache=directory, **run)
  whole = gen.generate(params, CFG, [doc + question], **run)
  assert whole.stats["prefill_calls"] == 2 and loaded.stats["prefill_calls"] == 1
  assert loaded.tokens == whole.tokens
  assert loaded.stats["held_tokens"] == [head] and loaded.stats["kv_bytes"] == whole.stats["kv_bytes"]
  assert answered == gen.generate(params, CFG, [doc], **run).tokens
  tail = doc[head:]
  np.testing.assert_allclose(_first_logits(params, method, [tail + question], directory, head),
                             _first_logits(params, method, [doc + question], None, head), rtol=1e-5, atol=1e-5)
  # (sized, as the saving run's cache was, for its decode steps: ZipCache's pools depend on them)
  spec = CacheSpec.for_model(CFG, 1, saved_cache.held_capacity(method, [head]),
                             gen.max_decode(NEW, min(gen.DECODE_CHUNK, NEW), None))
  assert written["array_bytes"] == abstract_bytes(method.for_impl(spec, IMPL).abstract(spec)).total
  assert written["held_bytes"] + written["held_host_bytes"] <= written["array_bytes"]
  assert written["array_bytes"] <= written["disk_bytes"] < written["array_bytes"] + 65536  # orbax metadata: kBs


def test_a_continued_cache_is_not_grown_to_a_power_of_two(saved):
  """The default capacity of a loaded cache's continuation holds what is held, the prompt and the new tokens, and is
  not the power-of-two bucket a new prompt of that length gets (that would double a long document's cache)."""
  options, n, head = METHODS["kivi"]
  method = make_method("kivi", **options)
  directory, doc, _, _ = saved("kivi")
  question = _ids(20, seed=7)
  plan = gen.plan_generation(CFG, method, [question], max_new_tokens=NEW, cache=directory)
  need = n + len(question) + NEW  # the held chunks, the rest of the document, the question, the new tokens
  assert need <= plan.capacity < prefill_lib.bucket(n + len(question)) + NEW
  new_prompt = gen.plan_generation(CFG, method, [doc + question], max_new_tokens=NEW)
  assert new_prompt.capacity >= prefill_lib.bucket(need - NEW)


def _first_logits(params, method, prompts, directory, chunk):
  """Last-prompt-token logits [B, vocab] of a chunked prefill, into an empty cache or continuing a saved one (its
  arrays committed, as generate's: the calls it compiled serve)."""
  lengths = [len(p) for p in prompts]
  if directory is None:
    plan = prefill_lib.plan(CFG, method, lengths, CAPACITY, chunk=chunk)
    cache, held = KVCache.create(method, CacheSpec.for_model(CFG, len(prompts), plan.capacity), IMPL), None
  else:
    stored = saved_cache.open_saved(directory)
    held = stored.check_batch(len(prompts))
    plan = prefill_lib.plan_continuation(CFG, method, held, lengths, CAPACITY, chunk=chunk)
    spec = CacheSpec.for_model(CFG, len(prompts), plan.capacity)
    cache = saved_cache.load(stored, params, method.for_impl(spec, IMPL), spec, IMPL, None)[0]
  tokens = prefill_lib.pad_prompts(prompts, plan.width, 0)
  params, cache = gen.committed((params, cache))
  return np.asarray(prefill_lib.Prefill(plan, CFG, tokens, lengths, held)(params, cache)[0])


def test_one_saved_sequence_serves_a_batch_and_a_continued_cache_saves_again(params, saved, tmp_path):
  """Through the API: two questions of different lengths continue one saved document, each its own copy, with the
  tokens each gets alone; one continued cache is saved again (document + question held) and continued once more,
  with the tokens of the whole prompt (dense holds every token exactly). The runs of one question share the calls
  the dense test above compiled."""
  directory, doc, _, _ = saved("dense")
  model = api.Model(CFG, params, None)
  first, second = _ids(16, seed=3), _ids(5, seed=4)
  run = dict(max_new_tokens=NEW, capacity=CAPACITY, prefill_chunk=METHODS["dense"][2])
  both = model.generate([first, second], "dense", cache=directory, **run)
  assert both.tokens == [model.generate([q], "dense", cache=directory, **run).tokens[0] for q in (first, second)]
  again = str(tmp_path / "again")
  out = model.generate([first], "dense", cache=directory, save_cache=again, **run)
  per_token = 2 * CFG.num_layers * CFG.kv_heads * CFG.head_dim * 4
  assert out.stats.raw["cache_saved"]["held_bytes"] == per_token * (len(doc) + 16)
  assert saved_cache.open_saved(again).lengths == [len(doc) + 16]
  chained = model.generate([second], "dense", cache=again, **run)
  assert chained.tokens == model.generate([doc + first + second], "dense", **run).tokens


# ------------------------------------------------------------------------------------------------- refusals


def _refused(params, directory, match, *, cfg=CFG, method=None, prompts=1):
  with pytest.raises((ValueError, OSError), match=match) as e:
    gen.generate(params, cfg, [_ids(5, seed=b) for b in range(prompts)], method=method or make_method("dense"),
                 max_new_tokens=2, eos_ids=(), cache=directory)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_another_model_method_setting_or_batch_is_refused_in_one_line(params, saved, tmp_path):
  dense, _, _, _ = saved("dense")
  _refused(params, dense, r"another model \(num_layers 2 there, 3 here\)", cfg=dataclasses.replace(CFG, num_layers=3))
  _refused(params, dense, r"another model \(dtype \"float32\" there, \"bfloat16\" here\)",
           cfg=dataclasses.replace(CFG, dtype="bfloat16"))
  _refused(jax.tree.map(lambda x: x * 1.01, params), dense, "other weights of this model's shape")
  # One element in the middle of one weight, far from every row's ends, one unit in the last place larger.
  w = np.array(params.layers.w_down)
  middle = tuple(n // 2 for n in w.shape)
  w[middle] = np.nextafter(w[middle], np.float32(np.inf))
  nudged = params.replace(layers=params.layers.replace(w_down=jnp.asarray(w)))
  _refused(nudged, dense, "other weights of this model's shape")
  _refused(params, dense, "holds a dense cache; this run asks for kivi", method=make_method("kivi"))
  kivi, _, _, _ = saved("kivi")
  message = _refused(params, kivi, "holds kivi with other settings", method=make_method("kivi", bits=4, residual=32))
  assert "bits=2 there, 4 here" in message
  two = str(tmp_path / "two")
  gen.generate(params, CFG, [_ids(8, 0), _ids(12, 1)], max_new_tokens=1, eos_ids=(), save_cache=two)
  _refused(params, two, "holds 2 sequences: give 2 prompts", prompts=3)
  with pytest.raises(ValueError, match="prompt 0 has 20 tokens; a saved kivi cache holds whole chunks of 32 tokens"):
    gen.generate(params, CFG, [_ids(20, 0)], method=make_method("kivi", residual=32), save_cache=str(tmp_path / "k"))
  with pytest.raises(FileExistsError, match="saved cache directory .* exists and is not empty"):
    gen.generate(params, CFG, [_ids(8, 0)], max_new_tokens=1, save_cache=two)


def _copy(directory, tmp_path, name):
  target = str(tmp_path / name)
  shutil.copytree(directory, target)
  return target


def _largest_array_file(directory):
  files = [os.path.join(root, f) for root, _, names in os.walk(os.path.join(directory, saved_cache.ARRAYS))
           for f in names]
  return max(files, key=os.path.getsize)


def test_a_damaged_or_half_written_cache_is_refused_naming_the_file(params, saved, tmp_path):
  dense, _, _, _ = saved("dense")
  truncated = _copy(dense, tmp_path, "truncated")
  path = _largest_array_file(truncated)
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 100)
  assert path in _refused(params, truncated, r"is damaged \(truncated: ")
  flipped = _copy(dense, tmp_path, "flipped")
  path = _largest_array_file(flipped)
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 1]))
  assert path in _refused(params, flipped, r"is damaged \(sha256 mismatch\)")
  edited = _copy(dense, tmp_path, "edited")
  marker = os.path.join(edited, saved_cache.MARKER)
  manifest = json.load(open(marker))
  manifest["lengths"] = [7]
  json.dump(manifest, open(marker, "w"))
  _refused(params, edited, rf"{marker} is damaged \(checksum mismatch\)")
  os.remove(marker)
  _refused(params, edited, "is not a saved jkv cache: jkv_cache.json is missing")
  half = str(tmp_path / "half")
  shutil.copytree(dense, half + ".jkv-partial")  # what an interrupted save leaves beside its target
  _refused(params, half, r"half.jkv-partial is left over from an interrupted `jkv generate --save-cache`; delete it")
  _refused(params, str(tmp_path / "nowhere"), "no saved cache at")


def test_the_cli_refuses_a_cache_of_another_model_in_one_line(saved, capsys, default_model_once):
  """One line on stderr, exit status 2, no traceback: the default model is not the tiny one the cache was prefilled
  by."""
  dense, _, _, _ = saved("dense")
  rc = cli.main(["generate", "--cache", dense, "--max-new-tokens", "2", "What is in it?"])
  err = capsys.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("jkv: error")]
  assert rc == 2 and "Traceback" not in err, err
  assert len(lines) == 1 and f"saved cache {dense} was prefilled by another model" in lines[0]


def test_the_benchmark_records_bytes_and_rates(monkeypatch, tmp_path):
  """benchmarks/saved_cache.py --smoke, in this process: one record with the bytes held, saved and on disk and the
  save and load rates, its cache directory removed."""
  monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
  import saved_cache as bench  # benchmarks/saved_cache.py
  out, caches = tmp_path / "records.json", tmp_path / "caches"
  caches.mkdir()
  monkeypatch.setattr(sys, "argv", ["saved_cache.py", "--smoke", "--context", "256", "--methods", "dense",
                                    "--question", "16", "--new-tokens", "1", "--dir", str(caches), "--out", str(out)])
  bench.main()
  (record,) = json.loads(out.read_text())
  assert record["impl"] == "dense" and record["context"] == 256 and record["question_tokens"] == 16
  assert record["held_bytes"] == 256 * 2 * 2 * 2 * 64 * 4 and record["held_host_bytes"] == 0  # L, K/V, H, D, fp32
  assert record["array_bytes"] == record["held_bytes"] <= record["disk_bytes"] < record["array_bytes"] + 65536
  assert record["save_gb_per_s"] > 0 and record["load_gb_per_s"] > 0 and record["question_prefill_s"] > 0
  assert list(caches.iterdir()) == []


def test_an_array_longer_than_this_runs_loads_only_where_the_rest_is_zeros():
  """A saved array is put at the front of this run's shape: grown with zeros, or cut where what lies past this run's
  shape is zeros (a seq run's rounding); anything else past it is refused in one line naming the array."""
  from jkv.cache import ArrayInfo
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 3, 5)).astype(np.float32)
  grown = saved_cache._fitted(x, ArrayInfo((2, 3, 8), np.float32, ("layers", "batch", "tokens")), "a", "d")
  np.testing.assert_array_equal(grown[:, :, :5], x)
  assert not grown[:, :, 5:].any()
  padded = np.concatenate([x, np.zeros((2, 3, 4), np.float32)], axis=2)
  cut = saved_cache._fitted(padded, ArrayInfo((2, 3, 6), np.float32, ("layers", "batch", "tokens")), "a", "d")
  np.testing.assert_array_equal(cut[:, :, :5], x)
  assert not cut[:, :, 5:].any()
  with pytest.raises(ValueError) as e:
    saved_cache._fitted(x, ArrayInfo((2, 3, 4), np.float32, ("layers", "batch", "tokens")), "high.k_codes", "d")
  assert "state array high.k_codes is float32[2, 3, 5], which does not fit this run's float32[2, 3, 4]" in str(e.value)
  assert "\n" not in str(e.value)
