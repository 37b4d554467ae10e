"""Incremental detokenization with stop strings (`engine.detokenizer`), on the shipped
demo tokenizer, fed one token at a time as the engine feeds a multi-token step."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from specd.devtools.testing import DEMO_TARGET
from specd.workers.engine.detokenizer import IncrementalDetokenizer

SENTENCE = "the cat sat on the mat. the dog sat on the log. the end"
PROMPT = [0, 5, 6]  # ids ahead of the output: never searched for stop strings


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TARGET)


def run(tokenizer, stop: tuple[str, ...], min_tokens: int = 0) -> tuple[str, bool, int]:
    """(released text, stopped, output tokens fed until the stop)."""
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, len(PROMPT), stop, min_tokens)
    text, fed = "", 0
    for fed in range(1, len(ids) + 1):
        text += detok.feed(PROMPT + ids[:fed], final=fed == len(ids))
        if detok.stopped:
            text += detok.feed(PROMPT + ids[:fed], final=True)
            break
    return text, detok.stopped, fed


def test_without_stop_strings_the_text_is_the_decoded_output(tokenizer):
    text, stopped, _ = run(tokenizer, ())
    assert text == SENTENCE and not stopped


def test_the_text_is_cut_before_the_first_stop_string(tokenizer):
    text, stopped, _ = run(tokenizer, ("sat", "zzz"))
    assert text == "the cat " and stopped


def test_min_tokens_ignores_a_stop_string_inside_its_tokens(tokenizer):
    """vLLM's rule: a stop string counts once more than ``min_tokens`` tokens are out,
    so one that ends inside the first ``min_tokens`` tokens' text does not stop."""
    ids = tokenizer.encode(SENTENCE, add_special_tokens=False)
    first_sat = next(k for k in range(1, len(ids)) if "sat" in tokenizer.decode(ids[:k]))
    # ends in token `first_sat`: counts when min_tokens is one less, not when equal
    assert run(tokenizer, ("sat",), first_sat - 1)[0] == "the cat "
    text, stopped, fed = run(tokenizer, ("sat",), first_sat)
    assert text == "the cat sat on the mat. the dog " and stopped and fed > first_sat
    assert run(tokenizer, ("sat",), len(ids)) == (SENTENCE, False, len(ids))
