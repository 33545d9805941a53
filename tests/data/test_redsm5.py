from __future__ import annotations

from pathlib import Path

import pytest

from hpo.data.redsm5 import (
    ANNOTATIONS_FILE,
    MAX_FIELD_BYTES,
    POSTS_FILE,
    SPECIAL_CASE,
    SYMPTOMS,
    label_names,
    read_redsm5,
)
from hpo.errors import DataError

SAMPLE = Path(__file__).resolve().parent / "redsm5-sample"  # the public sample, README there
ANNOTATIONS_HEADER = "post_id,sentence_id,sentence_text,DSM5_symptom,status,explanation\n"


def write(directory: Path, posts: str | bytes, annotations: str | bytes) -> Path:
    for name, content in ((POSTS_FILE, posts), (ANNOTATIONS_FILE, annotations)):
        data = content.encode("utf-8") if isinstance(content, str) else content
        (directory / name).write_bytes(data)
    return directory


def annotation(post_id: str, symptom: str, status: str = "1") -> str:
    return f"{post_id},{post_id}_0,Some sentence.,{symptom},{status},Why.\n"


def by_id(directory: Path, **kwargs: bool) -> dict[str, frozenset[str]]:
    return {post.post_id: post.symptoms for post in read_redsm5(directory, **kwargs)}


def test_label_names() -> None:
    assert len(SYMPTOMS) == 9
    assert label_names() == SYMPTOMS
    assert label_names(special_case=True) == (*SYMPTOMS, SPECIAL_CASE)


def test_reads_the_public_sample() -> None:
    posts = read_redsm5(SAMPLE)
    assert len(posts) == 17
    assert posts[0].post_id == "s_1270_9"  # file order
    assert posts[-1].post_id == "s_2748_278"
    symptoms = {post.post_id: post.symptoms for post in posts}
    assert symptoms["s_1270_9"] == {"SLEEP_ISSUES"}
    assert symptoms["s_1955_1069"] == frozenset()  # only a status-0 WORTHLESSNESS row
    assert symptoms["s_2748_341"] == frozenset()  # only a status-0 ANHEDONIA row
    assert symptoms["s_993_1060"] == {"FATIGUE", "COGNITIVE_ISSUES", "SLEEP_ISSUES"}
    assert symptoms["s_2392_17"] == {"SLEEP_ISSUES"}  # a status-0 and a status-1 row
    assert symptoms["s_329_224"] == {"WORTHLESSNESS", "DEPRESSED_MOOD"}
    assert symptoms["s_1404_102"] == {"ANHEDONIA", "WORTHLESSNESS"}
    assert sum(not s for s in symptoms.values()) == 2
    assert posts[1].text.startswith("Seriously, how dare someone feel bad")


def test_sample_has_no_special_case_rows() -> None:
    # The public sample has no SPECIAL_CASE row, so enabling it must change nothing there.
    assert by_id(SAMPLE, special_case=True) == by_id(SAMPLE)


def test_special_case_only_when_enabled(tmp_path: Path) -> None:
    write(
        tmp_path,
        "post_id,text\np1,Panic.\np2,Sad.\n",
        ANNOTATIONS_HEADER + annotation("p1", SPECIAL_CASE) + annotation("p2", "DEPRESSED_MOOD"),
    )
    assert by_id(tmp_path) == {"p1": frozenset(), "p2": {"DEPRESSED_MOOD"}}
    assert by_id(tmp_path, special_case=True) == {"p1": {SPECIAL_CASE}, "p2": {"DEPRESSED_MOOD"}}


