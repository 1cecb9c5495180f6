"""Checkpoints: the transaction around what an engine writes (save.py: temporary directory,
checksums, commit, `latest`, keep), loading and resume with fallback (load.py), commit records and
write order (record.py), what a resume must match (fingerprint.py), loading without pickle code
(safe_load.py), model weights for export and init (weights.py), the training data's tokenizer a checkpoint
names, verified (tokenizer.py), the errors (errors.py).
Import from the module that defines a name. See docs/architecture.md."""
