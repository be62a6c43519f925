"""Evaluation harness: perplexity, pass-key retrieval and side-by-side comparison of cache methods."""