def test_bom_crlf_and_quoted_newlines(tmp_path: Path) -> None:
    posts = 'post_id,text\r\np1,"Line one, with a comma\r\nline ""two"""\r\np2,plain\r\n'
    annotations = ANNOTATIONS_HEADER.replace("\n", "\r\n") + annotation("p2", "FATIGUE")
    write(tmp_path, b"\xef\xbb\xbf" + posts.encode(), b"\xef\xbb\xbf" + annotations.encode())
    posts_read = read_redsm5(tmp_path)
    assert [post.post_id for post in posts_read] == ["p1", "p2"]  # BOM not glued to post_id
    assert posts_read[0].text == 'Line one, with a comma\r\nline "two"'
    assert posts_read[1].symptoms == {"FATIGUE"}


def test_reordered_and_extra_columns(tmp_path: Path, caplog) -> None:
    write(
        tmp_path,
        "subreddit,text,post_id\ndepression,Hello there.,p1\nanxiety,Bye.,p2\n",
        "status,extra,DSM5_symptom,post_id\n 1 ,x,SLEEP_ISSUES,p1\n0,y,FATIGUE,p2\n",
    )
    posts = read_redsm5(tmp_path)
    assert [(p.post_id, p.text, p.symptoms) for p in posts] == [
        ("p1", "Hello there.", {"SLEEP_ISSUES"}),
        ("p2", "Bye.", frozenset()),
    ]
    # Columns hpo does not read are named, once per file; the official ones are expected.
    assert "ignoring column(s) 'subreddit'" in caplog.text
    assert "ignoring column(s) 'extra'" in caplog.text


def test_headers_only_annotations_means_no_symptoms(tmp_path: Path) -> None:
    write(tmp_path, "post_id,text\np1,Hi.\n", ANNOTATIONS_HEADER)
    assert by_id(tmp_path) == {"p1": frozenset()}


GOOD_POSTS = "post_id,text\np1,First post.\np2,Second post.\n"


@pytest.mark.parametrize(
    ("posts", "annotations", "file", "expected"),
    [
        pytest.param(
            "post_id,body\np1,x\n", ANNOTATIONS_HEADER, POSTS_FILE, ["'text'"], id="no-text-col"
        ),
        pytest.param(
            GOOD_POSTS,
            "post_id,DSM5_symptom\np1,FATIGUE\n",
            ANNOTATIONS_FILE,
            ["'status'"],
            id="no-status-column",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + annotation("p1", "FATIGUE") + annotation("p2", "FOO"),
            ANNOTATIONS_FILE,
            ["column 'DSM5_symptom'", "row 3", "'FOO'", "DEPRESSED_MOOD"],
            id="unknown-symptom",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + annotation("p9", "FATIGUE"),
            ANNOTATIONS_FILE,
            ["column 'post_id'", "row 2", "'p9'"],
            id="unknown-post-id",
        ),
        pytest.param(
            "post_id,text\np1,a\np2,b\np1,c\n",
            ANNOTATIONS_HEADER,
            POSTS_FILE,
            ["column 'post_id'", "row 4", "duplicate", "'p1'"],
            id="duplicate-post-id",
        ),
        pytest.param(
            "post_id,text\n", ANNOTATIONS_HEADER, POSTS_FILE, ["no posts"], id="header-only"
        ),
        pytest.param("", ANNOTATIONS_HEADER, POSTS_FILE, ["'post_id'"], id="zero-bytes"),
        pytest.param(
            "post_id,text\np1,caf\xe9\n".encode("latin-1"),
            ANNOTATIONS_HEADER,
            POSTS_FILE,
            ["UTF-8"],
            id="latin-1",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + annotation("p1", "FATIGUE", "yes"),
            ANNOTATIONS_FILE,
            ["column 'status'", "row 2", "'yes'"],
            id="bad-status",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + annotation("p1", "FATIGUE", "2"),
            ANNOTATIONS_FILE,
            ["column 'status'", "row 2", "'2'"],
            id="status-2",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + "p1,p1_0,cut short\n",
            ANNOTATIONS_FILE,
            ["column 'DSM5_symptom'", "row 2"],
            id="short-row",
        ),
        pytest.param(
            "post_id,text\n,orphan text\n",
            ANNOTATIONS_HEADER,
            POSTS_FILE,
            ["column 'post_id'", "row 2", "empty"],
            id="empty-post-id",
        ),
        pytest.param(
            GOOD_POSTS,
            ANNOTATIONS_HEADER + 'p1,p1_0,Sentence.,FATIGUE,"1\n2",Why.\n',
            ANNOTATIONS_FILE,
            ["column 'status'", "row 2"],
            id="newline-in-value",
        ),
    ],
)
def test_errors_are_one_line_and_name_file_and_column(
    tmp_path: Path, posts: str | bytes, annotations: str, file: str, expected: list[str]
) -> None:
    write(tmp_path, posts, annotations)
    with pytest.raises(DataError) as info:
        read_redsm5(tmp_path)
    message = str(info.value)
    assert "\n" not in message and "\r" not in message
    assert str(tmp_path / file) in message
    for part in expected:
        assert part in message


