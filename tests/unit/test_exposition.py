from __future__ import annotations

from proxy.core.server.exposition import combine, escape

PAGE = (
    "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.\n"
    "# TYPE llamacpp:prompt_tokens_total counter\n"
    "llamacpp:prompt_tokens_total {tokens}\n"
    "# HELP llamacpp:requests_processing Number of requests processing.\n"
    "# TYPE llamacpp:requests_processing gauge\n"
    "llamacpp:requests_processing 0\n"
)


def test_one_backend_verbatim() -> None:
    assert combine([("a", PAGE.format(tokens=7))], labelled=False) == PAGE.format(tokens=7)
    assert combine([("a", "x 1")], labelled=False) == "x 1\n"  # the page's end stays a line


def test_labels_merged_and_help_type_once_per_family() -> None:
    pages = [("a", PAGE.format(tokens=7)), ("b", PAGE.format(tokens=9))]
    assert combine(pages, labelled=True).splitlines() == [
        "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.",
        "# TYPE llamacpp:prompt_tokens_total counter",
        'llamacpp:prompt_tokens_total{backend="a"} 7',
        'llamacpp:prompt_tokens_total{backend="b"} 9',
        "# HELP llamacpp:requests_processing Number of requests processing.",
        "# TYPE llamacpp:requests_processing gauge",
        'llamacpp:requests_processing{backend="a"} 0',
        'llamacpp:requests_processing{backend="b"} 0',
    ]


def test_existing_labels_kept_and_a_backend_label_exported() -> None:
    page = (
        "# TYPE m counter\n"
        'm{position="0"} 1\n'
        'm{ position = "1" , note="a,}b\\"c", } 2\n'
        'm{backend="inner"} 3\n'
        "m{} 4\n"
    )
    assert combine([("x", page), ("y", "")], labelled=True).splitlines() == [
        "# TYPE m counter",
        'm{backend="x",position="0"} 1',
        'm{backend="x",position="1",note="a,}b\\"c"} 2',
        'm{backend="x",exported_backend="inner"} 3',
        'm{backend="x"} 4',
    ]


def test_comments_and_blank_lines_dropped_timestamps_kept() -> None:
    page = "# a comment\n\n# TYPE m gauge\nm 1.5 1700000000000\nnot a sample\n"
    assert combine([("a", page), ("b", page)], labelled=True).splitlines() == [
        "# TYPE m gauge",
        'm{backend="a"} 1.5 1700000000000',
        'm{backend="b"} 1.5 1700000000000',
    ]


def test_series_of_a_family_stay_in_it_and_others_are_their_own() -> None:
    page = '# TYPE h histogram\nh_bucket{le="1"} 2\nh_sum 3\nh_count 2\nuntyped_thing 5\n'
    merged = combine([("a", page), ("b", "# TYPE h histogram\nh_count 1\n")], labelled=True)
    assert merged.splitlines() == [
        "# TYPE h histogram",
        'h_bucket{backend="a",le="1"} 2',
        'h_sum{backend="a"} 3',
        'h_count{backend="a"} 2',
        'h_count{backend="b"} 1',
        'untyped_thing{backend="a"} 5',
    ]


def test_label_values_escaped() -> None:
    assert escape('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    merged = combine([('host"1', "m 1\n"), ("b", "m 2\n")], labelled=True)
    assert merged.splitlines()[0] == 'm{backend="host\\"1"} 1'
