"""Training a model on a device, knowing nothing of Optuna: the training loop, the memory
probes and OOM handling, the models and their adapters, the metrics, the FLOP counts, the
export in Hugging Face format and the typed results of `hpo final`."""
