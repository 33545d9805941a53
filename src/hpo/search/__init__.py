"""The study in its storage, shared by every worker: the storage itself (URLs, drivers, outages
outlived), the study's sampler, pruner and shared batch cache, the exact study-wide budget,
the liveness of running trials, the artifact store and the release a study was made with."""
