"""Device mesh, FSDP2, expert parallelism, activation checkpointing and compile.

Applied from outside to a plain `model.Transformer` built on the meta device (the distributed issue).
"""
