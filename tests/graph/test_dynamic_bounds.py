"""A dynamic size the model's own code bounds says where (issue 65: diffusers' UNets and VAEs
reported their dynamic batch as ``[2, 63]`` with no reason). diffusers' ``Upsample2D`` runs
``if hidden_states.shape[0] >= 64: hidden_states = hidden_states.contiguous()``, so dynamo
guards the batch below 64 and the graph serves 2..63; the report's ``shapes:`` note, and an
exported artefact's note, now name that line."""

from __future__ import annotations

import warnings

import pytest

import amprewrite
from amprewrite.testing import zoo

pytest.importorskip("diffusers")

LINE = "`if hidden_states.shape[0] >= 64:` (diffusers/models/upsampling.py:"


def test_the_report_names_the_line_that_bounds_the_batch():
    model, inputs = zoo.autoencoder_kl()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = amprewrite.transform(model, "bf16", example_inputs=inputs, verify=False)
    (note,) = [n for n in amprewrite.report(gm).notes if n.startswith("shapes:")]
    assert "sample[0] in [2, 63]" in note
    assert "sample[0] stops at 63 because the model's code branches on it, " + LINE in note
    assert gm._amp_inputs.bounded_by(0).startswith(LINE)


def test_an_unbounded_batch_names_no_line():
    model, inputs = zoo.llama()
    gm = amprewrite.transform(model, "bf16", example_inputs=inputs, verify=False)
    (note,) = [n for n in amprewrite.report(gm).notes if n.startswith("shapes:")]
    assert "in [2, inf]" in note and "branches on it" not in note
    assert gm._amp_inputs.bounded_by(0) is None


def test_the_exported_artefact_says_why_its_batch_stops_at_63(tmp_path):
    from amprewrite.deploy.export import export

    model, inputs = zoo.unet2d()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = export(model, inputs, path=tmp_path / "unet.pt2", to="pt2", check=False)
    assert result.batch_range == (2, 63)
    assert any(n.startswith("batch sizes up to 63: the model's code branches on the batch, "
                            + LINE) for n in result.notes), result.notes
