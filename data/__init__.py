"""Tokenizers, raw-text sources, the shard writer and the streaming loader (the data issue)."""
