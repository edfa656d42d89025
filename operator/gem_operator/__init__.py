"""gem_operator: a kopf operator that reconciles GEMTraining and LoopFMDistill into PyTorchJobs.

Importing this package does not import kopf; `gem_operator.handlers` registers the handlers.
"""
