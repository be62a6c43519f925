"""generate: batching, stopping, sampling, compilation and bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jkv import generate as gen
from jkv.methods import make_method
from jkv.sampling import Greedy, Sampling, make_sampler
from conftest import has_pallas_gpu, random_prompts


def test_batch_of_different_lengths_equals_each_alone(tiny_llama):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [7, 23, 40], seed=11)
  batch = gen.generate(m.params, m.config, prompts, max_new_tokens=24, eos_ids=(), chunk=8)
  for b, p in enumerate(prompts):
    # The batch's capacity (each alone would plan its own): one decode program for the three runs alone.
    alone = gen.generate(m.params, m.config, [p], max_new_tokens=24, eos_ids=(), chunk=8,
                         capacity=batch.stats["capacity"])
    assert alone.tokens[0] == batch.tokens[b]
  assert all(len(t) == 24 for t in batch.tokens)


def test_second_call_with_same_shapes_compiles_nothing(tiny_llama):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [9, 12], seed=1)
  gen.generate(m.params, m.config, prompts, max_new_tokens=16, chunk=8)
  with gen.CompileCounter() as counter:
    # Other prompts of lengths in the same bucket: same shapes, nothing to compile.
    res = gen.generate(m.params, m.config, random_prompts(m.config.vocab_size, [10, 3], seed=2),
                       max_new_tokens=16, chunk=8)
  assert counter.count == 0
  assert res.stats["compiles"] == 0
  # 15 steps after the first token in chunks of 8: two chunks, timed within the decode's time.
  chunks = res.stats["decode_chunk_s"]
  assert len(chunks) == 2 and min(chunks) > 0 and sum(chunks) <= res.stats["decode_s"]


def test_stops_each_sequence_at_eos(tiny_llama):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [6, 13], seed=4)
  free = gen.generate(m.params, m.config, prompts, max_new_tokens=20, eos_ids=(), chunk=4)
  stop = free.tokens[0][5]  # make the first sequence's sixth token an end token
  res = gen.generate(m.params, m.config, prompts, max_new_tokens=20, eos_ids=(stop,), chunk=4)
  for b in range(2):
    expect = free.tokens[b][:free.tokens[b].index(stop)] if stop in free.tokens[b] else free.tokens[b]
    assert res.tokens[b] == expect
  assert len(res.tokens[0]) == 5


@pytest.mark.parametrize("vocab", [7, 512])
def test_greedy_is_the_first_largest_logit(vocab):
  rng = np.random.default_rng(vocab)
  # Coarse values, so rows tie at their maximum; a row of one value; -inf entries.
  logits = rng.integers(-4, 4, size=(64, vocab)).astype(np.float32)
  logits[1] = 2.0
  logits[2, ::2] = -np.inf
  got = np.asarray(Greedy().next_tokens(jnp.asarray(logits), None))
  want = [min(i for i in range(vocab) if row[i] == row.max()) for row in logits]
  assert got.dtype == np.int32 and got.tolist() == want


def test_sampling_is_seeded_and_top_k_1_is_greedy(tiny_llama):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [8, 15], seed=7)
  run = lambda sampler, seed=0: gen.generate(m.params, m.config, prompts, max_new_tokens=12, sampler=sampler,
                                             seed=seed, eos_ids=()).tokens
  hot = Sampling(temperature=2.0)
  assert run(hot, 1) == run(hot, 1)
  assert run(hot, 1) != run(hot, 2)
  assert run(Sampling(temperature=0.7, top_k=1)) == run(Greedy())
  assert run(Sampling(temperature=0.7, top_p=1e-6)) == run(Greedy())


def test_top_p_keeps_only_the_nucleus():
  import jax
  import jax.numpy as jnp
  # Probabilities 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two tokens only.
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  draws = jax.vmap(lambda k: Sampling(temperature=1.0, top_p=0.7).next_tokens(logits, k))(
      jax.random.split(jax.random.key(0), 2000))
  counts = np.bincount(np.asarray(draws).ravel(), minlength=4)
  assert counts[2] == counts[3] == 0
  assert 0.55 < counts[0] / counts[:2].sum() < 0.70  # 0.5 / 0.8 = 0.625


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=0.0, top_k=3), "top_k/top_p need a temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
])
def test_invalid_sampling_values_are_rejected(kwargs, message):
  with pytest.raises(ValueError, match=message):
    make_sampler(**kwargs)


def test_prompt_longer_than_capacity_is_rejected(tiny_llama):
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [100], seed=0)
  with pytest.raises(ValueError, match="exceeds the cache capacity of 64"):
    gen.generate(m.params, m.config, prompts, max_new_tokens=8, capacity=64)
  long_cfg = dataclasses.replace(m.config, max_position=64)
  with pytest.raises(ValueError, match="exceeds the model's context of 64"):
    gen.generate(m.params, long_cfg, prompts, max_new_tokens=8)


def test_unknown_method_and_option_are_rejected():
  with pytest.raises(ValueError, match="unknown cache method 'kiwi'; known methods: .*dense"):
    make_method("kiwi")
  with pytest.raises(ValueError, match="method 'dense' has no option bits"):
    make_method("dense", bits=2)


def test_empty_prompt_is_rejected(tiny_llama):
  _, m = tiny_llama
  with pytest.raises(ValueError, match="prompt 0 must be a non-empty flat list"):
    gen.generate(m.params, m.config, [[]], max_new_tokens=4)


def test_kivi_batch_of_different_lengths_equals_each_alone(tiny_llama):
  """Through generate: prompts of different lengths flush at different steps; each row equals its run alone."""
  _, m = tiny_llama
  method = make_method("kivi", bits=2, residual=32)
  prompts = random_prompts(m.config.vocab_size, [7, 33, 50], seed=12)
  batch = gen.generate(m.params, m.config, prompts, method=method, max_new_tokens=40, eos_ids=(), chunk=8)
  for b, p in enumerate(prompts):
    alone = gen.generate(m.params, m.config, [p], method=method, max_new_tokens=40, eos_ids=(), chunk=8,
                         capacity=batch.stats["capacity"])  # as above: one decode program for the runs alone
    assert alone.tokens[0] == batch.tokens[b]


@pytest.mark.skipif(not has_pallas_gpu(), reason="needs a CUDA GPU with compute capability >= 8.0")
@pytest.mark.parametrize("name, options", [
    ("kivi", dict(bits=2, residual=32)),
    ("kivi", dict(bits=4, residual=64, quantize_before_attend=True, mma=True)),
    ("specache", dict(bits=1, residual=32, fetch_rows=8)),
], ids=["kivi2", "kivi4-quantize-first", "specache1"])
def test_compiled_kernels_generate_the_xla_paths_tokens(tiny_llama, name, options):
  """On the GPU, the whole method through generate (quantize-and-pack, flushes into the rings, the fused kernel
  reading store and rings in place; SpeCache's host fetch) gives the XLA path's tokens, across several flushes.

  KIVI-4 keeps its store in the Hopper kernel's packing on both paths (``mma=True``; the XLA path reads it too):
  the packing's folded zero-points round apart from the library layout's (``mma_layout``), which the packing's own
  tests bound, and a path on each layout could part at a margin above the near-tie below.

  Where a sequence first differs, the XLA path must have been at a near-tie there: its logit for the kernel path's
  token within 1e-2 of its own choice (the two paths sum in different orders; on an H200 one of the four
  sequences once took the runner-up at its 70th token). Past that point the sequences differ and are not compared.
  """
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [300, 171, 64, 233], seed=13)
  method = make_method(name, **options)
  samplers = {impl: _GreedyKeepingLogits() for impl in ("pallas", "xla")}
  runs = {impl: gen.generate(m.params, m.config, prompts, method=method, max_new_tokens=70, eos_ids=(), chunk=8,
                             attention_impl=impl, sampler=samplers[impl]).tokens for impl in samplers}
  logits = np.stack(samplers["xla"].seen)  # [calls, B, vocab]: call i chose every sequence's token i
  assert [list(np.argmax(logits[:70, b], axis=-1)) for b in range(len(prompts))] == runs["xla"]  # in call order
  for b, (got, want) in enumerate(zip(runs["pallas"], runs["xla"])):
    assert len(got) == len(want) == 70
    differ = [i for i in range(70) if got[i] != want[i]]
    if differ:
      i = differ[0]
      gap = logits[i, b, want[i]] - logits[i, b, got[i]]
      assert gap <= 1e-2, f"sequence {b} differs at token {i}, where the XLA path's margin was {gap:.4f}"


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: each instance compiles with its own callback
class _GreedyKeepingLogits:
  """Greedy decoding that keeps each call's logits [B, vocab] on the host as they arrive (an unordered callback:
  an ordered one does not compile ahead of time beside SpeCache's host-memory arrays in jax 0.11; the test checks
  the order by the tokens chosen)."""
  seen: list = dataclasses.field(default_factory=list)

  def next_tokens(self, logits, key):
    jax.debug.callback(lambda x: self.seen.append(np.asarray(x, np.float64)), logits)
    return Greedy().next_tokens(logits, key)


@pytest.mark.parametrize("prompts, message", [
    ([[5, 6, -1]], "prompt 0 token 2: id -1 is outside the vocabulary"),
    ([[5], [6, 10**9]], "prompt 1 token 1: id 1000000000 is outside the vocabulary"),
    ([[5, 128]], "id 128 is outside the vocabulary \\[0, 128\\)"),
    ([[5, 6.5]], "non-integer token ids"),
    ([[True, False]], "non-integer token ids"),
    ([[[1, 2]]], "non-empty flat list"),
    ("hello", "non-empty list of token-id lists"),
    ([], "non-empty list of token-id lists"),
])
def test_invalid_token_ids_are_rejected(tiny_llama, prompts, message):
  _, m = tiny_llama
  with pytest.raises(ValueError, match=message) as e:
    gen.generate(m.params, m.config, prompts, max_new_tokens=4)
  assert "\n" not in str(e.value)
  if isinstance(prompts, list) and len(prompts) == 1:
    with pytest.raises(ValueError, match=message):
      list(gen.stream(m.params, m.config, prompts[0], max_new_tokens=4))


def test_non_finite_logits_raise_instead_of_returning_tokens(tiny_llama):
  _, m = tiny_llama
  gate_up = m.params.layers.gate_up.at[1, 0, 1, 0].set(np.nan)  # layer 1's up projection
  params = m.params.replace(layers=m.params.layers.replace(gate_up=gate_up))
  prompts = random_prompts(m.config.vocab_size, [6, 9], seed=1)
  with pytest.raises(ValueError, match=r"non-finite logits for sequence\(s\) 0, 1") as e:
    gen.generate(params, m.config, prompts, max_new_tokens=4)
  assert "\n" not in str(e.value)


def test_capacity_below_the_padded_prompt_bucket_still_runs(tiny_llama):
  """A 20-token prompt pads to a bucket of 32; a capacity of 24 holds it plus 4 new tokens and must work."""
  _, m = tiny_llama
  prompts = random_prompts(m.config.vocab_size, [20], seed=3)
  small = gen.generate(m.params, m.config, prompts, max_new_tokens=4, capacity=24, eos_ids=(), chunk=4)
  big = gen.generate(m.params, m.config, prompts, max_new_tokens=4, eos_ids=(), chunk=4)
  assert small.tokens == big.tokens
  with pytest.raises(ValueError, match="capacity must be >= 1"):
    gen.generate(m.params, m.config, prompts, max_new_tokens=4, capacity=0)
