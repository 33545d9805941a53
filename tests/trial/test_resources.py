"""What a worker process keeps across trials: every model read and tokenized once, before
the first trial, and tokenized splits shared through the machine's disk cache."""


from conftest import load, run_in_process


def run(study_file, storage, n) -> int:
    # --verbose: where each model's tokens came from is said only then.
    return run_in_process(study_file, storage, n, "--verbose")


def test_tokenization_is_done_once_per_machine(tiny_study, tmp_path, token_cache_dir, capsys):
    """A worker reads every model and tokenizes its splits once, before the first trial; a
    later worker (here: another study on the same data) reads them from the disk cache."""
    first, second = (f"sqlite:///{tmp_path / name}" for name in ("a.db", "b.db"))
    assert run(tiny_study, first, 3) == 0
    assert "tiny-bert tokenizer; tiny-bert-b tokenizer" in capsys.readouterr().out
    assert {t.user_attrs["tokenization"] for t in load(first).trials} == {"worker memory"}
    assert len(list(token_cache_dir.glob("*.safetensors"))) == 4  # 2 models x 2 splits
    assert run(tiny_study, second, 1) == 0
    assert "tiny-bert disk cache; tiny-bert-b disk cache" in capsys.readouterr().out
