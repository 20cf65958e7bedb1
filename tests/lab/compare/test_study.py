"""``--variant`` and ``--seeds``: parsing, their errors, and the jobs a study makes."""

from __future__ import annotations

import pytest

from gravac import compressors, policies
from gravac_lab.compare.config import CompareConfig
from gravac_lab.compare.study import Study, Variant, parse_seeds, parse_variant


@pytest.mark.parametrize(
    ("text", "variant"),
    [
        ('cf100=topk:fixed{"cf": 100}', Variant("cf100", "topk", "fixed", {}, {"cf": 100})),
        ("topk:exponential", Variant("topk-exponential", "topk", "exponential")),
        (
            'thc{"bits": 4}:geometric',
            Variant("thc-bits4-geometric", "thc", "geometric", {"bits": 4}),
        ),
        ('topk:fixed{"cf": 10}', Variant("topk-fixed-cf10", "topk", "fixed", {}, {"cf": 10})),
        (" a.b+c = topk { } : exponential ", Variant("a.b+c", "topk", "exponential")),
        (
            'x=powersgd:exponential{"ratio": 4}',
            Variant("x", "powersgd", "exponential", {}, {"ratio": 4}),
        ),
        (
            'fp16:fixed{"cf": 2}:{"error_feedback": false}',
            Variant(
                "fp16-fixed-cf2-error_feedbackFalse",
                "fp16",
                "fixed",
                {},
                {"cf": 2},
                {"error_feedback": False},
            ),
        ),
        (
            'e=topk:exponential : { "epsilon": 0.3, "window": 10 }',
            Variant("e", "topk", "exponential", {}, {}, {"epsilon": 0.3, "window": 10}),
        ),
        ("topk:exponential:{}", Variant("topk-exponential", "topk", "exponential")),
    ],
)
def test_parse_variant_reads_label_names_and_options(text: str, variant: Variant) -> None:
    assert parse_variant(text) == variant
    assert parse_variant(variant.spec) == variant  # spec is what --variant reads back


def test_an_unlabelled_variant_with_odd_options_gets_a_label_it_may_hold() -> None:
    variant = Variant(
        Variant.default_label("topk", "fixed", {}, {"cf": 100.5}),
        "topk",
        "fixed",
        {},
        {"cf": 100.5},
    )
    assert variant.label == "topk-fixed-cf100.5"
    assert Variant.default_label("topk", "fixed", {"a": [1, 2]}, {}) == "topk-a_1_2_-fixed"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("topk", "expected ':' and a policy"),
        (":fixed", "no compressor name"),
        ("topk:", "no policy name"),
        ("x=foo:fixed", f"compressor must be one of {compressors.names()}, got 'foo'"),
        ("topk:nope", f"policy must be one of {policies.names()}, got 'nope'"),
        ("topk:fixed", "needs option 'cf'"),
        ("topk:fixed{cf: 100}", "the policy options are not JSON"),
        ("topk[1]:fixed", "expected ':'"),
        ("topk:fixed[1]", "unexpected '[1]' after the policy"),
        ("topk:exponential:geometric", "expected {JSON} engine options after ':', got 'geometric'"),
        ('topk:exponential:{"speed": 1}', "engine options {'speed': 1} has no option 'speed'"),
        (
            'topk:exponential:{"error_feedback": "no"}',
            "error_feedback must be True or False, got 'no'",
        ),
        ('topk:exponential:{"epsilon": 2}', "epsilon must be a number in [0, 1], got 2"),
        (
            'topk:exponential:{"bucket_bytes": 1.5}',
            "bucket_bytes must be an integer >= 1 or None, got 1.5",
        ),
        ("topk:exponential:{epsilon: 1}", "the engine options are not JSON"),
        ('topk:exponential:{"window": 5} x', "unexpected 'x' after the policy"),
        ('topk:exponential{"speed": 1}', "has no option 'speed'"),
        ('topk:fixed{"cf": 0.5}', "cf must be a finite number >= 1"),
        ("a|b=topk:exponential", "label 'a|b' must be letters, digits and _ . + - only"),
        ("=topk:exponential", "label '' must be"),
    ],
)
def test_parse_variant_rejects_naming_the_option_the_value_and_what_is_allowed(
    text: str, says: str
) -> None:
    with pytest.raises(ValueError) as exc:
        parse_variant(text)
    message = str(exc.value)
    assert message.startswith(f"--variant {text!r}: ")
    assert says in message


@pytest.mark.parametrize("policy", policies.names())
def test_every_registered_policy_is_a_variant_or_names_its_missing_option(policy: str) -> None:
    try:
        variant = parse_variant(f"topk:{policy}")
    except ValueError as exc:  # a policy with a required option (fixed: cf)
        assert "needs option" in str(exc)
        assert str(exc).startswith(f"--variant 'topk:{policy}': ")
    else:
        assert variant.label == f"topk-{policy}"


@pytest.mark.parametrize(("text", "seeds"), [("0,1,2", (0, 1, 2)), ("7", (7,)), (" 3, 1 ", (3, 1))])
def test_parse_seeds(text: str, seeds: tuple[int, ...]) -> None:
    assert parse_seeds(text) == seeds


@pytest.mark.parametrize("text", ["", "0,,1", "1,1", "-1", "x", "1.5", "²"])
def test_parse_seeds_rejects_naming_the_option_and_the_value(text: str) -> None:
    with pytest.raises(ValueError, match="--seeds must be distinct integers >= 0") as exc:
        parse_seeds(text)
    assert repr(text) in str(exc.value)


