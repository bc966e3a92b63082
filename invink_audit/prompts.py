"""Chat prompts with a private form (description + one reference) and a public form (description only).

Paper Appendix D, Table 4 (``tab:prompts``); a null reference renders exactly the public prompt
(replace-by-null adjacency, paper §3). :class:`PromptTemplate` (with the public devices ``answer_prefix``,
``stop``, ``examples``, ``completion``), the presets (:data:`PRESETS`, :func:`get_preset`), label fields
(:func:`template_for_labels`), and encoding into a :class:`TextRequest` (:func:`encode_request`).

Design: docs/guide/generating.md (§"Prompt templates").
"""

from __future__ import annotations

import dataclasses
import functools
import html
import re
import string
import sys
import unicodedata
import urllib.parse
from collections.abc import Mapping, Sequence
from types import MappingProxyType

__all__ = [
    "PRESETS",
    "PRESET_LABEL_FIELDS",
    "LabelField",
    "PromptTemplate",
    "TextRequest",
    "defaulted_label_fields",
    "encode_messages",
    "encode_prompt",
    "encode_request",
    "forced_text_ids",
    "get_preset",
    "label_fields_for",
    "reached_stop",
    "refuse_private_in_public",
    "refuse_private_strings",
    "release_text",
    "require_label_fields",
    "template_for_batch",
    "template_field_names",
    "template_for_labels",
    "template_for_model",
]

REFERENCE_FIELD = "reference"
PAPER_SYSTEM_PROMPT = "You are a chatbot"


