"""benchmarks/README.md's tables are exactly what benchmarks/tables.py renders from the committed
result files (what `python benchmarks/run_all.py --tables-only` writes): the numbers there cannot
drift from the data. Renders only; runs no benchmark."""

from __future__ import annotations

import pytest
from conftest import load_benchmark


def test_readme_tables_are_the_committed_results():
    tables = load_benchmark("tables")
    text = tables.README.read_text()
    results = tables.readme_results(text)
    assert results.is_dir(), f"the README's tables come from {results}, which is not committed"
    rendered = tables.render(results)
    assert set(rendered) == set(tables.TABLES)
    for name, body in rendered.items():
        assert f"<!-- table:{name} -->\n{body}\n<!-- /table:{name} -->" in text, (
            f"benchmarks/README.md's table {name} differs from its result files: run "
            "python benchmarks/run_all.py --tables-only")
    assert tables.apply(text, rendered) == text  # and regenerating changes nothing


def test_a_missing_marker_is_an_error():
    tables = load_benchmark("tables")
    with pytest.raises(ValueError, match="table:cp_memory"):
        tables.apply("no markers here", {"cp_memory": "| cp |"})


def test_apply_replaces_only_between_the_markers():
    tables = load_benchmark("tables")
    text = ("a\n<!-- table:x -->\nold\nrows\n<!-- /table:x -->\nb\n"
            "<!-- table:y -->\n<!-- /table:y -->\n")
    assert tables.apply(text, {"x": "new", "y": "| y |"}) == (
        "a\n<!-- table:x -->\nnew\n<!-- /table:x -->\nb\n<!-- table:y -->\n| y |\n"
        "<!-- /table:y -->\n")
