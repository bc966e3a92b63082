"""``invink-audit generate --mechanism amin|adapmixed``: the paper's baselines through the one release pipeline
(docs/guide/baselines.md). Amin et al. 2024 is accounted in zCDP before it runs and charged as a
:class:`accounting.ZcdpEvent`; AdaPMixED's spend is data-dependent, so it is never charged to a ledger and its
per-text spend, computed from the references, is never written.
"""

from __future__ import annotations

from invink_audit.cli import CliError, integer, number

#: what ``--mechanism`` accepts; ``invisibleink`` is the project's own mechanism, ``augpe`` runs apart (cli/_augpe.py)
MECHANISMS = ("invisibleink", "amin", "adapmixed", "augpe")

#: Amin et al.'s options with a default: (AminConfig field = attribute, flag, default), the paper's re-implementation
_AMIN_DEFAULTS = (("svt_threshold", "--svt-threshold", 0.7), ("svt_noise", "--svt-noise", 0.3),
                  ("public_temperature", "--public-temperature", 1.0))  # fmt: skip
#: Amin et al.'s own options (attribute, flag), refused for the other mechanisms: given, never ignored
AMIN_OPTIONS = (("max_private_tokens", "--max-private-tokens"), *((name, flag) for name, flag, _ in _AMIN_DEFAULTS))

_DATA_DEPENDENT_LEDGER = (
    "--mechanism adapmixed cannot be charged to a ledger: its spend is data-dependent (a Renyi filter stopped at "
    "--epsilon on the dataset it ran on), not an a-priori guarantee a ledger can compose; run it without --ledger, "
    "on data whose budget is not tracked (a public proxy, a comparison)"
)


def add_baseline_arguments(p) -> None:
    """``--mechanism`` and the flags of Amin et al. (defaults: the paper's re-implementation)."""
    p.add_argument("--mechanism", default="invisibleink", choices=MECHANISMS, help="the mechanism (default invisibleink)")
    amin = p.add_argument_group("Amin et al. 2024 (--mechanism amin)")
    amin.add_argument("--max-private-tokens", type=integer, help="r: private tokens per text at most (default: T)")
    amin.add_argument("--svt-threshold", type=number, help="sparse-vector threshold (default 0.7)")
    amin.add_argument("--svt-noise", type=number, help="sparse-vector noise scale sigma (default 0.3)")
    amin.add_argument("--public-temperature", type=number, help="temperature of public tokens (default 1.0)")


def baseline_release(args, values: dict):
    """The :class:`~invink_audit.generation.ReleaseConfig` of ``--mechanism amin|adapmixed`` from the release
    parameters the command line gave (``values``: as ``generate`` builds its config); ``--top-k`` is
    InvisibleInk's and refused, AdaPMixED with ``--ledger`` is refused."""
    from invink_audit.generation import ReleaseConfig

    if args.top_k is not None:
        raise CliError(f"--top-k applies to --mechanism invisibleink only; remove it for --mechanism {args.mechanism}")
    if args.mechanism == "adapmixed" and args.ledger is not None:
        raise CliError(_DATA_DEPENDENT_LEDGER)
    return ReleaseConfig(_mechanism(args, values), values["max_new_tokens"], values["delta"], num_texts=values["num_texts"],
                            num_texts_per_group=values["num_texts_per_group"], allow_all_null=values["allow_all_null"])


def _mechanism(args, values: dict):
    from invink_audit.mechanisms import AdaPMixEDConfig, AdaPMixEDMechanism, AminConfig, AminMechanism

    batch_size, max_new_tokens, delta = values["batch_size"], values["max_new_tokens"], values["delta"]
    temperature, epsilon = values["temperature"], values["epsilon"]
    if args.mechanism == "adapmixed":
        if epsilon is None:
            raise CliError("--mechanism adapmixed needs --epsilon (its stop rule's budget); --clip-norm does not apply")
        return AdaPMixEDMechanism(AdaPMixEDConfig(batch_size, epsilon, delta, temperature))
    r = max_new_tokens if args.max_private_tokens is None else args.max_private_tokens
    options = {"temperature": temperature} | {
        name: default if getattr(args, name) is None else getattr(args, name) for name, _, default in _AMIN_DEFAULTS
    }
    if epsilon is not None:
        config = AminConfig.planned(epsilon=epsilon, delta=delta, batch_size=batch_size, max_private_tokens=r, **options)
    else:
        config = AminConfig(values["clip_norm"], batch_size, max_private_tokens=r, **options)
    return AminMechanism(config)