def test_a_study_without_variants_runs_the_configuration_s_own() -> None:
    cfg = CompareConfig(modes=("ddp", "gravac"), policy="fixed", policy_options={"cf": 100}, seed=3)
    study = Study(cfg)
    assert study.variants == (Variant("topk-fixed-cf100", "topk", "fixed", {}, {"cf": 100}),)
    assert study.seeds == (3,)
    assert [(j.mode, j.seed) for j in study.jobs()] == [("ddp", 3), ("gravac", 3)]
    assert [j.config for j in study.jobs()] == [cfg, cfg]


def test_a_study_without_gravac_modes_has_no_variants() -> None:
    study = Study(CompareConfig(modes=("ddp", "ddp-fp16"), policy="fixed"))
    assert study.variants == ()
    assert [j.variant for j in study.jobs()] == [None, None]


def test_jobs_run_every_variant_of_every_gravac_mode_for_every_seed_seeds_outermost() -> None:
    cf10, exp = parse_variant('cf10=topk:fixed{"cf": 10}'), parse_variant("thc:exponential")
    cfg = CompareConfig(modes=("ddp", "gravac"))
    jobs = Study(cfg, (cf10, exp), (5, 6)).jobs()
    assert [j.name for j in jobs] == [
        "ddp seed 5",
        "gravac cf10 seed 5",
        "gravac thc-exponential seed 5",
        "ddp seed 6",
        "gravac cf10 seed 6",
        "gravac thc-exponential seed 6",
    ]
    assert [j.config.seed for j in jobs] == [5, 5, 5, 6, 6, 6]
    gravac = jobs[1].config
    assert (gravac.compressor, gravac.policy, gravac.policy_options) == (
        "topk",
        "fixed",
        {"cf": 10},
    )
    assert (jobs[2].config.compressor, jobs[2].config.policy) == ("thc", "exponential")
    assert gravac.modes == cfg.modes and gravac.steps == cfg.steps  # the rest is shared


@pytest.mark.parametrize(
    ("variants", "seeds", "says"),
    [
        ((parse_variant("topk:exponential"),) * 2, (), "label(s) ['topk-exponential'] name more"),
        ((), (1, 1), "--seeds must be distinct"),
        ((), (-1,), "--seeds must be distinct integers >= 0"),
    ],
)
def test_study_rejects_naming_the_option(
    variants: tuple[Variant, ...], seeds: tuple[int, ...], says: str
) -> None:
    with pytest.raises(ValueError, match=r"^--(variant|seeds)") as exc:
        Study(CompareConfig(modes=("gravac",)), variants, seeds)
    assert says in str(exc.value)


def test_a_variant_names_its_search_among_its_policy_options() -> None:
    trial = parse_variant('trial=topk:exponential{"search": "trial"}')
    assert trial.policy_options == {"search": "trial"}
    study = Study(CompareConfig(modes=("gravac",)), (trial,))
    assert study.jobs()[0].config.policy_options == {"search": "trial"}
    with pytest.raises(ValueError, match=r"^--variant x: .*search must be one of"):
        Study(
            CompareConfig(modes=("gravac",)), (parse_variant('x=topk:exponential{"search": "y"}'),)
        )


def test_variants_need_a_gravac_mode() -> None:
    with pytest.raises(ValueError, match=r"--variant needs a mode .*\(gravac, gravac-ddp\).*ddp"):
        Study(CompareConfig(modes=("ddp",)), (parse_variant("topk:exponential"),))


def test_study_lists_its_variants_as_written() -> None:
    variants = (
        parse_variant('cf100=topk:fixed{"cf": 100}'),
        parse_variant('noef=fp16:fixed{"cf": 2}:{"error_feedback": false}'),
    )
    listed = Study(CompareConfig(modes=("gravac",)), variants, (0, 1)).to_dict()
    assert listed["seeds"] == [0, 1]
    assert listed["variants"] == [
        {
            "label": "cf100",
            "compressor": "topk",
            "compressor_options": {},
            "policy": "fixed",
            "policy_options": {"cf": 100},
            "engine_options": {},
            "spec": 'cf100=topk:fixed{"cf": 100}',
        },
        {
            "label": "noef",
            "compressor": "fp16",
            "compressor_options": {},
            "policy": "fixed",
            "policy_options": {"cf": 2},
            "engine_options": {"error_feedback": False},
            "spec": 'noef=fp16:fixed{"cf": 2}:{"error_feedback": false}',
        },
    ]


def test_a_variant_s_engine_options_replace_the_configuration_s_in_its_jobs() -> None:
    cfg = CompareConfig(modes=("gravac",), engine_options={"window": 5})
    variants = (
        parse_variant("topk:exponential"),
        parse_variant('e=topk:exponential:{"epsilon": 0.3}'),
    )
    jobs = Study(cfg, variants).jobs()
    assert [j.config.engine_options for j in jobs] == [{}, {"epsilon": 0.3}]
    # without variants, the configuration's own are the one variant's
    (job,) = Study(cfg).jobs()
    assert job.config.engine_options == {"window": 5}
    assert job.variant is not None and job.variant.label == "topk-exponential-window5"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"speed": 1}, "--engine-options {'speed': 1} has no option 'speed'"),
        ({"nonfinite": "ignore"}, "nonfinite must be one of ('skip', 'raise'), got 'ignore'"),
        ({"window": 0}, "window must be"),
    ],
)
def test_engine_options_of_the_configuration_are_checked_before_any_worker(
    options: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError) as exc:
        Study(CompareConfig(modes=("gravac",), engine_options=options))
    assert says in str(exc.value)
