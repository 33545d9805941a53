import optuna
import pytest
from conftest import A100, CPU_AVX2, CPU_AVX512_BF16, H100, T4

from hpo.config import SearchSpace
from hpo.space import CROWDED, PIN_ATTR, SpaceError, by_cost, pin, resolve_precisions, suggest


def space(**changes) -> SearchSpace:
    base = {
        "model_name": ["a", "b"],
        "fp_precision": "auto",
        "target_effective_batch_size": [16, 32],
        "learning_rate": {"low": 1e-5, "high": 1e-3, "log": True},
        "weight_decay": {"low": 0.0, "high": 0.1},
    }
    return SearchSpace.model_validate({**base, **changes})


def test_native_and_auto_start_from_the_native_precisions():
    for declared in ("auto", "native"):
        assert resolve_precisions(declared, CPU_AVX512_BF16) == ("bf16", "none")


def test_by_cost_keeps_the_precisions_within_the_tolerance_of_the_cheapest():
    # AMX Xeon-like: bf16 is the fastest, fp16 "native" but slower than fp32.
    xeon = {"minilm": {"fp16": 0.0766, "bf16": 0.0512, "none": 0.0711}}
    choice = by_cost(xeon, ("fp16", "bf16", "none"), 0.1)
    assert choice.kept == ("bf16",)
    assert choice.dropped == {
        "fp16": "its step took 1.50x bf16's, summed over 1 model(s)",
        "none": "its step took 1.39x bf16's, summed over 1 model(s)"}
    # Within the tolerance, both stay.
    assert by_cost({"m": {"bf16": 1.0, "none": 1.09}}, ("bf16", "none"), 0.1).kept == (
        "bf16", "none")
    # Summed over the models: a tiny model's milliseconds do not keep a slow precision.
    demo = {"minilm": {"bf16": 0.285, "none": 0.414}, "tiny": {"bf16": 0.018, "none": 0.016}}
    assert by_cost(demo, ("bf16", "none"), 0.1).kept == ("bf16",)
    # A configuration not measured in every precision (unusable in one) does not count.
    partial = {"a": {"bf16": 1.0, "none": 2.0}, "b": {"none": 0.1}}
    assert by_cost(partial, ("bf16", "none"), 0.1).kept == ("bf16",)
    # A precision no model could step in is dropped, and the others still compared.
    a100 = by_cost({"m": {"bf16": 0.10, "none": 0.35}}, ("fp16", "bf16", "none"), 0.1)
    assert a100.kept == ("bf16",)
    assert a100.dropped["fp16"] == "no model stepped in it (hpo check)"
    # Nothing measured at all: nothing speaks against any precision.
    assert by_cost({}, ("bf16", "none"), 0.1).kept == ("bf16", "none")


def test_by_cost_keeps_a_precision_only_a_shared_device_kept_from_stepping():
    # An H100 that another process half fills: every model ran out of memory in fp32 even at
    # one sequence. That says nothing of the device alone, and the study decides for good.
    shared = by_cost({"m": {"bf16": 0.10}}, ("bf16", "none"), 0.1, crowded=frozenset({"none"}))
    assert shared.kept == ("bf16", "none") and shared.dropped == {}
    assert shared.unsettled == {"none": CROWDED}
    # The precisions that were timed are still compared among themselves.
    three = by_cost({"m": {"fp16": 0.10, "bf16": 0.30}}, ("fp16", "bf16", "none"), 0.1,
                    crowded=frozenset({"none"}))
    assert three.kept == ("fp16", "none")
    assert three.dropped == {"bf16": "its step took 3.00x fp16's, summed over 1 model(s)"}
    # A precision some model did step in is judged by its cost, crowded or not; one that
    # failed on the device alone (not crowded) is dropped as before.
    timed = by_cost({"m": {"bf16": 0.10, "none": 0.35}}, ("fp16", "bf16", "none"), 0.1,
                    crowded=frozenset({"none"}))
    assert timed.kept == ("bf16",) and timed.unsettled == {}
    assert timed.dropped["fp16"] == "no model stepped in it (hpo check)"
    # No configuration measured in every timed precision: all usable ones and the crowded.
    apart = by_cost({"a": {"bf16": 1.0}, "b": {"fp16": 1.0}}, ("fp16", "bf16", "none"), 0.1,
                    crowded=frozenset({"none"}))
    assert apart.kept == ("fp16", "bf16", "none") and apart.unsettled == {"none": CROWDED}


def test_by_cost_says_when_the_repeats_spread_leaves_a_decision_unsettled():
    # fp32 1.12x bf16's, each time straying 3% over its rounds: the 1.10x edge is within
    # the 6% the ratio may stray, so the drop is unsettled; at 0.5% it is not.
    close = {"m": {"bf16": 1.0, "none": 1.12}}
    loose = by_cost(close, ("bf16", "none"), 0.1, {"m": {"bf16": 0.03, "none": 0.03}})
    assert loose.kept == ("bf16",)
    assert loose.unsettled == {"none": "its step took 1.12x bf16's, within the timed rounds' "
                               "spread (+/-6%) of the tolerance's 1.10x: another run may "
                               "keep it"}
    tight = by_cost(close, ("bf16", "none"), 0.1, {"m": {"bf16": 0.005, "none": 0.005}})
    assert tight.kept == ("bf16",) and tight.unsettled == {}
    # A kept precision near the edge may be dropped by another run.
    near = by_cost({"m": {"bf16": 1.0, "none": 1.08}}, ("bf16", "none"), 0.1,
                   {"m": {"bf16": 0.02, "none": 0.02}})
    assert near.kept == ("bf16", "none") and near.unsettled["none"].endswith("may drop it")
    # Far from the edge, or with no repeats, nothing is unsettled.
    demo = {"minilm": {"bf16": 0.285, "none": 0.414}, "tiny": {"bf16": 0.018, "none": 0.016}}
    spread = {"minilm": {"bf16": 0.05, "none": 0.05}, "tiny": {"bf16": 0.5, "none": 0.5}}
    assert by_cost(demo, ("bf16", "none"), 0.1, spread).unsettled == {}
    assert by_cost(close, ("bf16", "none"), 0.1).unsettled == {}


