"""Multi-token prediction: the MTP modules and their training hook (heads.py), and self-speculative
decoding with them (speculative.py). See docs/architecture.md."""
