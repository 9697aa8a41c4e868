"""`--split-sentences`: nltk's Punkt splitter as Megatron's tools/preprocess_data.py sets it up.

Megatron (Encoder.initializer and Encoder.split, core_v0.16.1 and HEAD) loads `tokenizers/punkt/{lang}.pickle`,
which nltk >= 3.9 answers with `PunktTokenizer(lang)` (the pickle-free `punkt_tab` data). With `--keep-newlines` it
builds a PunktSentenceTokenizer on the same parameters whose period-context pattern takes the whitespace after a
sentence end into that sentence (so newlines survive; the pattern below says the same as Megatron's
CustomLanguageVars). A text is split in slices of 1,000,000 characters, each sliced on its own, and every sentence
becomes one sequence of the document. Without nltk or its data: one DataError with the command that installs it.
NLTK_DATA is honoured (Megatron's own lookup through it fails with nltk >= 3.9: the pickle path it builds there is
not the one nltk maps to punkt_tab).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from megatron_hpc.errors import DataError

SLICE_CHARS = 1_000_000
"""Megatron splits each slice of this many characters on its own (Encoder.split, `max_len`)."""
_INSTALL = "pip install nltk && python -m nltk.downloader punkt_tab"


def _nltk():
    try:
        import nltk
        from nltk.tokenize import punkt
    except ImportError:
        raise DataError(f"--split-sentences needs nltk and its punkt_tab data; {_INSTALL}") from None
    return nltk, punkt


def sentence_splitter(*, lang: str = "english", keep_newlines: bool = False) -> Callable[[str], list[str]]:
    """A function text -> sentences, as Megatron's --split-sentences [--keep-newlines] cuts them."""
    nltk, punkt = _nltk()
    # nltk reads NLTK_DATA once, when it is first imported; a value set later (a job script, a test) counts too.
    for folder in reversed(os.environ.get("NLTK_DATA", "").split(os.pathsep)):
        if folder and folder not in nltk.data.path:
            nltk.data.path.insert(0, folder)
    try:
        if hasattr(punkt, "PunktTokenizer"):  # nltk >= 3.9: what loading the punkt pickle returns there
            base = punkt.PunktTokenizer(lang)
        else:  # pragma: no cover - nltk < 3.9 still loads the pickle
            base = nltk.data.load(f"tokenizers/punkt/{lang}.pickle")
    except LookupError:
        raise DataError(f"--split-sentences needs nltk's punkt data for {lang!r}, which is not installed; "
                        f"{_INSTALL} (or set NLTK_DATA to a folder holding tokenizers/punkt_tab/{lang})") from None
    except ValueError as exc:
        raise DataError(f"--lang {lang!r}: {exc}; use a language punkt_tab has, such as english") from None
    if keep_newlines:

        class KeepNewlines(punkt.PunktLanguageVars):
            # Megatron's change to Punkt: whitespace after the sentence end (\s*) belongs to the sentence, and
            # the next token follows it directly instead of after \s+.
            _period_context_fmt = r"\S* %(SentEndChars)s \s* (?=(?P<after_tok> %(NonWord)s | (?P<next_tok>\S+)))"

        base = punkt.PunktSentenceTokenizer(train_text=base._params, lang_vars=KeepNewlines())

    def split(text: str) -> list[str]:
        return [s for start in range(0, len(text), SLICE_CHARS) for s in base.tokenize(text[start:start + SLICE_CHARS])]

    return split
