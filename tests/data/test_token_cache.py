import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoTokenizer

from hpo.data import token_cache
from hpo.data.batching import encode
from hpo.data.tasks import Example
from hpo.data.token_cache import cached_encode, default_dir, tokenizer_fingerprint
from hpo.training.models import resolve


def post(text: str, labels: tuple[float, ...], pair: str | None = None) -> Example:
    return Example("p", text, pair, labels)


EXAMPLES = [
    post("i cannot sleep and feel worthless every single day", (1.0, 0.0)),
    post("had a nice walk today", (0.0, 0.0)),
    post("tired all the time, " * 40, (0.0, 1.0)),
]
PAIRS = [post("i cannot sleep", (1.0,), "sleep issues"),
         post("nice walk", (0.0,), "depressed mood")]


def assert_same(a, b):
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.offsets, b.offsets)
    assert (a.token_types is None) == (b.token_types is None)
    if a.token_types is not None:
        assert torch.equal(a.token_types, b.token_types)
    assert torch.equal(a.labels, b.labels)


def test_a_second_tokenizer_instance_reads_what_the_first_wrote(tiny_model, token_cache_dir):
    first, hit = cached_encode(AutoTokenizer.from_pretrained(tiny_model), EXAMPLES, 32,
                               token_cache_dir)
    assert not hit and len(list(token_cache_dir.glob("*.safetensors"))) == 1
    second, hit = cached_encode(AutoTokenizer.from_pretrained(tiny_model), EXAMPLES, 32,
                                token_cache_dir)
    assert hit
    assert_same(first, second)
    assert_same(first, encode(AutoTokenizer.from_pretrained(tiny_model), EXAMPLES, 32))
    assert second.lengths[2] == 32  # truncated, as tokenized


def test_pairs_keep_their_token_types(token_cache_dir):
    tokenizer = AutoTokenizer.from_pretrained(resolve("sentence-transformers/all-MiniLM-L6-v2"))
    first, _ = cached_encode(tokenizer, PAIRS, 16, token_cache_dir)
    second, hit = cached_encode(tokenizer, PAIRS, 16, token_cache_dir)
    assert hit and first.token_types is not None and int(first.token_types.sum()) > 0
    assert_same(first, second)


def test_labels_come_from_the_examples_not_the_cache(tiny_model, token_cache_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cached_encode(tokenizer, EXAMPLES, 32, token_cache_dir)
    relabelled = [post(e.text, (0.5, 0.5)) for e in EXAMPLES]
    encoded, hit = cached_encode(tokenizer, relabelled, 32, token_cache_dir)
    assert hit and encoded.labels.tolist() == [[0.5, 0.5]] * 3


@pytest.mark.parametrize("change", ["max_length", "text", "tokenizer"])
def test_anything_the_ids_depend_on_makes_a_new_entry(change, tiny_model, tiny_model_b,
                                                      token_cache_dir):
    cached_encode(AutoTokenizer.from_pretrained(tiny_model), EXAMPLES, 32, token_cache_dir)
    model, examples, length = tiny_model, EXAMPLES, 32
    if change == "max_length":
        length = 16
    elif change == "text":
        examples = [*EXAMPLES[:2], post(EXAMPLES[2].text + " again", (0.0, 1.0))]
    else:
        model = tiny_model_b
    _, hit = cached_encode(AutoTokenizer.from_pretrained(model), examples, length,
                           token_cache_dir)
    assert not hit and len(list(token_cache_dir.glob("*.safetensors"))) == 2


def test_the_fingerprint_is_the_same_in_another_process_and_after_use(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    encode(tokenizer, EXAMPLES, 7)  # leaves truncation settings behind in the tokenizer
    script = textwrap.dedent(f"""
        from transformers import AutoTokenizer
        from hpo.data.token_cache import tokenizer_fingerprint
        print(tokenizer_fingerprint(AutoTokenizer.from_pretrained({str(tiny_model)!r})))
    """)
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == tokenizer_fingerprint(tokenizer)


def test_a_corrupt_entry_is_tokenized_again_and_replaced(tiny_model, token_cache_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    expected, _ = cached_encode(tokenizer, EXAMPLES, 32, token_cache_dir)
    (entry,) = token_cache_dir.glob("*.safetensors")
    entry.write_bytes(b"\x00" * 40)
    encoded, hit = cached_encode(tokenizer, EXAMPLES, 32, token_cache_dir)
    assert not hit and "unreadable" in caplog.text
    assert_same(encoded, expected)
    assert cached_encode(tokenizer, EXAMPLES, 32, token_cache_dir)[1]


def test_an_entry_for_other_examples_is_not_trusted(tiny_model, token_cache_dir, caplog):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cached_encode(tokenizer, EXAMPLES[:2], 32, token_cache_dir)
    (short,) = token_cache_dir.glob("*.safetensors")
    key = token_cache.entry_key(tokenizer_fingerprint(tokenizer), EXAMPLES, 32)
    short.rename(token_cache_dir / f"{key}.safetensors")
    encoded, hit = cached_encode(tokenizer, EXAMPLES, 32, token_cache_dir)
    assert not hit and len(encoded) == 3 and "does not match" in caplog.text


def test_an_unwritable_cache_costs_the_tokenization_not_the_result(tiny_model, tmp_path,
                                                                   caplog):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    encoded, hit = cached_encode(tokenizer, EXAMPLES, 32, blocker / "tokens")
    assert not hit and len(encoded) == 3 and "not writable" in caplog.text
    assert list(tmp_path.glob("**/*.tmp")) == []


FULL_DISK = """
import logging, resource, signal, sys
from pathlib import Path
from transformers import AutoTokenizer
from hpo.data.tasks import Example
from hpo.data.token_cache import cached_encode

logging.basicConfig(level=logging.WARNING)
# A file may grow to 64 bytes and no more: every write beyond fails (EFBIG) as on a full disk.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
examples = [Example(str(i), f"post number {i} about sleep", None, (1.0,)) for i in range(50)]
encoded, hit = cached_encode(AutoTokenizer.from_pretrained(sys.argv[1]), examples, 32,
                             Path(sys.argv[2]))
print(len(encoded), hit)
"""


def test_a_full_disk_costs_the_tokenization_not_the_trial(tiny_model, tmp_path):
    result = subprocess.run([sys.executable, "-c", FULL_DISK, str(tiny_model),
                             str(tmp_path / "tokens")], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["50", "False"]
    assert "is not writable, not caching" in result.stderr
    assert list((tmp_path / "tokens").glob("*")) == []  # no partial entry left


def test_cache_location_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HPO_CACHE_DIR", str(tmp_path))
    assert default_dir() == tmp_path / "tokens"
    monkeypatch.setenv("HPO_CACHE_DIR", "off")
    assert default_dir() is None
    monkeypatch.delenv("HPO_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_dir() == tmp_path / "xdg" / "hpo" / "tokens"


def test_without_a_directory_nothing_is_cached(tiny_model, token_cache_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert cached_encode(tokenizer, EXAMPLES, 32, None)[1] is False
    assert cached_encode(tokenizer, EXAMPLES, 32, None)[1] is False
    assert not token_cache_dir.exists()
