"""A peer hpo is measured against: Ray Tune as transformers documents it,
`Trainer.hyperparameter_search(backend="ray")`, with Ray's ASHA scheduler and Optuna's TPE as
the search algorithm (`OptunaSearch`), and the expert's switches (peer_trainer.py).

    python benchmarks/peer_ray.py --seed 0 --n-trials 20 --trials-out ray-trials.json

It starts a local Ray runtime on all cores and runs one trial at a time on all of them, so it
gets the same compute as every other tool. The study file gives what it gives the other peers
(peer_trainer.Setup): data, split, space, epochs, warm-up, clipping, loss weights, TPE's
startup trials and the seed. ASHA stops a trial at an epoch's end unless it ranks in the
better half of the trials that reached that epoch (grace period 1 epoch, reduction factor 2,
at most the study's epochs). Each trial's reports are written to `--trials-out`: state
(COMPLETE, or PRUNED when ASHA stopped it early), its best epoch's macro-F1, its model, and
when it started and ended (Unix time).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
from pathlib import Path

from peer_trainer import expert_switches, quiet_libraries, setup
from transformers import DataCollatorWithPadding, Trainer

ASHA_REDUCTION_FACTOR = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--study", default="demo")
    parser.add_argument("--seed", type=int, default=0, help="the TPE sampler's seed")
    parser.add_argument("--n-trials", type=int, required=True)
    parser.add_argument("--trials-out", type=Path, required=True)
    args = parser.parse_args()
    quiet_libraries()

    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.optuna import OptunaSearch

    peer = setup(args.study)
    space = peer.config.search_space
    epochs = peer.config.training.epochs
    cores = os.cpu_count() or 1
    # Trials keep the working directory: the study's models and data are relative paths.
    os.environ["RAY_CHDIR_TO_TRIAL_DIR"] = "0"
    ray.init(num_cpus=cores, include_dashboard=False, log_to_driver=False,
             logging_level=logging.WARNING)

    def hp_space(_trial) -> dict:
        rate = space.learning_rate
        params = {
            "model_name": tune.choice(space.model_name),
            "per_device_train_batch_size": tune.choice(space.target_effective_batch_size),
            "learning_rate": (tune.loguniform if rate.log else tune.uniform)(rate.low,
                                                                            rate.high),
        }
        if space.weight_decay is not None:
            params["weight_decay"] = tune.uniform(space.weight_decay.low,
                                                  space.weight_decay.high)
        return params

    def model_init(trial: dict | None):
        # Called with no trial by the Trainer's constructor, with each trial's sampled
        # configuration in Ray's worker, where `trainer` is that worker's copy.
        name = trial["model_name"] if trial else space.model_name[0]
        tokenizer, train_rows, validation_rows = peer.per_model[name]
        if trial:
            trainer.train_dataset, trainer.eval_dataset = train_rows, validation_rows
            trainer.data_collator = DataCollatorWithPadding(tokenizer)
        return peer.model(name)

    first_tokenizer, first_train, first_validation = peer.per_model[space.model_name[0]]
    with tempfile.TemporaryDirectory() as output:
        trainer = Trainer(
            model_init=model_init, args=peer.arguments(output, **expert_switches()),
            train_dataset=first_train, eval_dataset=first_validation,
            data_collator=DataCollatorWithPadding(first_tokenizer),
            compute_metrics=peer.compute_metrics, compute_loss_func=peer.loss,
        )
        best = trainer.hyperparameter_search(
            hp_space=hp_space, compute_objective=lambda scores: scores["eval_macro_f1"],
            direction="maximize", backend="ray", n_trials=args.n_trials,
            search_alg=OptunaSearch(metric="objective", mode="max",
                                    sampler=peer.sampler(args.seed)),
            scheduler=ASHAScheduler(metric="objective", mode="max", time_attr="epoch",
                                    max_t=epochs, grace_period=1,
                                    reduction_factor=ASHA_REDUCTION_FACTOR),
            resources_per_trial={"cpu": cores}, max_concurrent_trials=1,
            storage_path=output, name="search", verbose=0,
        )
        rows = []
        for number, trial in enumerate(best.run_summary.trials):
            last = trial.last_result
            rows.append({
                "number": number,
                "state": "COMPLETE" if round(last.get("epoch", 0)) >= epochs else "PRUNED",
                "value": trial.metric_analysis["eval_macro_f1"]["max"],
                "model": trial.config["model_name"].rsplit("/", 1)[-1],
                "start": last["timestamp"] - last["time_total_s"],
                "end": last["timestamp"],
            })
    ray.shutdown()
    args.trials_out.write_text(json.dumps({"trials": rows}, indent=1))
    print(f"best trial {best.run_id}: {best.objective:.4f} {best.hyperparameters}")


if __name__ == "__main__":
    main()
