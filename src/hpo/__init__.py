"""hpo: precision-aware hyperparameter search for Hugging Face classifiers, on Optuna."""
