"""Evaluation harness: perplexity against transformers, pass-key prompts, method specs and ``compare``."""

import dataclasses

import numpy as np
import pytest
import torch

from jkv import methods as methods_lib
from jkv.cli import main
from jkv.evaluation import compare as compare_lib
from jkv.evaluation import passkey as passkey_lib
from jkv.evaluation import perplexity as ppl_lib
from jkv.methods.dense import Dense


def hf_window_nll(hf, ids, plan):
  """Per-window NLLs [N, S] of the tokens the harness scores, from one full causal forward of transformers."""
  out = []
  for s in plan.starts(len(ids)):
    window = torch.tensor(np.asarray(ids[s:s + plan.window])[None], dtype=torch.long)
    with torch.no_grad():
      logp = torch.log_softmax(hf(window).logits[0].double(), dim=-1).numpy()
    pred = np.arange(plan.context, plan.window - 1)  # position t predicts token t + 1
    out.append(-logp[pred, window[0, pred + 1].numpy()])
  return np.stack(out)


def test_dense_ppl_equals_transformers_tiny(tiny_llama):
  hf, m = tiny_llama
  ids = np.random.default_rng(0).integers(2, m.config.vocab_size, 3000).tolist()
  # 3 windows in batches of 2: the last batch is padded, and must not change the result.
  plan = ppl_lib.WindowPlan(context=45, scored=20, num_windows=3, seed=3, batch_size=2)
  res = ppl_lib.perplexity(m.params, m.config, ids, method=Dense(), plan=plan, progress=False)
  ref = hf_window_nll(hf, ids, plan)
  assert res.tokens_scored == ref.size == 60
  np.testing.assert_allclose(res.window_nll, ref.mean(axis=1), rtol=1e-5)
  np.testing.assert_allclose(res.ppl, np.exp(ref.mean()), rtol=1e-5)
  assert res.kv_bytes == res.dense_kv_bytes > 0


def test_dense_ppl_equals_transformers_default_model(default_model, hf_default_model):
  text = ppl_lib.default_text()[:20000]
  ids = default_model.tokenizer.encode(text, add_bos=False)
  plan = ppl_lib.WindowPlan(context=64, scored=16, num_windows=2, seed=0, batch_size=2)
  res = ppl_lib.perplexity(default_model.params, default_model.config, ids, plan=plan, progress=False)
  ref = hf_window_nll(hf_default_model, ids, plan)
  np.testing.assert_allclose(res.ppl, np.exp(ref.mean()), rtol=1e-4)
  assert 1.5 < res.ppl < 100  # real English under a real model


def test_windows_are_fixed_disjoint_and_checked():
  plan = ppl_lib.WindowPlan(context=10, scored=5, num_windows=4, seed=1)
  starts = plan.starts(1000)
  np.testing.assert_array_equal(starts, plan.starts(1000))
  assert np.all(np.diff(starts) >= plan.window) and starts[-1] + plan.window <= 1000
  assert not np.array_equal(starts, dataclasses.replace(plan, seed=2).starts(1000))
  with pytest.raises(ValueError, match="room for 3 windows"):
    plan.starts(3 * plan.window + 2)