def test_auto_resolves_to_native_precisions():
    assert resolve_precisions("auto", T4) == ("fp16", "none")
    assert resolve_precisions("auto", A100) == ("fp16", "bf16", "none")
    assert resolve_precisions("auto", H100) == ("fp16", "bf16", "none")
    assert resolve_precisions("auto", CPU_AVX2) == ("none",)
    assert resolve_precisions("auto", CPU_AVX512_BF16) == ("bf16", "none")


def test_explicit_emulated_precision_is_refused():
    with pytest.raises(SpaceError, match="bf16 is not native on cuda \\(Tesla T4"):
        resolve_precisions(["bf16", "none"], T4)
    assert resolve_precisions(["fp16"], T4) == ("fp16",)


def test_pinned_on_creation_and_reused():
    study = optuna.create_study(study_name="s")
    first = pin(study, space(), A100)
    assert study.user_attrs[PIN_ATTR]["fp_precision"] == ["fp16", "bf16", "none"]
    assert pin(study, space(), H100) == first


def test_a_different_space_is_refused():
    study = optuna.create_study(study_name="s")
    pin(study, space(), A100)
    with pytest.raises(SpaceError, match="different search space.*learning_rate"):
        pin(study, space(learning_rate={"low": 1e-4, "high": 1e-3, "log": True}), A100)


def test_a_device_that_cannot_run_a_pinned_precision_is_refused():
    study = optuna.create_study(study_name="s")
    pin(study, space(), A100)
    with pytest.raises(SpaceError, match="bf16 only by emulation"):
        pin(study, space(), T4)


def test_a_stronger_device_joins_and_searches_the_pinned_precisions():
    study = optuna.create_study(study_name="s")
    pin(study, space(), CPU_AVX2)
    assert pin(study, space(), A100).fp_precision == ("none",)


def test_suggest_samples_inside_the_pinned_space():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    pinned = pin(study, space(), T4)
    for _ in range(10):
        trial = study.ask()
        params = suggest(trial, pinned)
        assert params.model_name in ("a", "b")
        assert params.fp_precision in ("fp16", "none")
        assert params.target_effective_batch_size in (16, 32)
        assert 1e-5 <= params.learning_rate <= 1e-3
        assert 0.0 <= params.extras["weight_decay"] <= 0.1
        assert set(trial.params) == {"model_name", "fp_precision", "target_effective_batch_size",
                                     "learning_rate", "weight_decay"}
        study.tell(trial, 0.0)


def test_adapter_trials_sample_their_rate_from_the_adapter_range():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    pinned = pin(study, space(peft=["none", "lora", "dora"], lora_r=[4, 8],
                              adapter_learning_rate={"low": 1e-4, "high": 5e-3, "log": True}),
                 T4)
    methods = set()
    for _ in range(30):
        trial = study.ask()
        params = suggest(trial, pinned)
        method = params.extras["peft"]
        methods.add(method)
        if method == "none":
            assert "adapter_learning_rate" not in trial.params
            assert trial.params["learning_rate"] == params.learning_rate
        else:
            assert "learning_rate" not in trial.params
            assert trial.params["adapter_learning_rate"] == params.learning_rate
            assert 1e-4 <= params.learning_rate <= 5e-3
        assert "adapter_learning_rate" not in params.extras
        study.tell(trial, 0.0)
    assert methods == {"none", "lora", "dora"}


def test_a_space_without_an_adapter_range_samples_in_the_earlier_order():
    def drawn(extra: dict) -> list[str]:
        study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
        trial = study.ask()
        suggest(trial, pin(study, space(**extra), T4))
        return list(trial.params)

    assert drawn({"peft": ["none", "lora"]}) == [
        "model_name", "fp_precision", "target_effective_batch_size", "learning_rate",
        "weight_decay", "peft"]
    with_range = drawn({"peft": ["none", "lora"],
                        "adapter_learning_rate": {"low": 1e-4, "high": 1e-3}})
    assert with_range[3:5] == ["weight_decay", "peft"]
    assert with_range[-1] in ("learning_rate", "adapter_learning_rate")


def test_a_study_created_without_a_device_leaves_auto_to_its_first_worker():
    # `hpo create` on a host without the fleet's GPU ("once, anywhere").
    study = optuna.create_study(study_name="s")
    assert pin(study, space(), None).fp_precision is None
    assert study.user_attrs[PIN_ATTR]["fp_precision"] is None
    assert pin(study, space(), None).fp_precision is None  # created again: still open
    assert pin(study, space(), A100).fp_precision == ("fp16", "bf16", "none")  # first worker
    assert pin(study, space(), H100).fp_precision == ("fp16", "bf16", "none")
    with pytest.raises(SpaceError, match="bf16 only by emulation"):
        pin(study, space(), T4)


def test_an_explicit_list_pinned_without_a_device_is_checked_by_each_worker():
    study = optuna.create_study(study_name="s")
    assert pin(study, space(fp_precision=["bf16"]), None).fp_precision == ("bf16",)
    assert pin(study, space(fp_precision=["bf16"]), A100).fp_precision == ("bf16",)
    with pytest.raises(SpaceError, match="bf16 is not native on cuda \\(Tesla T4"):
        pin(study, space(fp_precision=["bf16"]), T4)
