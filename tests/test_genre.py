"""The off-genre rule: what it flags, why, and what it lets through.

Positives are the issue's quoted texts and texts SmolLM2 wrote under the paper's Yelp prompt
(docs/results/templates.md); negatives are review-like texts, including real-review habits that
resemble the patterns ("Sure, it's a $5 hot dog", "I can't help but love", "fake syrup", "I'm sorry
to say"). On the real Yelp reviews (when present), the rule's false-positive rate is bounded.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from invink_audit.evaluation import OffGenre, off_genre, off_genre_share

YELP = Path(__file__).resolve().parents[2] / "shared" / "data" / "yelp"
#: At most this share of real held-out restaurant reviews may be flagged (measured: 5 of 1,564: four links
#: and one junk text).
MAX_REAL_SHARE = 0.01

ISSUE_TEXTS = {
    "I'd be happy to provide you with a perfect copy of the provided Business Category Feedback List for this "
    "restaurant.": OffGenre.ASSISTANT_PREAMBLE,
    "I'm an AI model specialized in providing personal feedback on local restaurants.": OffGenre.ASSISTANT_PREAMBLE,
    "I'm sorry for any confusion, but I'm unable to help with that.": OffGenre.REFUSAL,
    "Here's a mock review of a fictional restaurant with 4.0 stars:": OffGenre.ASSISTANT_PREAMBLE,
    "Visit https://www.bestpizza-example.com/menu for the full menu and prices.": OffGenre.URL,
    "Great food, see www.tacotown.net for the hours": OffGenre.URL,
}

GENERATED_OFF_GENRE = {
    "Sure, here's an example of a review that wins:\n\nText: the mayo was great": OffGenre.ASSISTANT_PREAMBLE,
    "Certainly! Below is a review of a restaurant with 5 stars.": OffGenre.ASSISTANT_PREAMBLE,
    "\u201cHere\u2019s another one for you: the pasta was cold.\u201d": OffGenre.ASSISTANT_PREAMBLE,
    "Keeping up to date, I'm here to help with the blogging rocket that never goes to sleep.": OffGenre.ASSISTANT_PREAMBLE,
    "As an AI language model, I do not eat, but the reviews say the soup is good.": OffGenre.ASSISTANT_PREAMBLE,
    "P.S.\nHey,\n\nI would be happy to assist you with your review.": OffGenre.ASSISTANT_PREAMBLE,
    "I cannot generate reviews of real businesses, but the menu looks nice.": OffGenre.REFUSAL,
    "This is a common complaint.\n\n1. The bar is too dark\n2. The food is too cold\n3. The staff": OffGenre.LIST,
    "Pros:\n- friendly staff\n- cheap beer\nCons: parking": OffGenre.LIST,
    "The Business Category for the restaurant is Pizza and the food is fine.": OffGenre.META_TEXT,
    'Review (4.0 stars): "Great tacos and a friendly crowd"': OffGenre.META_TEXT,
    "Beautiful story. Here is a review on a fictional restaurant, focusing on the dining scene.": OffGenre.META_TEXT,
    "My favourite place is [Restaurant Name] in [City], where the soup is great.": OffGenre.META_TEXT,
    "Just like at the infamous [LocalRestaurant], they make a better burger.": OffGenre.META_TEXT,
    "**Food**: great. **Service**: slow but friendly.": OffGenre.META_TEXT,
    "## My visit\nThe food was fine and the staff was friendly.": OffGenre.META_TEXT,
    "Title: \"Remixed\"\n\nThis restaurant boasted a clear and well-organized menu.": OffGenre.META_TEXT,
    "A company has 5.0 out of 5 stars. Satisfied customers say the dining is good.": OffGenre.META_TEXT,
    "Poor reviews have lower scores, so this one is a 1.": OffGenre.META_TEXT,
    "The food was great. I hope this helps with your project!": OffGenre.META_TEXT,
    "The burger was decent. Let me know if you want a longer version.": OffGenre.META_TEXT,
    "Please, provide one favorite review of your favorite restaurant.": OffGenre.META_TEXT,
    "assistant\nThe food was great and the staff friendly.": OffGenre.META_TEXT,
    "This review appears to be a faux review that contains inaccuracies.": OffGenre.META_TEXT,
    "A well-known American restaurant called RISKA has a 1.0 stars and three free plates.": OffGenre.META_TEXT,
    "This review consists of both the positive and negative aspects, and the score is 150%.": OffGenre.META_TEXT,
    "It would work. Here is the response with which you can evaluate your top restaurants.": OffGenre.META_TEXT,
    "I need a user that presents a negative experience of a steakhouse.": OffGenre.META_TEXT,
    'The original: "The grilled chicken skewers were the best I have had."': OffGenre.META_TEXT,
    "Restaurants in [type] has a small but lovable variety of options.": OffGenre.META_TEXT,
    "I'm not sure what you're talking about. Our bakery is known for its pastries.": OffGenre.ASSISTANT_PREAMBLE,
}

EMPTY_TEXTS = ["", "   \n\t", "Che", "Chef Iron", "5.0 !!!", '""', "4.0 stars", "The Original Jerk - Creme Apple"]

REVIEW_LIKE = [
    "This place is pretty good. I had 2 slices last night, one plain, one pepperoni. Staff was friendly too.",
    "Wonderful Pho! We did takeout and they did a great job with packing all the herbs and noodles.",
    "Sure, it's a $5 hot dog, but it's good and huge! Great buns, too! My kids love it.",
    "Absolutely amazing food and service! Go there all the time, very nice family run business.",
    "I'm sorry to say that this place was a huge disappointment. I could have made the hummus at home.",
    "I can't help but love their fries. The burgers are fine, the shakes are better.",
    "Pancakes with fake syrup were a little burnt. Sausage had to be the cheapest brand.",
    "The server was happy to help us pick a wine, and the steak was cooked perfectly.",
    "Here's the thing: the tacos are great but the line is an hour long on Fridays.",
    "Drinks were well done. Spinach dip, awesome. Jack Daniels chicken strips too well done.",
    "I read the Yelp reviews before coming and they were right: the dumplings are the best in town.",
    "1. The sweet potato pancakes!!!!! 2. The cinnamon syrup - a definite must try. 3. Their buttermilk.",
    "We tried it for the first time.\n\nThe noodles were fresh and the broth rich. Four stars from me.",
    "Our waitress [Jenny] was great and the [jumbo] prawns were worth it.",
    "I gave it 4 out of 5 stars because the sirloin was overcooked.",
    "Best sushi in Tempe. The manager said sorry for the inconvenience and comped our drinks.",
    "\u201cIt\u2019s a hidden gem,\u201d my friend said, and she was right. Service: 5/5. Parking: tight.",
    "Amazing. 4.7 stars really. I've had several things from here and all were great.",
    "Great food, friendly staff, fair prices.",
    "I walked in and asked for a table, and the host was happy to help us right away.",
]


@pytest.mark.parametrize("text, reason", [*ISSUE_TEXTS.items(), *GENERATED_OFF_GENRE.items()])
def test_off_genre_texts_are_flagged_with_their_reason(text, reason):
    assert off_genre(text) == reason


@pytest.mark.parametrize("text", EMPTY_TEXTS)
def test_empty_and_fragments_are_flagged(text):
    assert off_genre(text) == OffGenre.EMPTY


@pytest.mark.parametrize("text", REVIEW_LIKE)
def test_review_like_texts_pass(text):
    assert off_genre(text) is None


def test_reason_is_a_plain_string():
    reason = off_genre("I'm sorry for any confusion, but I'm unable to help with that.")
    assert isinstance(reason, str) and reason == "refusal"
    assert {r.value for r in OffGenre} == {"empty", "refusal", "assistant preamble", "url", "list", "meta-text"}


def test_first_matching_check_wins():
    # a refusal that also echoes the prompt and links somewhere is a refusal
    assert off_genre("I'm sorry, but I can't write a Business Category review; see https://x.org") == OffGenre.REFUSAL
    # a preamble before a link
    assert off_genre("Sure, here's a review: https://x.org/review") == OffGenre.ASSISTANT_PREAMBLE


def test_non_string_is_rejected():
    with pytest.raises(ValueError, match="text must be a string"):
        off_genre(None)


def test_share_has_a_wilson_interval():
    texts = ["", "Here's a mock review for a fictional restaurant:"] + REVIEW_LIKE[:8]
    share = off_genre_share(texts)
    assert share.estimate == pytest.approx(0.2) and share.method == "wilson"
    # closed form (Wilson 1927) for 2 of 10 at 95%: centre 0.28326..., half-width 0.22658...
    assert share.lower == pytest.approx(0.05668, abs=1e-4) and share.upper == pytest.approx(0.50984, abs=1e-4)
    none = off_genre_share(REVIEW_LIKE)
    assert none.estimate == 0.0 and none.lower == 0.0 and 0 < none.upper < 0.25
    every = off_genre_share(EMPTY_TEXTS)
    assert every.estimate == 1.0 and every.upper == 1.0 and every.lower > 0.5


@pytest.mark.parametrize("flagged, n", [(0, 1), (1, 1), (1, 3), (2, 10), (7, 37), (0, 100), (100, 100), (13, 1000)])
@pytest.mark.parametrize("confidence", [0.5, 0.95, 0.99])
def test_share_interval_is_the_wilson_closed_form(flagged, n, confidence):
    """scipy's Wilson interval against the closed form written out (Brown, Cai & DasGupta 2001, eq. 4)."""
    from scipy.stats import norm

    texts = [""] * flagged + REVIEW_LIKE[:1] * (n - flagged)
    assert off_genre(REVIEW_LIKE[0]) is None
    share = off_genre_share(texts, confidence)
    p, z = flagged / n, float(norm.ppf(0.5 + confidence / 2))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert share.lower == pytest.approx(max(0.0, centre - half), abs=1e-12)
    assert share.upper == pytest.approx(min(1.0, centre + half), abs=1e-12)


@pytest.mark.parametrize("bad", [[], (t for t in ())])
def test_share_of_nothing_is_rejected(bad):
    with pytest.raises(ValueError, match="must not be empty"):
        off_genre_share(bad)


def test_share_rejects_a_bad_confidence():
    with pytest.raises(ValueError, match="confidence"):
        off_genre_share(["a b c"], confidence=1.0)


@pytest.mark.skipif(not (YELP / "test.csv").is_file(), reason="Yelp data not present (../shared/data/yelp)")
def test_real_held_out_restaurant_reviews_are_rarely_flagged():
    with open(YELP / "test.csv", newline="", encoding="utf-8") as f:
        texts = [r["text"] for r in csv.DictReader(f) if r["label1"] == "Business Category: Restaurants"]
    share = off_genre_share(texts)
    assert len(texts) > 1000 and share.estimate <= MAX_REAL_SHARE
