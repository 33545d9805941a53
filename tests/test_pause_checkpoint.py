"""benchmarks/pause_checkpoint.py: the checkpoint a paused trial keeps, measured through hpo's
own pause (train's `Paused`, drivers' `Checkpoint`, pausing's store), on a tiny model."""

import pause_checkpoint


def test_a_pause_keeps_twelve_bytes_a_parameter_and_says_so_in_one_row(tiny_model, capsys):
    assert pause_checkpoint.main(["--model", str(tiny_model), "--repeats", "1"]) == 0
    *_, row = capsys.readouterr().out.strip().splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == str(tiny_model)
    # fp32 weights and AdamW's two moments, plus the pickle's own bytes on a small model.
    assert 12.0 <= float(cells[3]) < 13.0
    assert cells[4].endswith(" s") and cells[5].endswith(" s")
