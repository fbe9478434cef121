"""Messages on a transformed ExportedProgram and an exported dynamic sequence that say what
happened (issue 55 item 5): an eval program with no mode-dependent op is not said verified in
train mode; its notes name the user's ``Dim``s; ``--dynamic-seq`` is bounded by the model's
own maximum length."""

import pytest
import torch
from torch import nn

import amprewrite


def _eval_program():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    batch = torch.export.Dim("batch", max=64)
    return torch.export.export(model, (torch.randn(4, 8),), dynamic_shapes=({0: batch},))


def test_a_program_with_no_mode_dependent_op_is_not_said_verified_in_train_mode():
    notes = amprewrite.report(amprewrite.transform(_eval_program(), "bf16")).notes
    assert ("captured from an ExportedProgram with no mode-dependent op (dropout, batch norm): "
            "train and eval compute the same") in notes
    (verified,) = [n for n in notes if n.startswith("verify: output error")]
    assert "train mode" not in verified and "random draws" not in verified


def test_notes_on_a_program_name_the_users_dims():
    out = amprewrite.transform(_eval_program(), "bf16")
    (shapes,) = [n for n in amprewrite.report(out).notes if n.startswith("shapes:")]
    assert "Dim('batch'" in shapes and "Dim('s" not in shapes, shapes
    assert [str(r.upper) for r in out.range_constraints.values()] == ["64"]


class _Positions(nn.Module):
    """Token ids -> logits with a learned position table: past its 32 rows it fails."""

    def __init__(self, config: object = None):
        super().__init__()
        torch.manual_seed(0)
        if config is not None:
            self.config = config
        self.tok, self.table = nn.Embedding(50, 16), nn.Embedding(32, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.head(self.tok(input_ids) + self.table(positions))


@pytest.mark.parametrize("config", [{"n_positions": 32}, {"max_position_embeddings": 32}])
def test_dynamic_seq_takes_the_models_maximum_length(tmp_path, config):
    from types import SimpleNamespace

    from amprewrite.deploy import export as deploy

    model = _Positions(SimpleNamespace(**config)).eval()
    result = deploy.export(model, (torch.randint(0, 50, (2, 12)),), path=tmp_path / "p.pt2",
                           dynamic_seq=True, check=False)
    assert result.seq_range == (2, 32)
    assert "sequence dynamic in [2, 32]" in result.summary()
    assert f"sequence lengths up to 32: the model's config.{next(iter(config))}" in (
        result.summary())
    program = torch.export.load(tmp_path / "p.pt2").module()
    assert program(torch.randint(0, 50, (2, 32))).shape == (2, 32, 50)
    with pytest.raises(AssertionError, match=r"size\(\)\[1\] <= 32"):  # not an IndexError
        program(torch.randint(0, 50, (2, 33)))

