"""Result files as the benchmarks read and write them: JSON, gzipped where the name ends in
`.gz`.

Why gzipped: the repository's working tree is what travels to a GPU machine, capped at
64 MiB, and `results/` had grown to 46 MiB of it, most of it the replays' outputs, which
shrink about four times compressed. So the result files over `PACK_ABOVE` bytes are kept as
`NAME.json.gz` (`python benchmarks/stored.py --pack`), and every reader here takes the name
the README gives, `NAME.json`, from `NAME.json.gz` where only that exists.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

PACK_ABOVE = 100_000
RESULTS = Path(__file__).parent / "results"


def resolve(path: Path) -> Path:
    """`path`, or its gzipped twin `path.gz` where only that exists."""
    packed = path.with_name(path.name + ".gz")
    return packed if not path.exists() and packed.exists() else path


def read_text(path: Path) -> str:
    """The text of `path` (or of its gzipped twin), unzipped where its name ends in `.gz`."""
    found = resolve(Path(path))
    if found.suffix == ".gz":
        return gzip.decompress(found.read_bytes()).decode()
    return found.read_text()


def read(path: Path) -> Any:
    """The JSON in `path` (or in its gzipped twin)."""
    return json.loads(read_text(path))


def write_text(path: Path, text: str) -> None:
    """`text` into `path`, gzipped where its name ends in `.gz`; a twin left by an earlier
    write under the other name is removed, so a reader never takes a stale one."""
    path = Path(path)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
        path.with_name(path.name[:-3]).unlink(missing_ok=True)
    else:
        path.write_text(text)
        path.with_name(path.name + ".gz").unlink(missing_ok=True)


def pack(folder: Path, above: int = PACK_ABOVE) -> list[Path]:
    """Gzip each `*.json` directly in `folder` over `above` bytes into its twin; the packed."""
    packed = []
    for path in sorted(folder.glob("*.json")):
        if path.stat().st_size > above:
            write_text(path.with_name(path.name + ".gz"), path.read_text())
            packed.append(path)
    return packed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", action="store_true",
                        help=f"gzip the result files over {PACK_ABOVE} bytes")
    parser.add_argument("--folder", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.pack:
        for path in pack(args.folder):
            print(f"packed {path.name} -> {path.name}.gz")


if __name__ == "__main__":
    main()
