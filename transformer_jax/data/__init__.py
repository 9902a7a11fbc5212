"""Data sources and tokenizers. Knows nothing of models."""
