"""The model against transformers: the real default model in fp32, and the cached path against the uncached one."""

import jax.numpy as jnp
import numpy as np
import torch

from jkv import generate as gen
from jkv import model as model_lib
from jkv.cache import CacheSpec, KVCache
from jkv.methods.dense import Dense
from conftest import random_prompts

PARIS_PROMPT = "What is the capital of France?"


def _long_prompt(tokenizer, n):
  import pydoc_data.topics
  text = pydoc_data.topics.topics["assert"] + pydoc_data.topics.topics["while"]
  ids = tokenizer.encode(text)
  assert len(ids) >= n
  return ids[:n]


def test_default_model_logits_match_transformers(default_model, hf_default_model):
  ids = _long_prompt(default_model.tokenizer, 300)
  ours = np.asarray(model_lib.forward_no_cache(default_model.params, default_model.config, jnp.asarray([ids])))
  with torch.no_grad():
    ref = hf_default_model(torch.tensor([ids])).logits.numpy()
  assert np.abs(ours - ref).max() <= 1e-3


def test_default_model_greedy_64_tokens_match_transformers(default_model, hf_default_model):
  tok = default_model.tokenizer
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}]),
                   add_bos=False)
  ours = gen.generate(default_model.params, default_model.config, [ids], max_new_tokens=64, eos_ids=())
  with torch.no_grad():
    ref = hf_default_model.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
  assert ours.tokens[0] == ref[0, len(ids):].tolist()


def test_cached_prefill_and_decode_match_uncached_logits(tiny_llama):
  """Prefill a right-padded batch into the dense cache, decode token by token: each step's logits equal the
  uncached forward over the whole sequence. One uncached forward per sequence, over the prompt and the 4 tokens
  decoded, gives every reference: its logits at position t see tokens <= t only (causal), which the logits of
  each shorter prefix as a sequence of its own confirm here for the prompt."""
  _, m = tiny_llama
  cfg, params = m.config, m.params
  seqs = random_prompts(cfg.vocab_size, [20, 9], seed=3)
  prompt_lens = [12, 5]
  T = 16
  tokens = np.zeros((2, T), np.int32)
  positions = np.full((2, T), -1, np.int32)
  for b, n in enumerate(prompt_lens):
    tokens[b, :n] = seqs[b][:n]
    positions[b, :n] = np.arange(n)
  cache = KVCache.create(Dense(), CacheSpec.for_model(cfg, 2, 32))
  logits, cache = model_lib.forward(params, jnp.asarray(tokens), jnp.asarray(positions), cache, cfg=cfg,
                                    prefill=True)
  np.testing.assert_array_equal(np.asarray(cache.lengths), prompt_lens)
  refs = []
  for b, n in enumerate(prompt_lens):
    ref = np.asarray(model_lib.forward_no_cache(params, cfg, jnp.asarray([seqs[b][:n]])))[0]
    np.testing.assert_allclose(np.asarray(logits)[b, :n], ref, atol=2e-4, rtol=2e-4)
    refs.append(np.asarray(model_lib.forward_no_cache(params, cfg, jnp.asarray([seqs[b][:n + 4]])))[0])
    np.testing.assert_allclose(refs[b][:n], ref, atol=2e-4, rtol=2e-4)  # the prompt's logits, in the longer call
  for step in range(4):
    nxt = jnp.asarray([[seqs[b][prompt_lens[b] + step]] for b in range(2)], jnp.int32)
    logits, cache = model_lib.forward(params, nxt, cache.lengths[:, None], cache, cfg=cfg)
    for b, n in enumerate(prompt_lens):
      np.testing.assert_allclose(np.asarray(logits)[b, 0], refs[b][n + step], atol=2e-4, rtol=2e-4)


def test_tiny_model_logits_match_transformers(tiny_llama):
  hf, m = tiny_llama
  ids = random_prompts(m.config.vocab_size, [33], seed=5)
  ours = np.asarray(model_lib.forward_no_cache(m.params, m.config, jnp.asarray(ids)))
  with torch.no_grad():
    ref = hf(torch.tensor(ids)).logits.numpy()
  np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max(), rtol=1e-4)


def test_bfloat16_is_at_least_as_close_to_float32_as_transformers_bfloat16(default_model, hf_default_model):
  """bf16 parity on the default model, for the README's question and a 300-token prompt: jkv in bfloat16
  (fp32 residual stream, fp32 accumulation, fp32 logits) is no farther from the fp32 logits than transformers
  in bfloat16 is, its greedy tokens equal transformers' bfloat16 greedy tokens, and it answers Paris.

  The bound: relative L2 error of every position's logits against transformers' fp32 logits (jkv's fp32 logits
  match those to 1e-3, test above); transformers' own bf16 error is measured in the same test."""
  import copy
  from jkv.load import load_model
  tok = default_model.tokenizer
  hf16 = copy.deepcopy(hf_default_model).to(torch.bfloat16)
  m16 = load_model("default", "bfloat16")
  question = tok.encode(tok.apply_chat_template([{"role": "user", "content": PARIS_PROMPT}]), add_bos=False)
  for ids in (question, _long_prompt(tok, 300)):
    with torch.no_grad():
      ref32 = hf_default_model(torch.tensor([ids])).logits[0].numpy()
      ref16 = hf16(torch.tensor([ids])).logits[0].float().numpy()
      greedy16 = hf16.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    ours16 = np.asarray(model_lib.forward_no_cache(m16.params, m16.config, jnp.asarray([ids])))[0]
    rel = lambda x: np.linalg.norm(x - ref32) / np.linalg.norm(ref32)
    assert rel(ours16) <= rel(ref16), (rel(ours16), rel(ref16))
    ours = gen.generate(m16.params, m16.config, [ids], max_new_tokens=16, eos_ids=()).tokens[0]
    assert ours[:len(greedy16)] == greedy16  # transformers stops at its end token
    if ids is question:
      answer = ours
  assert "Paris" in tok.decode(answer)