def template_field_names(template: str, what: str) -> frozenset[str]:
    """The named fields of a format-string template (``what`` names it in errors); positional, spec'd or converted
    fields are refused."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"{what} is not a valid format string: {err}; got {template!r}") from err
    names = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"{what} may only use named fields ({{name}}); got field {name!r}")
        if spec or conversion:
            raise ValueError(f"{what} field {{{name}}} must not have a format spec or conversion")
        names.add(name)
    return frozenset(names)


@dataclasses.dataclass(frozen=True)
class PromptTemplate:
    """A private/public prompt pair (paper Table 4), validated at construction.

    * ``private``: user message with one reference; must contain ``{reference}``;
    * ``public``: user message without the reference; must not contain ``{reference}``;
    * ``system``: system message (``None`` for none);
    * ``fields``: values of the other (public) fields, e.g. ``{"category": "Restaurants"}``.
    """

    name: str
    private: str
    public: str
    system: str | None = PAPER_SYSTEM_PROMPT
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    answer_prefix: str = ""
    stop: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    completion: bool = False

    def __post_init__(self) -> None:
        for attr in ("name", "private", "public"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr).strip():
                raise ValueError(f"{attr} must be a non-empty string; got {getattr(self, attr)!r}")
        if self.system is not None and not isinstance(self.system, str):
            raise ValueError(f"system must be a string or None; got {self.system!r}")
        if not isinstance(self.answer_prefix, str):
            raise ValueError(f"answer_prefix must be a string; got {self.answer_prefix!r}")
        if REFERENCE_FIELD in template_field_names(self.answer_prefix, "answer prefix"):
            raise ValueError(f"answer_prefix must not contain {{{REFERENCE_FIELD}}}: every row starts its answer alike")
        for attr in ("stop", "examples"):
            value = getattr(self, attr)
            if isinstance(value, str) or not isinstance(value, Sequence):
                raise ValueError(f"{attr} must be a sequence of strings; got {value!r}")
            if any(not isinstance(v, str) or not (v if attr == "stop" else v.strip()) for v in value):
                raise ValueError(f"every entry of {attr} must be a non-empty string; got {list(value)!r}")
            object.__setattr__(self, attr, tuple(value))
        if not isinstance(self.completion, bool):
            raise ValueError(f"completion must be a bool; got {self.completion!r}")
        private_names = template_field_names(self.private, "private template")
        public_names = template_field_names(self.public, "public template")
        if REFERENCE_FIELD not in private_names:
            raise ValueError(f"private template must contain {{{REFERENCE_FIELD}}}; got {self.private!r}")
        if REFERENCE_FIELD in public_names:
            raise ValueError(f"public template must not contain {{{REFERENCE_FIELD}}}; got {self.public!r}")
        if not isinstance(self.fields, Mapping):
            raise ValueError(f"fields must be a mapping of field name to string; got {self.fields!r}")
        fields = dict(self.fields)
        for key, value in fields.items():
            if key == REFERENCE_FIELD:
                raise ValueError(f"fields must not set {{{REFERENCE_FIELD}}}: the reference is given per text")
            if not isinstance(value, str):
                raise ValueError(f"prompt field {key!r} must be a string; got {value!r}")
        object.__setattr__(self, "fields", MappingProxyType(fields))

    @property
    def field_names(self) -> frozenset[str]:
        """Public fields used by either template (``reference`` excluded)."""
        names = template_field_names(self.private, "private template") | template_field_names(self.public, "public template")
        return (names | template_field_names(self.answer_prefix, "answer prefix")) - {REFERENCE_FIELD}

    def with_fields(self, **fields: str) -> PromptTemplate:
        """A copy with some public field values set or replaced."""
        unknown = set(fields) - self.field_names
        if unknown:
            raise ValueError(
                f"prompt {self.name!r} has no field(s) {sorted(unknown)}; its fields are {sorted(self.field_names)}"
            )
        return dataclasses.replace(self, fields={**self.fields, **fields})

    def _values(self) -> dict[str, str]:
        missing = self.field_names - set(self.fields)
        if missing:
            raise ValueError(
                f"prompt {self.name!r} needs values for field(s) {sorted(missing)} (e.g. --prompt-field NAME=VALUE)"
            )
        return dict(self.fields)

    def user_message(self, reference: str | None) -> str:
        """The user message for one reference; ``None`` or ``""`` (a null reference) gives the public one."""
        if reference is not None and not isinstance(reference, str):
            raise ValueError(f"reference must be a string or None; got {type(reference).__name__}")
        values = self._values()
        shots = ""
        if self.examples:  # public few-shot texts, the same in every row
            shots = "Examples of such texts:\n" + "\n".join(f'"{e}"' for e in self.examples) + "\n\n"
        if not reference:
            return shots + self.public.format(**values)
        return shots + self.private.format(**values, reference=reference)

    def answer_start(self) -> str:
        """The start of the model's answer in every row (``answer_prefix`` with its public fields)."""
        return self.answer_prefix.format(**self._values()) if self.answer_prefix else ""

    def as_json(self) -> dict:
        """The template as a JSON object (recorded with a release; the answer prefix, stop strings, examples
        and completion flag only when set, so records of older releases read and resume unchanged)."""
        optional = {"answer_prefix": self.answer_prefix, "stop": list(self.stop), "examples": list(self.examples),
                    "completion": self.completion}
        return {"name": self.name, "system": self.system, "private": self.private, "public": self.public,
                "fields": dict(self.fields), **{key: value for key, value in optional.items() if value}}

    @classmethod
    def from_json(cls, record: Mapping) -> PromptTemplate:
        """The inverse of :meth:`as_json` (a recorded list that is not a sequence is a ``TypeError``)."""
        unknown = set(record) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"a recorded prompt has unknown key(s) {sorted(unknown)}")
        return cls(**{key: tuple(value) if key in ("stop", "examples") else value for key, value in record.items()})

    def messages(self, reference: str | None) -> list[dict[str, str]]:
        """Chat messages (system, user) for one reference; a null reference gives the public messages."""
        user = {"role": "user", "content": self.user_message(reference)}
        if self.system is None:
            return [user]
        return [{"role": "system", "content": self.system}, user]


# --------------------------------------------------------------------------------------------
# presets (paper Appendix D, Table 4) and a generic one

# the paper's Yelp prompts (Table 4), shared by `yelp-paper` and `yelp`
_YELP_PRIVATE = (
    'Here is a text with Business Category : "{category}" and Review Stars : "{stars}" out of 5.0.\n'
    'Text: "{reference}"\n'
    "Please output one more similar review of a fictional place with the same score and of the same "
    "category of business. Poor reviews have lower scores and good reviews have higher scores."
)
_YELP_PUBLIC = (
    "Please give me a fake Yelp customer review of a fictional business with Business Category : "
    '"{category}" and Review Stars : "{stars}" out of 5.0. Poor reviews have lower scores and good '
    "reviews have higher scores."
)