def test_missing_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="nowhere: data directory not found"):
        read_redsm5(missing)
    with pytest.raises(DataError, match="not a directory"):
        read_redsm5(write(tmp_path, GOOD_POSTS, ANNOTATIONS_HEADER) / POSTS_FILE)


@pytest.mark.parametrize("name", [POSTS_FILE, ANNOTATIONS_FILE])
def test_missing_file_names_the_path(tmp_path: Path, name: str) -> None:
    write(tmp_path, GOOD_POSTS, ANNOTATIONS_HEADER)
    (tmp_path / name).unlink()
    with pytest.raises(DataError) as info:
        read_redsm5(tmp_path)
    assert str(tmp_path / name) in str(info.value)
    assert "not found" in str(info.value)


def test_a_long_post_is_not_malformed_csv(tmp_path: Path) -> None:
    # 200 KB: beyond the csv module's default field limit (128 KiB), far below hpo's.
    write(tmp_path, f"post_id,text\np1,{'x' * 200_000}\n", ANNOTATIONS_HEADER)
    (post,) = read_redsm5(tmp_path)
    assert len(post.text) == 200_000


def test_a_field_beyond_any_post_is_a_data_error(tmp_path: Path) -> None:
    write(tmp_path, f"post_id,text\np1,ok\np2,{'x' * (MAX_FIELD_BYTES + 1)}\n",
          ANNOTATIONS_HEADER)
    with pytest.raises(DataError, match=f"{POSTS_FILE}: row 3: a field is over 16 MiB"):
        read_redsm5(tmp_path)


@pytest.mark.parametrize("posts", [
    # Never closed: without strict parsing rows 3 to 5 became one post's text.
    'post_id,text\np1,fine\np2,"I never close\np3,lost\np4,lost too\n',
    # Closed by the next quote, far below: the same, up to that quote.
    'post_id,text\np1,fine\np2,"I never close\np3,lost\np4,"quoted" word\n',
])
def test_a_stray_opening_quote_is_rejected_with_its_row(tmp_path: Path, posts: str) -> None:
    write(tmp_path, posts, ANNOTATIONS_HEADER)
    with pytest.raises(DataError, match=rf"{POSTS_FILE}: row 3 \(line 3\): a quote opened "
                                        r"there is not closed before line [45]"):
        read_redsm5(tmp_path)


def test_empty_text_and_a_column_named_twice_are_rejected(tmp_path: Path) -> None:
    write(tmp_path, "post_id,text\np1,fine\np2,  \n", ANNOTATIONS_HEADER)
    with pytest.raises(DataError, match="column 'text', row 3: empty text \\(post_id 'p2'\\)"):
        read_redsm5(tmp_path)
    write(tmp_path, "post_id,text,text\np1,a,b\n", ANNOTATIONS_HEADER)
    with pytest.raises(DataError, match="column 'text' appears more than once in the header"):
        read_redsm5(tmp_path)


def test_data_error_folds_newlines() -> None:
    assert str(DataError("a.csv: bad\nvalue\r\nhere")) == "a.csv: bad value here"
