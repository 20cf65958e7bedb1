"""What a ``gravac compare`` study runs: every mode, gravac variant and seed, one job each.

A :class:`Variant` is one labelled gravac configuration: a compressor and a scaling policy with
their options, and optionally more of the optimizer's options (what
:class:`gravac.GravacOptimizer` takes; :data:`gravac_lab.compare.modes.ENGINE_OPTIONS`). On the
command line a variant is written (:func:`parse_variant`)::

    [LABEL=]COMPRESSOR[{JSON options}]:POLICY[{JSON options}][:{JSON engine options}]

    cf100=topk:fixed{"cf": 100}        Top-k at a static CF of 100, labelled cf100
    topk:exponential                   labelled topk-exponential
    trial=topk:exponential{"search": "trial"}
                                       the search by trial: the search options
                                       (gravac.config.SEARCH_OPTIONS) are written as policy
                                       options
    thc{"bits": 4}:geometric           labelled thc-bits4-geometric
    fp16:fixed{"cf": 2}:{"error_feedback": false}
                                       without error feedback, labelled
                                       fp16-fixed-cf2-error_feedbackFalse

A label, when not given, is the compressor and the policy with their options' names and values
(``topk-fixed-cf100``); labels are letters, digits and ``_ . + -``, so that they read in the
table, the CSV and the plots' legends as they are.

A :class:`Study` is a :class:`gravac_lab.compare.config.CompareConfig` (everything the jobs share),
its variants and its seeds. :meth:`Study.jobs` expands it: for every seed, every mode of
``config.modes``; a mode that runs gravac (:attr:`gravac_lab.compare.modes.Mode.takes_variants`)
once per variant, the others once. Seeds are outermost, so that drift in the machine's load
over a long study falls on every mode and variant alike. Each job's configuration is the shared
one with the job's seed (``CompareConfig.seed``) and variant in its compression fields: the
workers run a plain configuration and know nothing of studies.

Without variants, a study has one: the configuration's own compression options (the
single-variant command line, ``--compressor ... --policy ...``). Without seeds it has one: the
configuration's ``seed``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

from gravac import compressors, policies
from gravac_lab.compare import modes
from gravac_lab.compare.config import CompareConfig

__all__ = [
    "LABEL_PATTERN",
    "VARIANT_SYNTAX",
    "Job",
    "Study",
    "Variant",
    "parse_seeds",
    "parse_variant",
]

#: what a variant's label may hold: it appears as it is in the markdown table (no ``|``), the
#: CSV (no ``,``) and on the command line (no ``=``, ``:`` or ``{``)
_LABEL_CHARS = "A-Za-z0-9_.+-"
LABEL_PATTERN = re.compile(f"[{_LABEL_CHARS}]+")
#: what a default label holds in place of each run of other characters (from options' values)
_LABEL_FILLER = "_"
#: a compressor or policy name, as the registries spell them
_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")
#: the ``--variant`` syntax, for messages and ``--help``
_SPEC_SYNTAX = "COMPRESSOR[{JSON}]:POLICY[{JSON}][:{JSON}]"
VARIANT_SYNTAX = f"[LABEL=]{_SPEC_SYNTAX}"
#: an example of it, for messages
_VARIANT_EXAMPLE = """cf100=topk:fixed{"cf": 100}"""


def _options_label(options: dict[str, Any]) -> str:
    return "".join(f"-{key}{value}" for key, value in options.items())


@dataclass(frozen=True)
class Variant:
    """One gravac configuration of a study.

    Attributes:
        label: names the variant in the table, the CSV, the JSON and the plots.
        compressor, compressor_options: a name in :mod:`gravac.compressors` and its options.
        policy, policy_options: a name in :mod:`gravac.control.policies` and its options.
        engine_options: the optimizer's options of
            :data:`gravac_lab.compare.modes.ENGINE_OPTIONS` (the configuration's replaced).

    Raises:
        ValueError: an unknown name, options that do not fit, or a label outside
            :data:`LABEL_PATTERN`; the message names the field, its value and what is allowed
            (:func:`parse_variant` and :class:`Study` add the option).
    """

    label: str
    compressor: str
    policy: str
    compressor_options: dict[str, Any] = field(default_factory=dict)
    policy_options: dict[str, Any] = field(default_factory=dict)
    engine_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.label, str) or not LABEL_PATTERN.fullmatch(self.label):
            raise ValueError(
                f"label {self.label!r} must be letters, digits and _ . + - only "
                f"(write the variant as LABEL={_SPEC_SYNTAX})"
            )
        for part, registry, name, options in (
            ("compressor", compressors, self.compressor, self.compressor_options),
            ("policy", policies, self.policy, self.policy_options),
        ):
            if not isinstance(options, dict):
                raise ValueError(f"{part} options must be a JSON object, got {options!r}")
            if registry is policies:  # the search options are spelled as policy options
                options = modes.split_search(options)[0]
            modes.check_registered(
                registry, name, options, name_option=part, options_option=f"{part} options"
            )
        if not isinstance(self.engine_options, dict):
            raise ValueError(f"engine options must be a JSON object, got {self.engine_options!r}")
        gravac = {
            "compressor": self.compressor,
            "compressor_options": self.compressor_options,
            "policy": self.policy,
            "policy_options": self.policy_options,
        }
        modes.check_engine_options(self.engine_options, gravac, option="engine options")

    @staticmethod
    def default_label(
        compressor: str,
        policy: str,
        compressor_options: dict[str, Any],
        policy_options: dict[str, Any],
        engine_options: dict[str, Any] | None = None,
    ) -> str:
        """``compressor[-key value...]-policy[-key value...][-key value...]``, e.g.
        ``topk-fixed-cf100`` (characters a label may not hold become ``_``)."""
        label = (
            f"{compressor}{_options_label(compressor_options)}-"
            f"{policy}{_options_label(policy_options)}{_options_label(engine_options or {})}"
        )
        return re.sub(f"[^{_LABEL_CHARS}]+", _LABEL_FILLER, label)

    @classmethod
    def of_config(cls, cfg: CompareConfig) -> Variant:
        """The single variant of ``cfg``'s own compression options, labelled by default."""
        return cls(
            label=cls.default_label(
                cfg.compressor,
                cfg.policy,
                cfg.compressor_options,
                cfg.policy_options,
                cfg.engine_options,
            ),
            compressor=cfg.compressor,
            policy=cfg.policy,
            compressor_options=dict(cfg.compressor_options),
            policy_options=dict(cfg.policy_options),
            engine_options=dict(cfg.engine_options),
        )

    @property
    def spec(self) -> str:
        """The variant as ``--variant`` takes it (:func:`parse_variant` reads it back)."""

        def part(name: str, options: dict[str, Any]) -> str:
            return name + (json.dumps(options) if options else "")

        compressor = part(self.compressor, self.compressor_options)
        engine = f":{json.dumps(self.engine_options)}" if self.engine_options else ""
        return f"{self.label}={compressor}:{part(self.policy, self.policy_options)}{engine}"

    def apply(self, cfg: CompareConfig) -> CompareConfig:
        """``cfg`` with this variant's compressor, policy and engine options (checked
        again)."""
        return replace(
            cfg,
            compressor=self.compressor,
            compressor_options=dict(self.compressor_options),
            policy=self.policy,
            policy_options=dict(self.policy_options),
            engine_options=dict(self.engine_options),
        )


def _syntax_error(text: str, problem: str) -> ValueError:
    return ValueError(
        f"--variant {text!r}: {problem}; write {VARIANT_SYNTAX}, e.g. '{_VARIANT_EXAMPLE}' "
        f"(compressors: {compressors.names()}; policies: {policies.names()})"
    )


def _name_and_options(text: str, whole: str, part: str) -> tuple[str, dict[str, Any], str]:
    """A name, its optional ``{JSON}`` options, and the rest of ``text`` (``whole``: the
    ``--variant`` value, for messages)."""
    text = text.lstrip()
    match = _NAME_PATTERN.match(text)
    if match is None:
        raise _syntax_error(whole, f"no {part} name")
    name, rest = match.group(), text[match.end() :].lstrip()
    options, rest = _options(rest, whole, part)
    return name, options, rest


def _options(text: str, whole: str, part: str) -> tuple[dict[str, Any], str]:
    """The ``{JSON}`` options at the start of ``text`` (none: ``{}``) and the rest of it
    (``whole``: the ``--variant`` value, for messages)."""
    if not text.startswith("{"):
        return {}, text
    try:  # what decodes from "{" is an object
        options, end = json.JSONDecoder().raw_decode(text)
    except ValueError as exc:
        raise _syntax_error(whole, f"the {part} options are not JSON ({exc})") from None
    return options, text[end:].lstrip()


def parse_variant(text: str) -> Variant:
    """A ``--variant`` value (see the module docstring), checked against the registries.

    Raises:
        ValueError: the message names ``--variant``, quotes ``text`` and says what is allowed.
    """
    spec, label = text, None
    if "=" in text.split("{", 1)[0]:  # a label, unless every "=" is inside JSON options
        label, spec = (s.strip() for s in text.split("=", 1))
    compressor, compressor_options, rest = _name_and_options(spec, text, "compressor")
    if not rest.startswith(":"):
        raise _syntax_error(text, "expected ':' and a policy after the compressor")
    policy, policy_options, rest = _name_and_options(rest[1:], text, "policy")
    engine_options: dict[str, Any] = {}
    if rest.startswith(":"):
        rest = rest[1:].lstrip()
        if not rest.startswith("{"):
            raise _syntax_error(text, f"expected {{JSON}} engine options after ':', got {rest!r}")
        engine_options, rest = _options(rest, text, "engine")
    if rest:
        raise _syntax_error(text, f"unexpected {rest!r} after the policy")
    if label is None:
        label = Variant.default_label(
            compressor, policy, compressor_options, policy_options, engine_options
        )
    try:
        return Variant(
            label, compressor, policy, compressor_options, policy_options, engine_options
        )
    except ValueError as exc:
        raise ValueError(f"--variant {text!r}: {exc}") from None


def _check_seeds(seeds: tuple[Any, ...], given: object) -> None:
    """Raise ``ValueError`` naming ``--seeds`` and ``given`` unless ``seeds`` are distinct
    integers >= 0 (at least one)."""
    if (
        not seeds
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ValueError(
            f"--seeds must be distinct integers >= 0, comma-separated like 0,1,2; got {given!r}"
        )


def parse_seeds(text: str) -> tuple[int, ...]:
    """A ``--seeds`` value: distinct integers >= 0, comma-separated (``0,1,2``).

    Raises:
        ValueError: the message names ``--seeds``, quotes ``text`` and says what is allowed.
    """
    parts = [p.strip() for p in text.split(",")]
    # anything but a plain decimal becomes -1, which the check rejects
    seeds = tuple(int(p) if p.isascii() and p.isdigit() else -1 for p in parts)
    _check_seeds(seeds, text)
    return seeds


@dataclass(frozen=True)
class Job:
    """One run of a study: a mode, its variant (``None`` for a mode without), a seed, and the
    configuration its workers run."""

    mode: str
    variant: Variant | None
    seed: int
    config: CompareConfig

    @property
    def name(self) -> str:
        """How the log names the job: ``gravac cf100 seed 1``."""
        variant = "" if self.variant is None else f" {self.variant.label}"
        return f"{self.mode}{variant} seed {self.seed}"


@dataclass(frozen=True)
class Study:
    """A configuration, the gravac variants its gravac modes run, and the seeds every job
    runs with (see the module docstring).

    Raises:
        ValueError: variants without a mode that takes them, a label used twice, a variant
            the configuration cannot run, or bad seeds; the message names the option.
    """

    config: CompareConfig
    variants: tuple[Variant, ...] = ()
    seeds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        modes.check_config(self.config)
        variants, seeds = tuple(self.variants), tuple(self.seeds) or (self.config.seed,)
        takers = [m for m in self.config.modes if modes.get(m).takes_variants]
        if variants and not takers:
            runs = [m for m in modes.names() if modes.get(m).takes_variants]
            raise ValueError(
                f"--variant needs a mode that runs gravac variants ({', '.join(runs)}) in "
                f"--modes, got {','.join(self.config.modes)}"
            )
        if takers and not variants:
            variants = (Variant.of_config(self.config),)
        labels = [v.label for v in variants]
        twice = sorted({label for label in labels if labels.count(label) > 1})
        if twice:
            raise ValueError(
                f"--variant: label(s) {twice} name more than one variant; give each variant "
                f"its own, as LABEL={_SPEC_SYNTAX}"
            )
        for variant in variants:
            try:
                modes.check_config(variant.apply(self.config))
            except ValueError as exc:
                raise ValueError(f"--variant {variant.label}: {exc}") from None
        _check_seeds(seeds, ",".join(map(str, seeds)))
        object.__setattr__(self, "variants", variants)
        object.__setattr__(self, "seeds", seeds)

    def jobs(self) -> list[Job]:
        """Every job, seeds outermost, then modes in ``config.modes`` order, then variants."""
        out = []
        for seed in self.seeds:
            seeded = replace(self.config, seed=seed)
            for mode in self.config.modes:
                if not modes.get(mode).takes_variants:
                    out.append(Job(mode, None, seed, seeded))
                    continue
                for variant in self.variants:
                    out.append(Job(mode, variant, seed, variant.apply(seeded)))
        return out

    def to_dict(self) -> dict[str, Any]:
        """The variants (with their ``--variant`` spelling) and seeds, for the JSON report."""
        return {
            "variants": [
                {
                    "label": v.label,
                    "compressor": v.compressor,
                    "compressor_options": v.compressor_options,
                    "policy": v.policy,
                    "policy_options": v.policy_options,
                    "engine_options": v.engine_options,
                    "spec": v.spec,
                }
                for v in self.variants
            ],
            "seeds": list(self.seeds),
        }