_PRESETS = {
    "mimic": PromptTemplate(
        name="mimic",
        private=(
            "Here is the text of the discharge summary of a patient discharged from a hospital\n"
            'Text: "{reference}"\n'
            "Please give me another text of a fake patient discharge summary for discharge from a hospital. "
            "Include typical sections like admitting diagnosis, major procedures (if any), discharge medications "
            "(using fictional drug names and dosages), and general follow-up instructions. Do not include any "
            "names, dates, or specific medical record numbers. The output text must begin with the exact words "
            '"Discharge Instructions:".'
        ),
        public=(
            "Please give me text of a fake patient discharge summary for discharge from a hospital. I only need "
            "fictional and representative examples for a non-medical purpose. Include typical sections like "
            "admitting diagnosis, major procedures (if any), discharge medications (using fictional drug names "
            "and dosages), and general follow-up instructions. Do not include any names, dates, or specific "
            'medical record numbers. The output text must begin with the exact words "Discharge Instructions:".'
        ),
    ),
    "yelp-paper": PromptTemplate(
        name="yelp-paper",
        private=_YELP_PRIVATE,
        public=_YELP_PUBLIC,
        fields={"category": "Restaurants", "stars": "4.0"},
    ),
    # the paper's Yelp prompts with the model's answer started as a quoted review and cut at the closing
    # quote (a 135M chat model answers the bare prompts like a chatbot: docs/results/templates.md)
    "yelp": PromptTemplate(
        name="yelp",
        private=_YELP_PRIVATE,
        public=_YELP_PUBLIC,
        fields={"category": "Restaurants", "stars": "4.0"},
        answer_prefix='Review ({stars} stars): "',
        stop=('"',),
    ),
    # base models (no chat template, e.g. Gemma-3-270M): a plain text to continue
    "yelp-completion": PromptTemplate(
        name="yelp-completion",
        private=(
            'A Yelp review of a business in the category "{category}", rated {stars} out of 5 stars:\n'
            '"{reference}"\n\n'
            'Another Yelp review of a different business in the category "{category}", rated {stars} out of 5 stars:'
        ),
        public='A Yelp review of a business in the category "{category}", rated {stars} out of 5 stars:',
        system=None,
        fields={"category": "Restaurants", "stars": "4.0"},
        answer_prefix='"',
        stop=('"',),
        completion=True,
    ),
    "tab": PromptTemplate(
        name="tab",
        private=(
            "Here is the text of a case transcript set before the European Court for Human Rights.\n"
            'Text: "{reference}"\n'
            "Please output a similar transcript of a fictional case under European Court for Human Rights. "
            "Begin with the phrase: 'PROCEDURE: The case originated in an application'."
        ),
        public=(
            "Please output a transcript of a fictional case under European Court for Human Rights. "
            "Begin with the phrase: 'PROCEDURE: The case originated in an application'."
        ),
    ),
    "generic": PromptTemplate(
        name="generic",
        private=(
            "Here is a text from a collection of {description}.\n"
            'Text: "{reference}"\n'
            "Please write one more text of the same kind, with invented names and details. Output only the text."
        ),
        public=(
            "Please write one text from a collection of {description}, with invented names and details. "
            "Output only the text."
        ),
        fields={"description": "short texts"},
        # the answer started as a quoted text and cut at the closing quote, as for `yelp` (on
        # the shipped patient messages the rule's off-genre share fell from 0.33 to 0.08)
        answer_prefix='Text: "',
        stop=('"',),
    ),
    "generic-completion": PromptTemplate(
        name="generic-completion",
        private='A text from a collection of {description}:\n"{reference}"\n\nAnother text from the same collection:',
        public="A text from a collection of {description}:",
        system=None,
        fields={"description": "short texts"},
        answer_prefix='"',
        stop=('"',),
        completion=True,
    ),
}

#: The preset templates by name (read-only).
PRESETS: Mapping[str, PromptTemplate] = MappingProxyType(_PRESETS)


