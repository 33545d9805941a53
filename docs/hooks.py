"""An mkdocs hook: benchmarks/README.md becomes the site's page benchmarks.md.

The benchmark tables live beside the benchmark scripts that print them, so the site shows
that file itself rather than a copy in docs/ that could drift from it. Its plots
(benchmarks/*.png and benchmarks/results/*.png, referenced by their paths from
benchmarks/) are served beside the page. A relative link into
the repository would leave docs/, which strict mode refuses: one to the README becomes the home
page, one to any other file its plain text.
"""

import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")


def on_files(files, config):
    benchmarks = Path(config.config_file_path).parent / "benchmarks"
    images = sorted(path.relative_to(benchmarks).as_posix()
                    for path in benchmarks.rglob("*.png"))

    def relink(match: re.Match) -> str:
        _, text, target = match.groups()
        if "://" in target or target.startswith("#") or target in images:
            return match[0]
        if target.split("#")[0] == "../README.md":
            return f"[{text}](index.md)"
        return text

    page = LINK.sub(relink, (benchmarks / "README.md").read_text(encoding="utf-8"))
    files.append(File.generated(config, "benchmarks.md", content=page))
    for name in images:
        files.append(File.generated(config, name, abs_src_path=str(benchmarks / name)))
    return files
