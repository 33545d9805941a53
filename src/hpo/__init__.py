"""hpo: precision-aware hyperparameter search for Hugging Face classifiers, on Optuna."""

from hpo.onednn import bound_ideep_cache

# Before any torch operation: ideep reads its capacity once, at a thread's first oneDNN call.
bound_ideep_cache()
