"""Class prompts shared by the tiny prior, Espresso, FedDifRC and the baselines.

The tiny prior's word-level tokenizer only knows the words it was built with, so every prompt a
method writes must come from here (or use these words). Prompts name the class only, never the
style/domain: the prior has seen all styles, and a plain prompt does not pin one down.
"""

from __future__ import annotations

import re

# Words the tiny prior's vocabulary always contains besides the class names: the templates below
# and FedDifRC's self-supervised prompts ("a photo of a similar object", "a photo of a visual object").
BASE_WORDS = ("a", "an", "photo", "of", "the", "digit", "image", "similar", "visual", "object")


def prompt_template(dataset: str) -> str:
    """The class-prompt template for a dataset: digits get "the digit {}", others "a {}"."""
    name = dataset.lower()
    if "digit" in name or "mnist" in name:
        return "a photo of the digit {}"
    return "a photo of a {}"


def class_prompt(dataset: str, class_name: str) -> str:
    """e.g. class_prompt("digit-styles", "three") -> "a photo of the digit three"."""
    return prompt_template(dataset).format(class_name.replace("_", " "))


def class_prompts(dataset: str, class_names: list[str]) -> list[str]:
    """One prompt per class, in label order."""
    return [class_prompt(dataset, c) for c in class_names]


def prompt_words(prompts: list[str]) -> list[str]:
    """Lower-cased words of prompts plus BASE_WORDS, sorted and unique (the tiny vocabulary)."""
    words = set(BASE_WORDS)
    for p in prompts:
        # same split as the tokenizer's Whitespace pre-tokenizer: \w+|[^\w\s]+
        words.update(re.findall(r"\w+|[^\w\s]+", p.lower()))
    return sorted(words)
