"""SpeculativeConfig takes vLLM's keys, and exactly those; bad values name their key."""

from __future__ import annotations

import pytest

from krait.config import SpeculativeConfig


def test_ngram_defaults_and_lookup_bounds() -> None:
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 1, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "prompt_lookup_max": 5})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)


def test_draft_model_is_implied_by_model() -> None:
    c = SpeculativeConfig.from_dict({"model": "/some/dir", "num_speculative_tokens": 4})
    assert c.method == "draft_model" and c.model == "/some/dir"


@pytest.mark.parametrize("d, key", [
    ({"num_speculative_tokens": 3, "lookahead": 2}, "lookahead"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "medusa", "num_speculative_tokens": 3}, "method"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, "model"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 0},
     "draft_tensor_parallel_size"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "eagle"),
    ({"method": "eagle3", "num_speculative_tokens": 3}, "eagle3"),
])
def test_bad_configs_name_the_key(d: dict, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        SpeculativeConfig.from_dict(d)
