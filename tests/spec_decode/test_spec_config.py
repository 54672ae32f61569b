"""SpeculativeConfig: vLLM's field names and defaults; bad input -> ValueError naming the field."""

import pytest

from minipaged.spec_decode import SpeculativeConfig


def test_ngram_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert c.num_lookahead_tokens == 0  # n-gram drafts write no K/V ahead


def test_draft_model_reserves_k_lookahead_slots():
    c = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 4, "model": "m"})
    assert c.num_lookahead_tokens == 4
    assert SpeculativeConfig.from_dict(None) is None
    assert SpeculativeConfig.from_dict(c) is c


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "m"}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
        ({"method": "draft_model", "num_speculative_tokens": 2, "model": ""}, "model"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "m", "prompt_lookup_max": 3},
            "prompt_lookup_max",
        ),
    ],
)
def test_bad_config_names_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        SpeculativeConfig.from_dict(spec)


def test_not_a_dict():
    with pytest.raises(ValueError, match="speculative_config"):
        SpeculativeConfig.from_dict("ngram")


def test_budget_and_vocabulary_checks():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 7})
    c.verify_budget(8)  # 1 + 7 fits exactly
    with pytest.raises(ValueError, match="num_speculative_tokens=7"):
        c.verify_budget(7)
    d = SpeculativeConfig.from_dict({"method": "draft_model", "num_speculative_tokens": 2, "model": "m"})
    d.verify_draft_model(128, 128)
    with pytest.raises(ValueError, match="speculative_config.model.*vocabulary"):
        d.verify_draft_model(128, 130)
