"""Stand-ins the schedule tests share."""
import torch

from megatron_orch.megatron.contract import MegatronModelMixin


class EncoderlessChunk(MegatronModelMixin, torch.nn.Module):
    """A model chunk without encoders (a later pipeline stage or virtual chunk) for a schedule test whose
    stand-in forward-backward runs no forward: only the model config's callbacks matter."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def phase_encoders(self):
        return {}

    def encode(self, phase, items):
        raise AssertionError("a chunk without encoders encodes nothing")

    def forward(self, batch, embeds=None):
        raise AssertionError("the stand-in schedule runs no forward")
