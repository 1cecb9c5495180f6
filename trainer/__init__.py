"""The composition root: reads the whole config and builds model, data, optimizer and engine.

`python -m trainer` (trainer/__main__.py: Hydra, logging, the process group) -> trainer.app
(building, resume) -> trainer.loop (the loop) -> trainer.step (one step, through the training
engine of parallel.engine); evaluation, checkpoints (trainer.checkpoint), metrics, wandb,
signals and SLURM requeue; `python -m trainer.export` (checkpoint -> Hugging Face).
"""
