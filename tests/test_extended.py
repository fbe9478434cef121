"""tests/extended.py: which tests leave the README's test command, and the check of its names."""

import pytest

from tests import extended


class _Item:
    def __init__(self, nodeid: str, slow: bool = False, **params):
        self.nodeid = nodeid
        self.callspec = type("Spec", (), {"params": params})() if params else None
        self._slow = slow

    def get_closest_marker(self, name: str):
        return object() if name == "slow" and self._slow else None


SAMPLED = "tests/precision/test_ops.py::test_issue_table_row_is_finite_and_at_most_autocasts_error"


def test_a_sampled_matrix_keeps_each_main_value_once_and_turns_the_others():
    items = [_Item(f"{SAMPLED}[{row}-{dtype}-{how}]", row=row, dtype=dtype, example=how)
             for row in ("exp", "log", "erf", "cumsum") for dtype in ("bf16", "fp16")
             for how in ("symbolic", "dynamo")]
    marked = {id(i) for i in extended.extended_items(items)}
    kept = [i for i in items if id(i) not in marked]
    assert [i.callspec.params["row"] for i in kept] == ["exp", "log", "erf", "cumsum"]
    # every dtype and capture still runs in the default run
    assert {i.callspec.params["dtype"] for i in kept} == {"bf16", "fp16"}
    assert {i.callspec.params["example"] for i in kept} == {"symbolic", "dynamo"}


def test_a_slow_item_is_never_the_one_a_sampled_matrix_keeps():
    name = "tests/passes/test_vectorize_loops.py::test_batch_gather_family_is_rerolled_and_exact"
    items = [_Item(f"{name}[{form}-{b}]", slow=b == 512, form=form, b=b)
             for form in ("getitem", "gather") for b in (512, 1)]
    marked = {id(i) for i in extended.extended_items(items)}
    kept = [i.nodeid for i in items if id(i) not in marked and not i._slow]
    assert kept == [f"{name}[getitem-1]", f"{name}[gather-1]"]  # not none for getitem


def test_entries_match_a_file_a_test_or_the_start_of_its_parameters():
    base = "tests/models/test_real_models.py::test_real_model_classes_respected_at_run_time"
    items = [_Item(f"{base}[unet2d-dtype4]"), _Item(f"{base}[llama-dtype0]"),
             _Item("tests/training/test_distributed.py::test_ddp"),
             _Item("tests/test_fuzz.py::test_transform_properties_again")]
    marked = [i.nodeid for i in extended.extended_items(items)]
    assert f"{base}[unet2d-dtype4]" in marked and f"{base}[llama-dtype0]" not in marked
    assert "tests/training/test_distributed.py::test_ddp" in marked  # a whole file
    # a test's name is not a prefix of another test's
    assert "tests/test_fuzz.py::test_transform_properties_again" not in marked


def test_an_entry_that_matches_no_test_of_a_collected_file_is_named(monkeypatch):
    monkeypatch.setattr(extended, "EXTENDED", ("tests/test_cli.py::test_renamed_away",
                                               "tests/test_api.py::test_elsewhere"))
    monkeypatch.setattr(extended, "SAMPLED", {})
    items = [_Item("tests/test_cli.py::test_something_else")]
    # test_api.py was not collected: its entry is not judged
    assert extended.stale_entries(items) == ["tests/test_cli.py::test_renamed_away"]


def test_the_suite_has_every_test_the_lists_name():
    """The lists against the test files themselves (the collection hook checks them against
    what a run collects): each entry's file exists and spells the test's name."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for entry in (*extended.EXTENDED, *extended.SAMPLED):
        path, _, test = entry.partition("::")
        assert (root / path).is_file(), entry
        if test:
            assert f"def {test.split('[')[0]}(" in (root / path).read_text(), entry


@pytest.mark.parametrize("marker", ["slow", "extended"])
def test_the_readme_command_leaves_out_the_marked_tests(pytestconfig, marker):
    assert f"not {marker}" in " ".join(pytestconfig.getini("addopts"))
