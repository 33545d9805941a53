"""Result files kept gzipped (benchmarks/stored.py): read under the README's names."""

import gzip
import json

import stored
from conftest import REPO


def test_a_name_is_read_from_its_gzipped_twin_where_only_that_exists(tmp_path):
    plain = tmp_path / "out.json"
    stored.write_text(tmp_path / "out.json.gz", json.dumps({"a": 1}))
    assert not plain.exists()
    assert json.loads(gzip.decompress((tmp_path / "out.json.gz").read_bytes())) == {"a": 1}
    assert stored.resolve(plain) == tmp_path / "out.json.gz"
    assert stored.read(plain) == {"a": 1}
    # Written again under the plain name (an --append), the stale twin goes
    stored.write_text(plain, json.dumps({"a": 2}))
    assert not (tmp_path / "out.json.gz").exists()
    assert stored.read(plain) == {"a": 2}
    assert stored.resolve(tmp_path / "none.json") == tmp_path / "none.json"


def test_pack_gzips_only_the_large_files_of_the_folder_itself(tmp_path):
    big, small = {"x": "y" * 200}, {"x": 1}
    (tmp_path / "big.json").write_text(json.dumps(big))
    (tmp_path / "small.json").write_text(json.dumps(small))
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / "big.json").write_text(json.dumps(big))
    assert stored.pack(tmp_path, above=100) == [tmp_path / "big.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json.gz", "chunks", "small.json"]
    assert stored.read(tmp_path / "big.json") == big
    assert (tmp_path / "chunks" / "big.json").exists()


def test_no_large_result_file_is_kept_unpacked():
    # What travels to a GPU machine is capped (64 MiB) and the results were most of it.
    large = [p.name for p in (REPO / "benchmarks" / "results").glob("*.json")
             if p.stat().st_size > stored.PACK_ABOVE]
    assert not large, f"run `python benchmarks/stored.py --pack` for {large}"
