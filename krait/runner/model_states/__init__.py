"""Model states: one per model family, owning what a family needs beyond tokens."""

from __future__ import annotations

import torch

from krait.config import EngineConfig
from krait.runner.model_states.default import DefaultModelState


def create_model_state(model: torch.nn.Module, config: EngineConfig) -> DefaultModelState:
    """Picks the model state for a model: hybrid when it has recurrent-state layers (modules
    that set `has_recurrent_state = True`, such as the Mamba2 mixer)."""
    if any(getattr(m, "has_recurrent_state", False) for m in model.modules()):
        from krait.runner.model_states.mamba_hybrid import MambaHybridModelState

        return MambaHybridModelState(model, config)
    return DefaultModelState(model, config)
