"""Engram conditional memory: the layer and its training hook (layer.py), the n-gram hashing
(hashing.py). See docs/architecture.md."""