def get_preset(name: str | PromptTemplate, **fields: str) -> PromptTemplate:
    """A preset by name (``mimic``, ``yelp``, ``yelp-paper``, ``yelp-completion``, ``tab``, ``generic``,
    ``generic-completion``), with optional field values."""
    if isinstance(name, PromptTemplate):
        template = name
    elif isinstance(name, str) and name.lower() in _PRESETS:
        template = _PRESETS[name.lower()]
    else:
        raise ValueError(f"prompt must be one of {sorted(_PRESETS)} or a PromptTemplate; got {name!r}")
    return template.with_fields(**fields) if fields else template


#: The completion-style twin of a chat preset, which a base model (no chat template) is prompted with instead:
#: the same public fields, a plain text to continue (measured in docs/results/templates.md).
COMPLETION_PRESETS: Mapping[str, str] = MappingProxyType({"yelp": "yelp-completion", "generic": "generic-completion"})


def template_for_model(template: PromptTemplate, tokenizer) -> PromptTemplate:
    """The template a model is prompted with: ``template`` itself, except that a base model (its tokenizer has
    no chat template) given a chat preset of :data:`COMPLETION_PRESETS`, unchanged but for its field values and
    examples, gets the preset's completion twin with those fields and examples. Any other chat template on a
    base model is left as it is (encoding it is refused, naming the completion presets)."""
    if getattr(tokenizer, "chat_template", None) is not None or template.completion:
        return template
    twin = COMPLETION_PRESETS.get(template.name)
    preset = _PRESETS.get(template.name)
    if twin is None or dataclasses.replace(template, fields=preset.fields, examples=preset.examples) != preset:
        return template
    return dataclasses.replace(_PRESETS[twin], fields={**_PRESETS[twin].fields, **template.fields},
                               examples=template.examples)


# --------------------------------------------------------------------------------------------
# labels as public fields (label-conditioned generation; paper App. D.1, Table 4 (tab:prompts): Yelp prompts carry the
# business category and review score; App. D.2 (sec:datasets), "Yelp Reviews": 10 categories x 5 scores)


@dataclasses.dataclass(frozen=True)
class LabelField:
    """How one label column fills one public field of a template: ``field`` takes the column's value,
    less ``prefix`` when the value starts with it (the Yelp file stores ``"Business Category: Restaurants"``,
    the paper's prompt says ``"Restaurants"``)."""

    column: str
    field: str
    prefix: str = ""

    def __post_init__(self) -> None:
        for attr in ("column", "field"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr):
                raise ValueError(f"{attr} must be a non-empty string; got {getattr(self, attr)!r}")
        if not isinstance(self.prefix, str):
            raise ValueError(f"prefix must be a string; got {self.prefix!r}")
        if self.field == REFERENCE_FIELD:
            raise ValueError(f"a label cannot fill {{{REFERENCE_FIELD}}}: the reference is given per text")

    def value(self, label: str) -> str:
        """The field value for a label value (``prefix`` removed once when present)."""
        if not isinstance(label, str):
            raise ValueError(f"label column {self.column!r} must hold a string; got {type(label).__name__}")
        value = label[len(self.prefix) :] if self.prefix and label.startswith(self.prefix) else label
        if not value.strip():
            raise ValueError(
                f"label column {self.column!r} is empty for this group; a prompt field cannot be empty "
                f"(fill or drop such records before generating)"
            )
        return value


#: The label columns each preset knows (the files the paper used): Yelp's ``label1``/``label2``.
_YELP_LABELS = (LabelField("label1", "category", "Business Category: "), LabelField("label2", "stars", "Review Stars: "))
PRESET_LABEL_FIELDS: Mapping[str, tuple[LabelField, ...]] = MappingProxyType(
    {"yelp": _YELP_LABELS, "yelp-paper": _YELP_LABELS, "yelp-completion": _YELP_LABELS}
)


def defaulted_label_fields(
    template: PromptTemplate, given: Sequence[str] = (), filled: Sequence[str] = ()
) -> tuple[str, ...]:
    """The fields of ``template`` that describe the data's labels (:data:`PRESET_LABEL_FIELDS`, e.g. Yelp's
    ``category`` and ``stars``) and still hold the preset's example values, neither ``given`` explicitly nor
    ``filled`` by labels: such a template prompts every text as, say, a 4-star restaurant review whatever the
    references are, and :func:`invink_audit.generation.generate` refuses it. Values set on purpose to the
    examples count as defaulted unless ``given`` (``prompt_fields``)."""
    preset = _PRESETS.get(template.name.lower())
    if preset is None:
        return ()
    described = {rule.field for rule in PRESET_LABEL_FIELDS.get(preset.name, ())}
    return tuple(sorted(
        name for name in described if name not in given and name not in filled and name in template.field_names
        and template.fields.get(name) == preset.fields.get(name)
    ))


