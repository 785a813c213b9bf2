"""--max-seq-len against the positions a model knows, with the rope scalings of published configs."""

from __future__ import annotations

import pytest

from apt_ds.config import ConfigError
from apt_ds.io.context_length import check_max_seq_len, known_positions

# rope settings as published (config.json of each model)
LLAMA_3_1 = {"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
             "original_max_position_embeddings": 8192, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
QWEN_2_5_YARN = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0,
                 "original_max_position_embeddings": 32768}}  # the model card's long-context setting
LINEAR = {"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2.0}}
SMOLLM2 = {"max_position_embeddings": 8192, "rope_scaling": None}


@pytest.mark.parametrize("config, limit", [(LLAMA_3_1, 131072), (QWEN_2_5_YARN, 131072), (LINEAR, 8192), (SMOLLM2, 8192),
                                           ({"max_position_embeddings": 512, "rope_scaling": {"rope_type": "default"}}, 512)],
                         ids=["llama3-already-counted", "yarn", "linear", "none", "default"])
def test_known_positions(config, limit):
    assert known_positions(config)[0] == limit


def test_a_config_without_a_length_says_nothing():
    assert known_positions({}) is None and check_max_seq_len({}, 10**6, "m") is None


def test_past_the_trained_length_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"--max-seq-len 8193 is longer than --model m knows \(max_position_embeddings is "
                                          r"8192\): positions past 8192 were never trained; give --max-seq-len 8192 or less"):
        check_max_seq_len(SMOLLM2, 8193, "m")
    with pytest.raises(ConfigError, match=r"its rope_scaling \(yarn, factor 4 of 32768\) extends"):
        check_max_seq_len(QWEN_2_5_YARN, 131073, "m")


def test_rope_scaling_allows_it_and_says_so():
    assert check_max_seq_len(SMOLLM2, 8192, "m") is None
    note = check_max_seq_len(QWEN_2_5_YARN, 65536, "m")
    assert note.startswith("note: --max-seq-len 65536 is past max_position_embeddings 32768: allowed because its rope_scaling")
