"""The DeepSpeed engine (`parallel.engine=deepspeed`, engine.py) and what it needs of its own:
checkpoint files (checkpoint.py, reshard.py, safe_load.py), expert groups (experts.py), Muon
(muon.py), Engram's tables outside ZeRO (tables.py). DeepSpeed itself is imported on use only;
parallel/__init__.py imports engine.py to register it. See docs/architecture.md."""
