"""Example model factories for `amprewrite dump` / `amprewrite check`.

    amprewrite check examples/cli_models.py:overflow --dtype fp16               # passes: fc in fp32
    amprewrite check examples/cli_models.py:overflow --dtype fp16 --allow-low fc  # inf, then --fix
    amprewrite dump examples/cli_models.py:mlp --inputs 4x16 --out out/mlp
"""

import torch
from torch import nn


class Overflow(nn.Module):
    """Logits above fp16's 65504 before a softmax: fine in fp32, inf in fp16 (the recorded
    ranges keep ``fc`` in fp32 unless ``--allow-low fc`` runs it in fp16)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.fc.weight.mul_(4000.0)

    def forward(self, x):
        return self.head(torch.softmax(self.fc(x), dim=-1))


def overflow():
    torch.manual_seed(0)
    return Overflow().eval(), (torch.randn(8, 16) * 20,)


def mlp():
    """A model without example inputs: pass --inputs 4x16."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)).eval()


def broken():
    """A model whose forward fails."""

    class Broken(nn.Module):
        def forward(self, x):
            raise ValueError("this model always fails")

    return Broken(), (torch.randn(2, 2),)


def demo():
    from amprewrite.demo import demo_model

    return demo_model()
