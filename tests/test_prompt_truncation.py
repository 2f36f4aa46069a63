"""A prompt longer than the text encoder reads is cut to its first tokens, as diffusers does, with a warning that
names its length (and a 40 MB prompt is not tokenized whole to find out)."""

from __future__ import annotations

import warnings

import pytest
from conftest import REPO
from transformers import AutoTokenizer

from flowrl.pipelines import diffusers_base
from flowrl.pipelines.diffusers_base import prompt_token_ids


@pytest.fixture
def tokenizer():
    diffusers_base._WARNED_LENGTHS.clear()
    return AutoTokenizer.from_pretrained(REPO / "flowrl" / "assets" / "digits_flow" / "tokenizer")


def test_a_prompt_that_fits_gives_no_warning(tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids = prompt_token_ids(tokenizer, ["a handwritten seven"], 8)
    assert ids.shape == (1, 8)


def test_an_over_long_prompt_is_cut_with_a_warning_naming_its_length(tokenizer):
    long = "a handwritten seven " * 5  # 100 characters
    count = len(tokenizer(long).input_ids)  # the whole prompt's tokens, special ones included
    assert count > 8
    message = rf"^a prompt of 100 characters \({count} tokens\) is longer than the text encoder's 8 tokens; only its first 8"
    with pytest.warns(UserWarning, match=message):
        ids = prompt_token_ids(tokenizer, [long, "a seven"], 8)
    assert ids.shape == (2, 8) and ids[0].tolist() == tokenizer(long, max_length=8, truncation=True).input_ids
    with warnings.catch_warnings():  # once per length, not once per batch
        warnings.simplefilter("error")
        prompt_token_ids(tokenizer, [long], 8)


def test_a_40_mb_prompt_is_cut_without_tokenizing_it_whole(tokenizer):
    huge = "seven " * (40 * 2**20 // 6)  # 41,943,036 characters
    with pytest.warns(UserWarning, match=r"^a prompt of 41,943,036 characters \(more than \d+ tokens\) is longer"):
        ids = prompt_token_ids(tokenizer, [huge[:1000]], 8)  # the ids of the cut prompt are those of its start
        assert ids.shape == (1, 8)
        full = prompt_token_ids(tokenizer, [huge], 8)
    assert full.tolist() == ids.tolist()
