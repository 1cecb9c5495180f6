"""Tokenizers, raw-text sources, the shard writer and the streaming loader.

Entry points:
- `python -m data.prepare source=... out=... tokenizer=... vocab_size=...` (`data.prepare`)
- `data.tokenizer.load_tokenizer`, `data.bpe.train_bpe`: tiktoken encodings with an identity
- `data.loader.TokenLoader`: per-rank batches of one seeded global order, exactly resumable
- `data.manifest.Manifest`: what a prepared dataset directory holds

Never imports model/, optim/, parallel/ or trainer/ (tests/test_import_rules.py).
"""
