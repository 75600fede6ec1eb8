"""Rotary position embeddings: the cos/sin cache (with rope scaling) and its application."""

from __future__ import annotations

import math
from typing import Any

import torch

from krait.ops.rotary import apply_rotary


def rope_parameters(hf_config: Any) -> dict:
    """The rope settings of a config, from transformers 5's `rope_parameters` or the older
    `rope_theta` + `rope_scaling` fields."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and "rope_type" not in params:
        params.update(scaling)
    params.setdefault("rope_type", params.pop("type", "default"))
    if "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = getattr(hf_config, "partial_rotary_factor", 1.0)
    return params


def _inv_freq(rot_dim: int, params: dict) -> torch.Tensor:
    base = float(params["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    kind = params.get("rope_type", "default")
    if kind in ("default", None):
        return inv
    if kind == "linear":
        return inv / float(params["factor"])
    if kind == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(torch.nn.Module):
    """Applies rotary embeddings to q and k; `is_neox` picks rotate-half (True) or
    interleaved pairs (gpt-j style)."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict, is_neox: bool = True
    ) -> None:
        super().__init__()
        self.rot_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        self.is_neox = is_neox
        self.params = params
        self.register_buffer("cos_sin_cache", self._cache(max_position), persistent=False)

    def _cache(self, num_positions: int) -> torch.Tensor:
        inv = _inv_freq(self.rot_dim, self.params)
        t = torch.arange(num_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        # [num_positions, rot_dim]: cos in the first half, sin in the second
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()

    def cover(self, num_positions: int) -> None:
        """Grows the cache to at least `num_positions` positions (a max_model_len past the
        config's max_position_embeddings, allowed by KRAIT_ALLOW_LONG_MAX_MODEL_LEN=1): the
        kernels index it by position without a bound check."""
        if num_positions > self.cos_sin_cache.shape[0]:
            device = self.cos_sin_cache.device
            self.cos_sin_cache = self._cache(num_positions).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, k, positions, self.cos_sin_cache, self.is_neox)
