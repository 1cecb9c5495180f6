"""The composition root: reads the whole config and builds model, data, optimizer and parallelism.

The training loop, evaluation, checkpointing and export arrive with the trainer issue; for now this
package holds the structured-config registration that the Hydra app will use.
"""
