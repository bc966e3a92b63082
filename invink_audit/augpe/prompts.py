r"""AugPE's two public prompts: RANDOM_API's generation prompt and VARIATION_API's paraphrase prompt.

Both are public: they contain no reference. The variation prompt holds one *candidate* text (itself public:
generated from public prompts and selected by the DP histogram) in ``{text}`` and a rephrase style in
``{style}``, drawn uniformly from the preset's public list for every paraphrase (official implementation,
``apis/hf_api.py`` l. 245–262, ``_rephrase``). Presets ``mimic`` (the InvisibleInk paper's Table
``tab:augpe_prompts``, App. C, verbatim) and ``yelp`` (the official implementation's ``yelp_rephrase_tone``), their
sources and their public label fields: docs/guide/baselines.md (§"AugPE", "Prompts").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from invink_audit.prompts import PRESET_LABEL_FIELDS, template_field_names

__all__ = ["AUGPE_PRESETS", "AugPEPrompts", "defaulted_augpe_fields", "get_augpe_prompts"]

TEXT_FIELD, STYLE_FIELD = "text", "style"


@dataclasses.dataclass(frozen=True)
class AugPEPrompts:
    """The public prompts of one AugPE run, validated at construction.

    * ``generation``: RANDOM_API's user message (no ``{text}``, no ``{style}``);
    * ``variation``: VARIATION_API's user message, with ``{text}`` (the candidate) and ``{style}``;
    * ``styles``: the rephrase styles, one drawn uniformly per paraphrase;
    * ``system``: the system message of both (``None``: none); ``fields``: values of the other public fields.
    """

    name: str
    generation: str
    variation: str
    styles: tuple[str, ...]
    system: str | None = None
    fields: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("name", "generation", "variation"):
            if not isinstance(getattr(self, attr), str) or not getattr(self, attr).strip():
                raise ValueError(f"{attr} must be a non-empty string; got {getattr(self, attr)!r}")
        if self.system is not None and (not isinstance(self.system, str) or not self.system.strip()):
            raise ValueError(f"system must be a non-empty string or None; got {self.system!r}")
        if isinstance(self.styles, str) or not all(isinstance(s, str) and s.strip() for s in self.styles or ()):
            raise ValueError(f"styles must be a non-empty sequence of non-empty strings; got {self.styles!r}")
        object.__setattr__(self, "styles", tuple(self.styles))
        if not self.styles:
            raise ValueError("styles must be a non-empty sequence of non-empty strings; got ()")
        if not isinstance(self.fields, Mapping) or not all(isinstance(v, str) for v in self.fields.values()):
            raise ValueError(f"fields must map field names to strings; got {self.fields!r}")
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))
        generation = template_field_names(self.generation, "generation")
        variation = template_field_names(self.variation, "variation")
        if generation & {TEXT_FIELD, STYLE_FIELD}:
            raise ValueError(
                f"generation must not contain {{text}} or {{style}}: it is the public seed prompt; got {self.generation!r}"
            )
        if not {TEXT_FIELD, STYLE_FIELD} <= variation:
            raise ValueError(f"variation must contain {{text}} and {{style}}; got {self.variation!r}")
        needed = (generation | variation) - {TEXT_FIELD, STYLE_FIELD}
        if needed - set(self.fields) or set(self.fields) - needed or set(self.fields) & {TEXT_FIELD, STYLE_FIELD}:
            raise ValueError(f"prompts {self.name!r} use fields {sorted(needed)}; fields gives {sorted(self.fields)}")

    def _messages(self, user: str) -> list[dict[str, str]]:
        message = {"role": "user", "content": user}
        return [message] if self.system is None else [{"role": "system", "content": self.system}, message]

    def public_inputs(self) -> list[tuple[str, str]]:
        """Every public string of these prompts, as ``(name, text)``: the system message, both user messages,
        the styles and the field values (:func:`invink_audit.prompts.refuse_private_strings` checks them)."""
        named = [("the system message", self.system or ""), ("the generation prompt", self.generation),
                 ("the variation prompt", self.variation)]
        named += [(f"style {i + 1}", style) for i, style in enumerate(self.styles)]
        named += [(f"prompt field {name!r}", value) for name, value in self.fields.items()]
        return [(name, text) for name, text in named if text.strip()]

    def generation_messages(self) -> list[dict[str, str]]:
        """RANDOM_API's chat messages (the same for every seed text)."""
        return self._messages(self.generation.format(**self.fields))

    def variation_messages(self, text: str, style: str) -> list[dict[str, str]]:
        """VARIATION_API's chat messages for one candidate ``text`` in one ``style``."""
        if not isinstance(text, str) or not isinstance(style, str):
            raise ValueError("text and style must be strings")
        return self._messages(self.variation.format(**self.fields, text=text, style=style))

    def with_fields(self, **fields: str) -> AugPEPrompts:
        """A copy with some public field values replaced (only fields the prompts use)."""
        unknown = set(fields) - set(self.fields)
        if unknown:
            raise ValueError(f"prompts {self.name!r} have no field(s) {sorted(unknown)}; theirs are {sorted(self.fields)}")
        return dataclasses.replace(self, fields={**self.fields, **fields})

    def to_json(self) -> dict:
        return {"name": self.name, "system": self.system, "generation": self.generation, "variation": self.variation,
                "styles": list(self.styles), "fields": dict(self.fields)}  # fmt: skip


