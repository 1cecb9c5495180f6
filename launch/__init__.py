"""torchrun and SLURM launch helpers (the launch issue)."""
