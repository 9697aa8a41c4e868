"""The WikiText detokenizer Megatron applies before tokenizing a WikiText-103 file (tasks/zeroshot_gpt/detokenizer.py,
Megatron-LM fb13c1de21^): it undoes the dataset's spaced-out punctuation so a GPT-2 tokenizer sees ordinary text.

The rules run in this order; the order matters (a later rule sees the output of the earlier ones).
"""

from __future__ import annotations

import re

# (kind, pattern, replacement): "s" is a literal str.replace, "re" a regular expression substitution.
_RULES: tuple[tuple[str, str, str], ...] = (
    ("s", "s '", "s'"),  # plural possessive
    ("re", r"/' [0-9]/", r"/'[0-9]/"),  # kept as Megatron has it (it matches a literal "/' 1/" only)
    ("s", " @-@ ", "-"),  # number and word separators
    ("s", " @,@ ", ","),
    ("s", " @.@ ", "."),
    ("s", " : ", ": "),  # punctuation
    ("s", " ; ", "; "),
    ("s", " . ", ". "),
    ("s", " ! ", "! "),
    ("s", " ? ", "? "),
    ("s", " , ", ", "),
    ("re", r"\(\s*([^\)]*?)\s*\)", r"(\1)"),  # brackets and quotes hug their contents
    ("re", r"\[\s*([^\]]*?)\s*\]", r"[\1]"),
    ("re", r"{\s*([^}]*?)\s*}", r"{\1}"),
    ("re", r"\"\s*([^\"]*?)\s*\"", r'"\1"'),
    ("re", r"'\s*([^']*?)\s*'", r"'\1'"),
    ("s", "= = = =", "===="),  # section headings
    ("s", "= = =", "==="),
    ("s", "= =", "=="),
    ("s", " \N{DEGREE SIGN} ", "\N{DEGREE SIGN}"),
    ("s", " \n", "\n"),
    ("s", "\n ", "\n"),
    ("s", " N ", " 1 "),
    ("s", " 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """`text` with WikiText's tokenization undone, rule by rule as Megatron does it."""
    for kind, pattern, replacement in _RULES:
        text = text.replace(pattern, replacement) if kind == "s" else re.sub(pattern, replacement, text)
    return text