def require_label_fields(template: PromptTemplate, given: Sequence[str] = (), filled: Sequence[str] = ()) -> None:
    """Refuse ``template`` when :func:`defaulted_label_fields` names any field: a ``ValueError`` that
    names the fields, their example values and how to give them (``prompt_fields`` / ``--prompt-field``,
    or label columns)."""
    defaulted = defaulted_label_fields(template, given, filled)
    if not defaulted:
        return
    values = {name: template.fields[name] for name in defaulted}
    flags = " ".join(f"--prompt-field {name}={value}" for name, value in values.items())
    raise ValueError(
        f"prompt {template.name!r} would prompt every text with its example value(s) {values} for field(s) "
        f"{list(defaulted)}, whatever the references are. Give the values that describe your references "
        f"(PromptSpec(fields={values!r}) in Python, or {flags} on the command line; the same values are accepted once given), "
        "or label columns (--label-columns) so that each batch is prompted with its own labels. Nothing was charged."
    )


# --------------------------------------------------------------------------------------------
# public inputs must not come from the private references (docs/guide/generating.md, "Public inputs")

#: A reference of at least this many characters (its words, one space apart: :func:`_words`) found inside a public
#: input is refused; a shorter one only when it is the whole public input (a one-word review inside a long public
#: example is a coincidence more often than a copy, and the whole-input rule still catches a copied short one).
MIN_CONTAINED_REFERENCE_CHARS = 20
#: A public input of at least this many characters found inside a reference is refused (a multi-line reference
#: copied line by line into a file of public examples).
MIN_QUOTED_PUBLIC_CHARS = 64


#: A run of this many consecutive words shared by a public input and a reference is a copy (a slice cut mid-word
#: at both ends, a review wrapped over several example lines or with a few characters changed still shares such
#: runs; ordinary phrases are shorter).
COPY_RUN_WORDS = 10

