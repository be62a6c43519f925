"""The tiny random Llama of the suite's model-level tests (``conftest.tiny_llama``), as a plain function, so that a
script which reproduces one of those tests outside pytest (benchmarks/specache_hit_rate_forms.py) builds the same
weights."""

import torch
import transformers


def save_tiny_llama(path) -> transformers.LlamaForCausalLM:
  """A tiny random Llama with KIVI-compatible heads (D=64), saved by transformers to ``path``; returns it.

  Weights are scaled up from the init's 0.02 so attention is peaked enough for comparisons to mean something.
  """
  torch.manual_seed(0)
  config = transformers.LlamaConfig(vocab_size=128, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                    num_attention_heads=6, num_key_value_heads=2, head_dim=64,
                                    max_position_embeddings=2048, eos_token_id=1, bos_token_id=0)
  hf = transformers.LlamaForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
  hf.save_pretrained(path)
  return hf
