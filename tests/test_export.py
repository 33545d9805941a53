"""Writing the exported model: nothing that looks like a model is left by a run that did not
finish (the end-to-end exports are in test_final.py)."""

import pytest

from hpo import export
from hpo.errors import ConfigError

REPORT = {"params": {"model_name": "m"}, "data": {"task": "multilabel", "max_length": 64},
          "exported": {"thresholds": {}}}


def test_checking_the_output_creates_nothing(tmp_path):
    output = tmp_path / "final" / "demo"
    export.check_output(output)
    assert list(tmp_path.iterdir()) == []


def test_an_output_that_cannot_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--output .*file/demo: cannot write there"):
        export.check_output(tmp_path / "file" / "demo")


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, OSError])
def test_an_interrupted_export_leaves_no_partial_model_nor_directory(tmp_path, monkeypatch,
                                                                    interrupt):
    def save_then_stop(directory, *args, **kwargs):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"half")
        raise interrupt()

    monkeypatch.setattr(export, "save_model", save_then_stop)
    with pytest.raises(interrupt):
        export.write(tmp_path / "final" / "demo", None, REPORT, ("a",))
    assert list(tmp_path.iterdir()) == []


def test_an_interrupted_export_keeps_the_earlier_one(tmp_path, monkeypatch):
    earlier = tmp_path / "demo"
    earlier.mkdir()
    (earlier / export.REPORT).write_text("{}")

    def stop(directory, *args, **kwargs):
        directory.mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "save_model", stop)
    with pytest.raises(KeyboardInterrupt):
        export.write(earlier, None, REPORT, ("a",))
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]
    assert (earlier / export.REPORT).read_text() == "{}"