_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|x([0-9a-fA-F]{2})|([nrtbf\"\\/]))")
_ESCAPED = {"n": "\n", "r": "\r", "t": "\t", "b": " ", "f": " ", '"': '"', "\\": "\\", "/": "/"}


@functools.cache
def _format_characters() -> re.Pattern:
    """Invisible format characters (Unicode category Cf: soft hyphen, zero-width and bidirectional marks, word
    joiners, the byte-order mark), compiled on first use rather than when the module is imported."""
    return re.compile("[" + "".join(re.escape(chr(c)) for c in range(0x30000) if unicodedata.category(chr(c)) == "Cf") + "]")


def _unescaped(m: re.Match) -> str:
    code = m[1] or m[2] or m[3]
    if code is None:
        return _ESCAPED[m[4]]
    return chr(int(code, 16)) if int(code, 16) <= sys.maxunicode else " "


def _words(text: str) -> list[str]:
    """The words of ``text``, case folded, after undoing the escapes a copy of the data in another format carries
    (JSON's and Python's backslash escapes, HTML entities, percent-encoding; CSV's doubled quotes vanish with the
    punctuation), Unicode compatibility forms (NFKC), invisible format characters (zero-width spaces, soft
    hyphens) and apostrophes (``don't`` and ``dont`` are one word)."""
    text = urllib.parse.unquote(html.unescape(_ESCAPE.sub(_unescaped, text)))
    text = _format_characters().sub("", unicodedata.normalize("NFKC", text))
    return re.findall(r"\w+", re.sub(r"['\u2019\u02bc`]", "", text.casefold()))


def _runs(words: Sequence[str]) -> set[tuple[str, ...]]:
    return {tuple(words[i : i + COPY_RUN_WORDS]) for i in range(len(words) - COPY_RUN_WORDS + 1)}


def public_inputs(template: PromptTemplate) -> list[tuple[str, str]]:
    """Every public string a template puts into a prompt or a release, as ``(name, text)``: its system
    message, both prompts (without their fields), field values, answer prefix, stop strings and examples."""
    named = [("the system message", template.system or ""), ("the private prompt", template.private),
             ("the public prompt", template.public), ("the answer prefix", template.answer_prefix)]
    named += [(f"prompt field {name!r}", value) for name, value in template.fields.items()]
    named += [(f"stop string {i + 1}", value) for i, value in enumerate(template.stop)]
    named += [(f"public example {i + 1}", value) for i, value in enumerate(template.examples)]
    return [(name, text) for name, text in named if text.strip()]


def refuse_private_in_public(template: PromptTemplate, references: Sequence[str | None]) -> None:
    """Refuse a template whose public inputs come from ``references`` (the private input):
    :func:`refuse_private_strings` of :func:`public_inputs`."""
    refuse_private_strings(public_inputs(template), references, f"of prompt {template.name!r}")


def refuse_private_strings(named: Sequence[tuple[str, str]], references: Sequence[str | None], owner: str = "") -> None:
    """Refuse public strings (``(name, text)`` pairs) that come from ``references`` (the private input), compared
    as words (:func:`_words`): one that shares a run of :data:`COPY_RUN_WORDS` consecutive words with a reference
    (the strings are also tried joined, so a reference spread over several examples is found), equals a shorter
    reference, contains one of at least :data:`MIN_CONTAINED_REFERENCE_CHARS` characters, or (of at least
    :data:`MIN_QUOTED_PUBLIC_CHARS` characters) is contained in one. Public inputs are shown in every prompt and
    written into every record of the published output; from the private data, they would publish it verbatim. The
    ``ValueError`` names the public input and the reference's position (1-based), never the text."""
    named = [(name, _words(text)) for name, text in named]
    named = [(name, words) for name, words in named if words]
    if len(named) > 1:
        named.append(("the public inputs together", [w for _, words in named for w in words]))
    publics = [(name, f" {' '.join(words)} ", _runs(words)) for name, words in named]
    for position, reference in enumerate(references, start=1):
        words = _words(reference) if reference else []
        if not words:
            continue
        text, runs = f" {' '.join(words)} ", _runs(words)
        for name, public, public_runs in publics:
            copied = public == text or (len(text) - 2 >= MIN_CONTAINED_REFERENCE_CHARS and text in public)
            if copied or (len(public) - 2 >= MIN_QUOTED_PUBLIC_CHARS and public in text) or not runs.isdisjoint(public_runs):
                raise ValueError(
                    f"{name} {owner + ' ' if owner else ''}repeats private reference {position} of the input: public "
                    "inputs (examples, answer prefix, stop strings, field values) are published with every text and "
                    "must not come from the private data. Nothing was charged."
                )


def label_fields_for(
    template: PromptTemplate, label_columns: Sequence[str], fields: Mapping[str, str] | None = None
) -> tuple[LabelField, ...]:
    """The :class:`LabelField` of each label column for ``template``: the field ``fields`` maps it to (no
    prefix removed), else the preset's rule (:data:`PRESET_LABEL_FIELDS`), else the field of the same name. A
    column that fills no field of the template is an error: a label that does not reach the prompt would
    condition nothing."""
    if isinstance(label_columns, str) or not isinstance(label_columns, Sequence) or not label_columns:
        raise ValueError(f"label_columns must be a non-empty sequence of column names; got {label_columns!r}")
    explicit = dict(fields or {})
    unknown = set(explicit) - set(label_columns)
    if unknown:
        raise ValueError(f"fields names column(s) {sorted(unknown)} that are not label columns {list(label_columns)}")
    preset = {f.column: f for f in PRESET_LABEL_FIELDS.get(template.name, ())}
    resolved = []
    for column in label_columns:
        if column in explicit:
            rule = LabelField(column, explicit[column])
        elif column in preset:
            rule = preset[column]
        elif column in template.field_names:
            rule = LabelField(column, column)
        else:
            raise ValueError(
                f"label column {column!r} fills no field of prompt {template.name!r} (its fields are "
                f"{sorted(template.field_names)}); map it with PromptSpec(label_fields={{column: field}}) / --label-field COLUMN=FIELD"
            )
        if rule.field not in template.field_names:
            raise ValueError(
                f"prompt {template.name!r} has no field {rule.field!r} for label column {column!r}; its fields are "
                f"{sorted(template.field_names)}"
            )
        resolved.append(rule)
    targets = [r.field for r in resolved]
    if len(set(targets)) != len(targets):
        raise ValueError(f"two label columns fill the same prompt field: {targets}")
    return tuple(resolved)


def template_for_labels(
    template: PromptTemplate, labels: Mapping[str, str], fields: Mapping[str, str] | None = None
) -> PromptTemplate:
    """``template`` with its public fields set from one batch's ``labels`` (label column → value;
    see :func:`label_fields_for`). The labels are public: the same for every reference of the batch."""
    if not isinstance(labels, Mapping) or not labels:
        raise ValueError("labels must be a non-empty mapping of label column to value")
    rules = label_fields_for(template, list(labels), fields)
    return template.with_fields(**{rule.field: rule.value(labels[rule.column]) for rule in rules})


def template_for_batch(
    template: PromptTemplate,
    labels: Sequence[Mapping[str, str]] | None,
    fields: Mapping[str, str] | None,
    index: int,
) -> PromptTemplate:
    """The prompt of batch ``index``: ``template``, with that batch's labels placed by ``fields`` in a
    label-conditioned release (``labels`` one mapping per batch; ``None`` for an unlabelled release)."""
    if labels is None:
        return template
    return template_for_labels(template, labels[index], fields)


# --------------------------------------------------------------------------------------------
# encoding


def encode_messages(tokenizer, messages: Sequence[Mapping[str, str]], *, plain: bool = False) -> tuple[int, ...]:
    """Token ids of ``messages`` with the tokenizer's chat template and the generation prompt appended.

    A tokenizer without a chat template is rejected (the paper's prompts are chat prompts; inventing a format
    would change the model's behaviour unnoticed). ``plain=True`` makes that choice explicitly, for base
    models: the contents joined by blank lines, as a text to continue (with the tokenizer's special tokens).
    """
    if plain:
        return _plain_ids(tokenizer, messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer of this model has no chat template (a base model; tokenizer: {type(tokenizer).__name__}): "
            "use a completion-style prompt (--prompt yelp-completion or generic-completion; "
            "PromptTemplate(..., completion=True)) or an instruction-tuned (chat) model"
        )
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    ids = tuple(int(i) for i in ids)
    if not ids:
        raise ValueError("the chat template produced an empty prompt")
    return ids


def _plain_ids(tokenizer, messages: Sequence[Mapping[str, str]], answer: str = "") -> tuple[int, ...]:
    """The messages' contents joined by blank lines, then ``answer``, tokenised as one text to continue."""
    text = "\n\n".join(m["content"] for m in messages if m.get("content")) + "\n\n" + answer
    ids = tuple(int(i) for i in tokenizer(text)["input_ids"])
    if not ids:
        raise ValueError("the plain prompt is empty")
    return ids


def encode_prompt(tokenizer, template: PromptTemplate, reference: str | None, *, plain: bool = False) -> tuple[int, ...]:
    """Token ids of one row's prompt: ``template``'s messages for ``reference`` (``None``: the public row)
    rendered with the chat template, or as plain text when ``plain`` or ``template.completion`` (base
    models), then the template's public answer start (:meth:`PromptTemplate.answer_start`), the same
    in every row."""
    answer = template.answer_start()
    if plain or template.completion:
        return _plain_ids(tokenizer, template.messages(reference), answer)
    ids = encode_messages(tokenizer, template.messages(reference))
    if answer:
        ids += tuple(int(i) for i in tokenizer(answer, add_special_tokens=False)["input_ids"])
    return ids


def release_text(tokenizer, token_ids: Sequence[int], stop: Sequence[str] = ()) -> str:
    """The released text of drawn ``token_ids``: decoded (special tokens dropped), cut before the first
    public stop string it contains, stripped. A function of the released tokens and the template."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        text = text[: min(cuts)]
    return text.strip()


def forced_text_ids(tokenizer, text: str, *, eos_token_ids, max_new_tokens: int) -> tuple[tuple[int, ...], int]:
    """A text as a decoding run would have drawn it, for teacher forcing (:meth:`invink_audit.engine.Engine.force`):
    its tokens (no special tokens added), cut at an end-of-sequence token it spells out (generation would have
    ended there) and at ``max_new_tokens``, then ended by an end-of-sequence token when shorter. Returns the
    forced ids and how many of them are the text's own (the end-of-sequence token appended is not)."""
    tokens = tokenizer.encode(text, add_special_tokens=False)[:max_new_tokens]
    tokens = next((tokens[:j] for j, t in enumerate(tokens) if t in eos_token_ids), tokens)
    ended = () if len(tokens) == max_new_tokens else (min(eos_token_ids),)
    return tuple(tokens) + ended, len(tokens)


def reached_stop(tokenizer, token_ids: Sequence[int], stop: Sequence[str]) -> bool:
    """Whether the text drawn so far contains one of the public ``stop`` strings (decoded as released)."""
    if not stop:
        return False
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    return any(s in text for s in stop)


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """The encoded prompts for one text: the public prompt and one private prompt per reference.

    ``private_ids[i] is None`` marks a null (empty) reference: its row *is* the public row, so its logits
    equal the public logits exactly. ``key``: returned with the finished text (e.g. the batch index).
    ``stop``: the template's public stop strings, ending the text at the first token after which it holds one.
    ``private_prefix``: the token ids the template puts before every reference, from the template alone,
    never the data (:func:`template_prefix`); the engine caches them once for every row that starts with them.
    """

    public_ids: tuple[int, ...]
    private_ids: tuple[tuple[int, ...] | None, ...]
    key: object = None
    private_prefix: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        def bad(ids) -> bool:
            return any(not isinstance(t, int) or t < 0 for t in ids)

        public = tuple(self.public_ids)
        if not public or bad(public):
            raise ValueError("public_ids must be a non-empty sequence of non-negative token ids")
        private = tuple(None if ids is None else tuple(ids) for ids in self.private_ids)
        for i, ids in enumerate(private):
            if ids is not None and (not ids or bad(ids)):
                raise ValueError(f"private_ids[{i}] must be None or a non-empty sequence of non-negative token ids")
        if not private:
            raise ValueError("private_ids must hold at least one reference (B >= 1)")
        prefix = tuple(self.private_prefix)
        if bad(prefix):
            raise ValueError("private_prefix must be a sequence of non-negative token ids")
        object.__setattr__(self, "public_ids", public)
        object.__setattr__(self, "private_ids", private)
        object.__setattr__(self, "private_prefix", prefix)
        if isinstance(self.stop, str) or any(not isinstance(v, str) or not v for v in self.stop):
            raise ValueError(f"stop must be a sequence of non-empty strings; got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def batch_size(self) -> int:
        """``B``: the number of references (null ones included)."""
        return len(self.private_ids)


def template_prefix(tokenizer, template: PromptTemplate, *, plain: bool = False) -> tuple[int, ...]:
    """The token ids every private prompt of ``template`` starts with, from the template alone: the
    common prefix of two prompts encoded with two unrelated placeholder references (so no data is
    looked at), less its last token (a tokenizer may merge it with a reference's first characters)."""
    first = encode_prompt(tokenizer, template, "Zq", plain=plain)
    second = encode_prompt(tokenizer, template, "7 .", plain=plain)
    count = next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))
    return first[: max(count - 1, 0)]


def encode_request(
    tokenizer, template: PromptTemplate, references: Sequence[str | None], *, key=None, plain: bool = False
) -> TextRequest:
    """Encode one batch of references into a :class:`TextRequest` (null references → ``None``);
    ``plain``: see :func:`encode_messages`."""
    if isinstance(references, str) or not isinstance(references, Sequence):
        raise ValueError(f"references must be a sequence of strings; got {type(references).__name__}")
    public_ids = encode_prompt(tokenizer, template, None, plain=plain)
    private_ids = []
    for reference in references:
        if reference is not None and not isinstance(reference, str):
            raise ValueError(f"each reference must be a string or None; got {type(reference).__name__}")
        private_ids.append(None if not reference else encode_prompt(tokenizer, template, reference, plain=plain))
    prefix = template_prefix(tokenizer, template, plain=plain)
    return TextRequest(
        public_ids=public_ids, private_ids=tuple(private_ids), key=key, private_prefix=prefix, stop=template.stop
    )
