"""bench_e2e's CPU parts: its options (the model shapes are scripts/shape_model.py's: test_shape_model.py)."""

from __future__ import annotations

import pytest
from scripts_cases import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_e2e")


def test_tiny_takes_no_shape(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--layers", "2"])
    assert "--tiny is its own model" in capsys.readouterr().err
