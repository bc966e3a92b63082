"""Is a synthetic text in the genre of its data, or a chatbot talking about the task?

:func:`off_genre` names the first of a fixed, ordered set of surface patterns that a text matches
(:class:`OffGenre`: empty, refusal, assistant preamble, url, list, meta-text), so that a template's
effect can be counted; :func:`off_genre_share` gives the flagged share with its interval.

Design: docs/results/templates.md (§"The off-genre rule": every pattern, how it was written and checked).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable

from scipy.stats import binomtest

from invink_audit.evaluation.stats import DEFAULT_CONFIDENCE, Interval

__all__ = ["OffGenre", "off_genre", "off_genre_share"]


class OffGenre(enum.StrEnum):
    """Why a text is off-genre (a ``str``: ``OffGenre.URL == "url"``)."""

    EMPTY = "empty"
    REFUSAL = "refusal"
    ASSISTANT_PREAMBLE = "assistant preamble"
    URL = "url"
    LIST = "list"
    META_TEXT = "meta-text"


#: Fewer words (runs of letters) than this is ``empty`` (of the 7,500 Yelp reviews of ``dev.csv`` and
#: ``test.csv`` only one junk text has fewer).
MIN_WORDS = 6
#: Bullet or numbered lines from which a text is a ``list``.
MIN_LIST_LINES = 2

_I = re.IGNORECASE
_M = re.MULTILINE
_WORD = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?")
_LEAD = r"^[\s\"'*_#>:-]*"  # quotes, markdown or a colon before the first word

_REFUSAL = (
    re.compile(
        r"\bI(?:'m| am) sorry\b[^.!?\n]{0,80}?\bI (?:can(?:'t|not)|am unable|'m unable|am not able|won't)\b", _I
    ),
    re.compile(
        r"\bI(?:'m| am)? ?(?:unable|not able) to (?:help|assist|provide|fulfil|fulfill|comply|generate|create|write"
        r"|complete|do that|answer|produce)\b", _I
    ),
    re.compile(
        r"\bI (?:can(?:'t|not)|won't|will not) (?:help|assist|provide|fulfil|fulfill|comply|generate|create|write"
        r"|complete|produce)\b(?! but\b)", _I
    ),
    re.compile(r"\b(?:I apologi[sz]e|my apologies)\b[^.!?\n]{0,80}?\b(?:can(?:'t|not)|unable)\b", _I),
)

_PREAMBLE_START = (
    # "Sure, here's", "Certainly! Below is", "Of course, I'd ...", "Okay, let me ..."
    re.compile(
        _LEAD + r"(?:sure(?: thing)?|certainly|of course|absolutely|okay|ok|great question)\b[\s,!.:;-]*"
        r"(?:here|below|I'd|I would|I'll|I will|I can|let me|happy|glad|no problem)\b", _I
    ),
    # "Here's a mock review", "Here is another review" (not "Here's the thing")
    re.compile(
        _LEAD + r"here(?:'s| is| are)\s+(?:a|an|another|one|some|my|your"
        r"|the (?:review|text|example|requested|revised))\b",
        _I,
    ),
    # "Below is a review", "The following is ..."
    re.compile(_LEAD + r"(?:below is|the following is)\b", _I),
    # "I'd be happy to provide you with ...", "I'm glad to help"
    re.compile(
        _LEAD + r"I(?:'d| would)? ?(?:be |'m |am )?(?:happy|glad|delighted|more than happy) to (?:help|assist|provide"
        r"|write|create|generate|give|share|craft|offer)\b", _I
    ),
    re.compile(
        _LEAD + r"(?:hello|hi|greetings)[!,.]?\s+(?:I'm|I am) (?:an? )?(?:AI|assistant|chatbot|language model)\b", _I
    ),
    re.compile(_LEAD + r"(?:how|what) can I (?:help|assist)\b", _I),
)
_AI_SELF = re.compile(
    r"\b(?:I(?:'m| am) (?:an? |just an? |only an? )?(?:AI|artificial intelligence|chatbot|language model|virtual "
    r"assistant|assistant)\b|as an? (?:AI|artificial intelligence|chatbot|language model)\b|\bAI (?:language )?model\b"
    r"|\blanguage model\b|\bI(?:'m| am) here to (?:help|assist)\b"
    r"|\bI(?:'d| would| am|'m)? ?(?:be )?(?:more than )?(?:happy|glad) to (?:help|assist) (?:you|with)\b"
    r"|\b(?:I(?:'m| am)(?: very| so| truly)? sorry|I apologi[sz]e) for (?:any|the) (?:confusion|misunderstanding)\b"
    r"|\bwhat you(?:'re| are) talking about\b)",
    _I,
)

_URL = re.compile(r"https?://|\bwww\.[\w-]+", _I)
_LIST_LINE = re.compile(r"^[ \t]*(?:[-*•+]|\d{1,2}[.)])[ \t]+\S", _M)

_META = (
    # the Yelp prompts' own words, and this project's answer prefix
    re.compile(r"\bbusiness category\b|\breview stars\b|\breview \(\d(?:\.\d)? stars?\)", _I),
    # a "Text:" label or a chat role on a line of its own
    re.compile(r"^[\s\"*]*text\s*:|^[ \t]*(?:user|assistant|system)[ \t]*:?[ \t]*$", _I | _M),
    # the prompt's scale and instructions echoed ("1.0 stars", "5.0 out of 5", "the score is", "good reviews
    # have higher scores"); no Yelp review of dev.csv or test.csv writes a rating as "4.0"
    re.compile(r"\b[0-5]\.0\b|\b(?:a|the) score of\b|\bscore is\b|\bwith a score\b|\bproduct review\b"
               r"|\b\d\.\d (?:out of|/) ?5(?:\.0)?\b|\b(?:poor|good|bad|low|high) reviews? (?:have|has|with) (?:a )?"
               r"(?:lower|higher|low|high) scores?\b", _I),
    # a label line ("Title:", "Fake Yelp review:") or an instruction to the reader ("Please provide ...")
    re.compile(r"^[\s\"*]*(?:title|rating|(?:the )?(?:original|response|answer|output|note)"
               r"|(?:(?:fake|sample|example|mock|product) )?(?:yelp )?review)\s*:"
               r"|^[\s\"*]*please,? (?:provide|share|give|write|output|send)\b"
               r"|\b(?:matching|meets?) your criteria\b|\bplease (?:provide|specify|indicate)\b"
               r"|\b(?:the|a) user (?:that|who)\b"
               r"|^\W*(?:a|the) (?:customer|user|reviewer) (?:described|wrote|says|gave)\b",
               _I | _M),
    # the text calls itself made up
    re.compile(r"\bfictio(?:nal|us)\b|\bfictitious\b|\bmade-up\b|\bhypothetical\b|\bfaux (?:review|text|business)", _I),
    # the reader addressed as the one who asked
    re.compile(
        r"\b(?:the|a) (?:text|review)s? you (?:mentioned|provided|gave|shared)\b|\byour (?:prompt|instructions)\b", _I
    ),
    re.compile(
        r"\b(?:a|an|another|one|this|my|the following)\s+(?:fake|mock|sample|example|imaginary|invented|dummy)\s+"
        r"(?:\w+\s+)?(?:review|text|business|restaurant|place|message|customer|company|name|summary)\b", _I
    ),
    # "Here is a review ...", "this review is ..." announcing itself mid-text
    re.compile(
        r"\b(?:here(?:'s| is)|below is)\s+(?:a|an|another|my|the)\s+(?:\w+\s+)?"
        r"(?:review|text|example|version|sample|snippet|draft|correction|rewrite)\b"
        r"|\bhere(?:'s| is| are) the (?:list|response|text|paragraphs?|answer|results?|review|example)\b",
        _I,
    ),
    re.compile(
        r"\bthe (?:provided|given|above|original|following|previous|requested) "
        r"(?:text|review|example|prompt|message|instructions)\b",
        _I,
    ),
    re.compile(r"\b(?:one more|another|a) similar (?:review|text|message)\b", _I),
    # placeholders
    re.compile(
        r"\[[^\]\n]{0,15}(?:name|restaurant|business|your|insert|company|place|city|location|date|address)"
        r"[^\]\n]{0,15}\]|\[(?:type|category|item|dish|food|number|rating|stars?)\]",
        _I,
    ),
    # markdown headings and bold labels
    re.compile(r"^[ \t]*#{1,6}[ \t]+\S|\*\*[^\s*][^*\n]{0,40}[^\s*]\*\*", _M),
    # an assistant's sign-off
    re.compile(
        r"\bI hope (?:this|that|these|it) (?:helps|meets|is helpful|gives|fits)\b|\blet me know if\b"
        r"|\bfeel free to (?:modify|adjust|customi[sz]e|edit|change|use|tweak|ask)\b|\bhappy to help\b(?=[^.!?]*$)",
        _I,
    ),
)

_QUOTES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u201c": '"', "\u201d": '"'})


def off_genre(text: str) -> str | None:
    """Why ``text`` is off-genre (an :class:`OffGenre`, which is a ``str``), or ``None`` when it passes.

    The checks and their order are in docs/results/templates.md ("The off-genre rule"). Curly quotes
    count as straight ones. A ``None`` answer says only that none of the patterns matched, not that the
    text is a good review.
    """
    if not isinstance(text, str):
        raise ValueError(f"text must be a string; got {type(text).__name__}")
    text = text.translate(_QUOTES)
    if len(_WORD.findall(text)) < MIN_WORDS:
        return OffGenre.EMPTY
    if any(p.search(text) for p in _REFUSAL):
        return OffGenre.REFUSAL
    if any(p.search(text) for p in _PREAMBLE_START) or _AI_SELF.search(text):
        return OffGenre.ASSISTANT_PREAMBLE
    if _URL.search(text):
        return OffGenre.URL
    if len(_LIST_LINE.findall(text)) >= MIN_LIST_LINES:
        return OffGenre.LIST
    if any(p.search(text) for p in _META):
        return OffGenre.META_TEXT
    return None


def off_genre_share(texts: Iterable[str], confidence: float = DEFAULT_CONFIDENCE) -> Interval:
    r"""The share of ``texts`` that :func:`off_genre` flags, with a Wilson score interval (Wilson 1927,
    JASA 22(158); Brown, Cai & DasGupta 2001, Stat. Sci. 16(2), eq. 4): for :math:`x` flags in :math:`n`,
    :math:`\hat p = x/n`, :math:`z = z_{1-\alpha/2}`,

    .. math:: \frac{\hat p + z^2/2n \pm z \sqrt{\hat p (1-\hat p)/n + z^2/4n^2}}{1 + z^2/n},

    which, unlike the Wald interval, stays inside [0, 1] and is not empty at 0 or ``n`` flags
    (``scipy.stats.binomtest(x, n).proportion_ci(method="wilson")``)."""
    flags = [off_genre(t) is not None for t in texts]
    if not flags:
        raise ValueError("texts must not be empty")
    if not isinstance(confidence, float) or not 0 < confidence < 1:
        raise ValueError(f"confidence must be a float in (0, 1); got {confidence!r}")
    ends = binomtest(sum(flags), len(flags)).proportion_ci(confidence, method="wilson")
    return Interval(sum(flags) / len(flags), ends.low, ends.high, confidence, "wilson")