_MEDICAL_STYLES = (
    "in a professional way", "in a professional tone", "in a professional style", "in a concise manner",
    "in a creative style", "using imagination", "in a storytelling tone", "in a formal manner",
    "using a variety of sentence structures",
)  # fmt: skip
_YELP_STYLES = (
    "in a casual way", "in a creative style", "in an informal way", "casually", "in a detailed way",
    "in a professional way", "with more details", "with a professional tone", "in a casual style",
    "in a professional style", "in a short way", "in a concise manner", "concisely", "briefly", "orally",
    "with imagination", "with a tone of earnestness", "in a grammarly-incorrect way", "with grammatical errors",
    "in a non-standard grammar fashion", "in an oral way", "in a spoken manner", "articulately", "by word of mouth",
    "in a storytelling tone", "in a formal manner", "with an informal tone", "in a laid-back manner",
)  # fmt: skip
_YELP_LABEL = "Business Category: {category}\tReview Stars: {stars}"

AUGPE_PRESETS: Mapping[str, AugPEPrompts] = MappingProxyType({
    "mimic": AugPEPrompts(
        name="mimic",
        system=("Please act as a sentence generator for the medical domain. Generated sentences should mimic the "
                "style of medical discharge summaries, using a variety of sentence structures."),
        generation=("Using a variety of sentence structures, write a patient discharge summary. Begin the output "
                    'with the phrase: "Discharge Instructions:"'),
        variation=('Please rephrase the following sentences "{text}" as a patient discharge summary: "{style}"\n'
                   'Begin the output with the phrase: "Discharge Instructions:"'),
        styles=_MEDICAL_STYLES,
    ),
    "yelp": AugPEPrompts(
        name="yelp",
        system=("You are required to write an example of review based on the provided Business Category and Review "
                "Stars that fall within the range of 1.0-5.0."),
        generation=_YELP_LABEL,
        variation="Based on " + _YELP_LABEL + ", please rephrase the following sentences {style}:\n{text}",
        styles=_YELP_STYLES,
        fields={"category": "Restaurants", "stars": "4.0"},
    ),
})  # fmt: skip


def defaulted_augpe_fields(preset: AugPEPrompts, given=()) -> tuple[str, ...]:
    """The fields of ``preset`` that describe the data's labels (those InvisibleInk's preset of the same name fills
    from labels, :data:`invink_audit.prompts.PRESET_LABEL_FIELDS`: Yelp's ``category`` and ``stars``) and are not
    ``given``: the preset's example values would prompt every text as, say, a 4-star restaurant review."""
    described = {rule.field for rule in PRESET_LABEL_FIELDS.get(preset.name, ())}
    return tuple(sorted(name for name in described & set(preset.fields) if name not in given))


def get_augpe_prompts(prompts: str | AugPEPrompts = "mimic", **fields: str) -> AugPEPrompts:
    """A preset by name (``mimic``, ``yelp``) or the given :class:`AugPEPrompts`, with optional field values.

    A preset named with a field that describes the data's labels left out (:func:`defaulted_augpe_fields`:
    ``yelp`` without ``category`` and ``stars``) is refused, as ``generate`` refuses InvisibleInk's: give the
    values that describe the references (the example values too, once given, are accepted). An
    :class:`AugPEPrompts` is taken as given, fields and all."""
    if isinstance(prompts, AugPEPrompts):
        resolved = prompts
    elif isinstance(prompts, str) and prompts.lower() in AUGPE_PRESETS:
        resolved = AUGPE_PRESETS[prompts.lower()]
        defaulted = defaulted_augpe_fields(resolved, given=fields)
        if defaulted:
            values = {name: resolved.fields[name] for name in defaulted}
            flags = " ".join(f"--prompt-field {name}={value}" for name, value in values.items())
            python = ", ".join(f"{name}={value!r}" for name, value in values.items())
            raise ValueError(
                f"prompts {resolved.name!r} would prompt every text with the example value(s) {values} for field(s) "
                f"{list(defaulted)}, whatever the references are. Give the values that describe your references "
                f"(get_augpe_prompts({resolved.name!r}, {python}) in Python, or {flags} on the command line, with "
                "--where to select the references they describe; the same values are accepted once given). Nothing "
                "was charged."
            )
    else:
        raise ValueError(f"prompts must be one of {sorted(AUGPE_PRESETS)} or an AugPEPrompts; got {prompts!r}")
    return resolved.with_fields(**fields) if fields else resolved