@pytest.mark.parametrize("length", [200, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("chat", [False, True])
def test_passkey_prompt_has_length_and_depth(default_model, length, depth, chat):
  tok = default_model.tokenizer
  p = passkey_lib.build_prompt(tok, length, depth, 40719, chat=chat)
  assert len(p.ids) == length
  needle = tok.encode(passkey_lib.NEEDLE.format(key="40719"), add_bos=False)
  assert p.ids[p.needle_start:p.needle_start + len(needle)] == needle
  assert tok.decode(p.ids).count("40719") == 2
  # The filler before the key is `depth` of all filler, to within one filler sentence (<= 6 tokens), and
  # ends a sentence.
  before = p.needle_start - p.filler_start
  assert abs(before - depth * p.filler_tokens) <= 6
  assert before == 0 or tok.decode(p.ids[p.needle_start - 1:p.needle_start]) == "."
  question = tok.encode(passkey_lib.QUESTION, add_bos=False)
  if chat:
    assert tok.decode(p.ids).endswith("<|im_start|>assistant\nThe pass key is")
  else:
    assert p.ids[-len(question):] == question
    assert p.ids[:p.filler_start] == tok.encode(passkey_lib.INSTRUCTION)


def test_passkey_prompt_rejects_bad_input(default_model):
  with pytest.raises(ValueError, match="too short"):
    passkey_lib.build_prompt(default_model.tokenizer, 30, 0.5, 12345)
  with pytest.raises(ValueError, match="depth"):
    passkey_lib.build_prompt(default_model.tokenizer, 300, 1.5, 12345)


def test_parse_key():
  assert passkey_lib.parse_key(" 86556. The") == "86556"
  assert passkey_lib.parse_key("the key is 123456 or 54321") == "54321"
  assert passkey_lib.parse_key(" 5602. Remember") is None


def test_method_specs_parse_coerce_and_label():
  spec = compare_lib.MethodSpec.parse("fakequant:bits=2,key_axis=token,value_axis=channel")
  assert spec.method() == methods_lib.make_method("fakequant", bits=2, key_axis="token", value_axis="channel")
  assert spec.label == "fakequant:bits=2,key_axis=token,value_axis=channel"
  assert compare_lib.MethodSpec.parse("dense").label == "dense"
  kivi = compare_lib.MethodSpec.parse("kivi:bits=4,quantize_before_attend=true,k_bits=none,residual=64")
  assert kivi.method() == methods_lib.make_method("kivi", bits=4, quantize_before_attend=True, residual=64)
  assert kivi.label == "kivi:bits=4,quantize_before_attend=True,k_bits=None,residual=64"


@pytest.mark.parametrize("text, message", [
    ("densest", "unknown cache method 'densest'; known methods: dense, "),
    ("kivi:bitz=2", "method 'kivi' has no option bitz; its options: bits, "),
    ("kivi:bits=two", "option bits: expected int, got 'two'"),
    ("kivi:bits", "expected option=value"),
])
def test_bad_method_specs_are_rejected_in_one_line(text, message):
  with pytest.raises(ValueError, match=message) as e:
    compare_lib.MethodSpec.parse(text)
  assert "\n" not in str(e.value)


def test_compare_cli_rejects_unknown_methods_before_loading(capsys):
  assert main(["compare", "--methods", "dense", "nosuch:bits=2", "--model", "/nonexistent"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "unknown cache method 'nosuch'" in err


def test_compare_returns_every_requested_row_tiny(tiny_llama):
  _, m = tiny_llama
  ids = np.random.default_rng(1).integers(2, m.config.vocab_size, 2000).tolist()
  # One fakequant layout (the others run the same compare path; tests/test_fake_quant.py holds each to its oracle).
  texts = ["dense", "kivi:bits=4,residual=32", "kivi:bits=2,residual=32",
           "fakequant:bits=2,key_axis=channel,value_axis=token", "specache:fetch_rows=8,residual=32"]
  plan = ppl_lib.WindowPlan(context=70, scored=12, num_windows=2, batch_size=2)
  rows = compare_lib.compare(m, compare_lib.parse_methods(texts), token_ids=ids, ppl=plan, passkey=None,
                             progress=False)
  assert [r["method"] for r in rows] == texts
  for r in rows:
    for key in ("method", "kv_bytes", "dense_kv_bytes", "compression", "ppl", "delta_ppl", "passkey_acc",
                "decode_tokens_per_s"):
      assert key in r
    assert r["dense_kv_bytes"] == rows[0]["dense_kv_bytes"] and r["decode_tokens_per_s"] > 0
  assert rows[0]["compression"] == 1.0 and rows[0]["delta_ppl"] == 0.0
  assert rows[2]["compression"] > rows[1]["compression"] > 1.0
  assert all(np.isfinite(r["ppl"]) for r in rows)
  # Host-held bytes get their own column only when a method holds some, and decode statistics are reported.
  assert [r["kv_host_bytes"] > 0 for r in rows] == [False] * 4 + [True]
  assert "host KV bytes" in compare_lib.markdown_table(rows)
  assert "host KV bytes" not in compare_lib.markdown_table(rows[:4])
  assert 0.0 <= rows[4]["method_stats"]["speculation_hit_rate"] <= 1.0
  # Dense here is the same computation as the dense perplexity run alone.
  alone = ppl_lib.perplexity(m.params, m.config, ids, plan=plan, progress=False)
  assert rows[0]["ppl"] == pytest.approx(alone.ppl, rel=1e-6)


def test_compare_with_passkey_on_default_model(default_model):
  """The pass-key columns of a compare row (dense: every method runs the same pass-key path, and the tiny model's
  test above takes compare through several methods)."""
  ids = default_model.tokenizer.encode(ppl_lib.default_text()[:8000], add_bos=False)
  plan = ppl_lib.WindowPlan(context=40, scored=8, num_windows=1, batch_size=1)
  grid = passkey_lib.PasskeyGrid(lengths=(160,), depths=(0.0, 0.5), trials=1, batch_size=2)
  rows = compare_lib.compare(default_model, compare_lib.parse_methods(["dense"]), token_ids=ids, ppl=plan,
                             passkey=grid, progress=False)
  assert [r["method"] for r in rows] == ["dense"]
  assert rows[0]["passkey_acc"] == 1.0  # the default model retrieves a key from a short haystack
  assert len(rows[0]["passkey_accuracy"]) == 1 and len(rows[0]["passkey_accuracy"][0]) == 2
