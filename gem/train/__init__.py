"""The trainer: DeepSpeed setup, the loop, checkpoints, MLflow and the final report.

Importing this package imports torch; `gem.api` and `gem.launcher` never do.
"""
