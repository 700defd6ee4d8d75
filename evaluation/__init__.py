"""Evaluation: pass@k of a model on a task suite with the training harness and sandboxes.

Modules: `passk` (the unbiased pass@k estimator), `sources` (model, engine, checkpoint or
generate callable -> a sampler), `evaluate` (the library entry point `evaluate(...)`).
"""
