"""Token mixers: the TokenMixer protocol (mixer.py), softmax attention (attention.py, mla.py, with
their kernels' choice in attention_backend.py), the delta-rule mixers (gdn.py, kda.py), the
generation state each mixer keeps (kv_cache.py), masks and positions. See docs/architecture.md."""
