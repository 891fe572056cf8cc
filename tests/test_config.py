"""The config schema: defaults, coercion of CLI/TOML values, precedence, TOML loading, core settings."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from p2p_cocodc.algorithms.strategies import AlgoSettings
from p2p_cocodc.config.train import AUTO, TrainConfig, build_config, coerce, load_toml
from p2p_cocodc.errors import UserError

# ---- defaults ----


def test_defaults_validate() -> None:
    cfg = TrainConfig()
    assert cfg.validate() is cfg
    assert build_config({}, {}) == cfg
    settings = cfg.algo_settings()
    assert settings.algo == "cocodc" and settings.transmissions == cfg.fragments == 4


def test_simulate_with_no_options_is_the_quick_run_and_the_study_is_a_profile() -> None:
    """`p2p-cocodc simulate` alone, parsed as the command line parses it: the micro model, 4 workers,
    192 steps (minutes on 2 cores); profiles/study.toml is the long study the README names."""
    from p2p_cocodc.cli.main import _config_from, cli, simulate
    from p2p_cocodc.config.train import FIELDS

    # in the group's context, as the command line makes it: a context of its own would give simulate
    # click's default help options, and click keeps them (`simulate -h` would fail in later tests)
    params = simulate.make_context("simulate", [], parent=cli.make_context("p2p-cocodc", ["simulate"])).params
    quick = _config_from(params["config_path"], {k: v for k, v in params.items() if k in FIELDS})
    assert (quick.algo, quick.model, quick.workers, quick.steps, quick.eval_every) == (
        "cocodc",
        "micro",
        4,
        192,
        24,
    )
    study = _config_from(str(Path(__file__).parent.parent / "profiles" / "study.toml"), {"algo": "streaming"})
    assert (study.algo, study.model, study.workers, study.steps, study.eval_every) == (
        "streaming",
        "tiny",
        4,
        480,
        48,
    )


def test_cocodc_defaults_are_the_damped_rule() -> None:
    """--algo cocodc with no other option: λ0 1 and half the compensated jump (docs/convergence-bar-b.md),
    and the region profiles train with the same rule."""
    settings = build_config({}, {"algo": "cocodc"}).algo_settings()
    assert (settings.dc_rule, settings.dc_lambda, settings.dc_alpha) == ("tensor", 1.0, 0.5)
    for profile in sorted((Path(__file__).parent.parent / "peers").glob("*.toml")):
        rule = build_config(load_toml(profile), {}).algo_settings()
        assert (rule.dc_rule, rule.dc_lambda, rule.dc_alpha) == ("tensor", 1.0, 0.5), profile


def test_build_config_precedence() -> None:
    cfg = build_config({"seed": 3, "workers": 2, "algo": "streaming"}, {"seed": "9", "lr": "0.01"})
    assert cfg.seed == 9  # the command line beats the file
    assert cfg.workers == 2 and cfg.algo == "streaming"  # the file beats the defaults
    assert cfg.lr == 0.01  # command-line strings are coerced
    assert cfg.steps == TrainConfig().steps  # untouched: the default


def test_build_config_validates_the_merge() -> None:
    # a file value that is invalid on its own is fine once the command line fixes it ...
    assert build_config({"algo": "diloco", "overlap": 3}, {"overlap": "0"}).overlap == 0
    # ... and a valid file value can be made invalid by the command line
    with pytest.raises(UserError, match="--overlap 48 must be in"):
        build_config({"algo": "streaming"}, {"overlap": "48"})


def test_build_config_from_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'algo = "streaming"\ninner-steps = 8\nfragments = 2\noverlap = 2\nseed = 4\n', encoding="utf-8"
    )
    cfg = build_config(load_toml(path), {"seed": "11"})
    assert (cfg.algo, cfg.inner_steps, cfg.fragments, cfg.overlap, cfg.seed) == ("streaming", 8, 2, 2, 11)


# ---- coerce ----


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("workers", "4", 4),
        ("workers", 4, 4),
        ("workers", 3.0, 3),  # an integral TOML float
        ("alpha", "0.25", 0.25),
        ("alpha", 1, 1.0),
        ("latency_ms", "1e2", 100.0),
        ("dc_wd_debias", "yes", True),
        ("dc_wd_debias", "Off", False),
        ("dc_wd_debias", True, True),
        ("algo", "ddp", "ddp"),
        ("codec", "int8", "int8"),
        ("model", "nano", "nano"),
        ("transmissions", None, None),
        ("momentum_clip", None, None),
        ("step_time", "0.5", 0.5),
        ("overlap", "3", 3),
        ("transmissions", "2", 2),
    ],
)
def test_coerce_values(name: str, value: object, expected: object) -> None:
    got = coerce(name, value)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("workers", "four", "--workers must be int, got 'four'"),
        ("workers", 2.5, "--workers must be int, got 2.5"),
        ("workers", "2.0", "--workers must be int"),
        ("workers", True, "--workers must be int, got True"),
        ("workers", None, "--workers must be int, got None"),
        ("workers", [2], "--workers must be int"),
        ("seed", "", "--seed must be int"),
        ("alpha", "half", "--alpha must be float, got 'half'"),
        ("alpha", False, "--alpha must be float"),
        ("dc_wd_debias", "maybe", "--dc-wd-debias must be bool"),
        ("dc_wd_debias", 2, "--dc-wd-debias must be bool"),
        ("algo", "foo", "unknown --algo 'foo': use one of ddp, diloco, streaming, cocodc"),
        ("codec", "fp8", "unknown --codec 'fp8': use one of fp32, bf16, int8, fp4"),
        ("pattern", "random", "unknown --pattern 'random'"),
        ("tokenizer", "gpt2", "unknown --tokenizer 'gpt2'"),
        ("dc_rule", "global", "unknown --dc-rule 'global'"),
    ],
)
def test_coerce_errors(name: str, value: object, message: str) -> None:
    with pytest.raises(UserError) as info:
        coerce(name, value)
    assert message in str(info.value)


def test_coerce_nan_is_a_float_that_validate_rejects() -> None:
    assert math.isnan(coerce("alpha", "nan"))
    for name in ("alpha", "dc_lambda", "latency_ms", "outer_lr", "momentum_clip", "step_time"):
        with pytest.raises(UserError, match=f"--{name.replace('_', '-')} must be"):
            build_config({}, {name: "nan"})
    with pytest.raises(UserError, match="--bandwidth-mbps must be"):
        build_config({}, {"bandwidth_mbps": "inf"})
    with pytest.raises(UserError, match="--step-time must be a finite number"):
        build_config({}, {"step_time": "inf"})


# ---- 'auto' ----


@pytest.mark.parametrize("name", ["overlap", "transmissions"])
def test_auto_accepted_for_overlap_and_transmissions(name: str) -> None:
    assert coerce(name, "auto") == AUTO
    cfg = build_config({}, {name: "auto"})
    assert getattr(cfg, name) == AUTO
    assert build_config({name: coerce(name, "auto")}, {}) == cfg  # from a file too


@pytest.mark.parametrize(
    "name", ["workers", "steps", "inner_steps", "fragments", "alpha", "step_time", "seed"]
)
def test_auto_rejected_elsewhere(name: str) -> None:
    with pytest.raises(UserError, match=f"--{name.replace('_', '-')} must be") as info:
        coerce(name, "auto")
    assert "'auto'" in str(info.value) and "or 'auto'" not in str(info.value)


def test_overlap_error_mentions_auto() -> None:
    with pytest.raises(UserError, match=r"--overlap must be int or 'auto', got 'soon'"):
        coerce("overlap", "soon")


def test_auto_still_checks_the_rest_of_the_settings() -> None:
    with pytest.raises(UserError, match="diloco blocks on every sync") as info:
        build_config({}, {"algo": "diloco", "overlap": "2", "transmissions": "auto"})
    assert "--overlap" in str(info.value)
    with pytest.raises(UserError, match="streaming needs --inner-steps"):
        build_config({}, {"algo": "streaming", "overlap": "auto", "inner_steps": "10", "fragments": "4"})


# ---- validate ----


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"workers": "0"}, "--workers must be ≥ 1, got 0"),
        ({"steps": "-1"}, "--steps must be ≥ 1"),
        ({"eval_every": "0"}, "--eval-every must be ≥ 1"),
        ({"lr": "0"}, "--lr must be > 0"),
        ({"seed": "-1"}, "--seed must be ≥ 0"),
        ({"step_time": "0"}, "--step-time must be > 0"),
        ({"threads": "0"}, "--threads must be ≥ 1"),
        ({"overlap": "48"}, "--overlap 48 must be in [0, --inner-steps 48)"),
        ({"algo": "diloco", "overlap": "12"}, "use --overlap 0"),
        ({"algo": "ddp", "overlap": "auto"}, "ddp averages every step's gradients"),
        ({"transmissions": "0"}, "--transmissions 0 must be between 1 and --inner-steps 48"),
        ({"transmissions": "49"}, "--transmissions 49 must be between 1"),
        ({"alpha": "1.5"}, "--alpha must be in [0, 1]"),
        ({"dc_lambda": "-1"}, "--dc-lambda"),
        ({"outer_momentum": "1"}, "--outer-momentum in [0, 1)"),
        ({"momentum_clip": "0"}, "--momentum-clip must be > 0"),
        ({"algo": "streaming", "fragments": "5"}, "divisible by --fragments (5)"),
    ],
)
def test_validate_names_the_option(cli: dict[str, str], message: str) -> None:
    with pytest.raises(UserError) as info:
        build_config({}, cli)
    assert message in str(info.value)


def test_max_peers_cuts_the_data_and_must_cover_the_starting_peers() -> None:
    assert build_config({}, {"workers": "3"}).data_shards == 3  # default: one shard per starting peer
    cfg = build_config({}, {"workers": "3", "max_peers": "5"})
    assert cfg.data_shards == 5 and cfg.computing_options()["max_peers"] == 5
    with pytest.raises(UserError) as info:
        build_config({}, {"workers": "3", "max_peers": "2"})
    assert str(info.value) == (
        "--max-peers 2 must be ≥ --workers 3 (the peers that start the run): raise it, or leave it out"
    )


def test_validate_data_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(UserError, match=f"--data {missing}: no such file"):
        build_config({}, {"data": str(missing)})
    (tmp_path / "a.txt").write_text("text", encoding="utf-8")
    assert build_config({}, {"data": str(tmp_path / "a.txt")}).data == str(tmp_path / "a.txt")


# ---- load_toml ----


@pytest.mark.parametrize("key", ["inner-steps", "inner_steps"])
def test_load_toml_key_styles(tmp_path: Path, key: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        f'{key} = 8\ndc-wd-debias = true\nstep_time = 0.1\noverlap = "auto"\nmomentum-clip = 2\n',
        encoding="utf-8",
    )
    values = load_toml(path)
    assert values == {
        "inner_steps": 8,
        "dc_wd_debias": True,
        "step_time": 0.1,
        "overlap": AUTO,
        "momentum_clip": 2.0,
    }
    assert type(values["momentum_clip"]) is float


def test_load_toml_accepts_a_str_path(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('codec = "bf16"\n', encoding="utf-8")
    assert load_toml(str(path)) == {"codec": "bf16"}


def test_load_toml_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    with pytest.raises(UserError, match=f"--config {path}: no such file"):
        load_toml(path)


@pytest.mark.parametrize("text", [b"workers = [2,\n", b"workers = \n", b"[a\n", b"\xff\xfeworkers = 2\n"])
def test_load_toml_bad_toml(tmp_path: Path, text: bytes) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(text)
    with pytest.raises(UserError) as info:
        load_toml(path)
    message = str(info.value)
    assert message.startswith(f"--config {path} is not valid TOML")
    assert "fix the file" in message and "\n" not in message


@pytest.mark.parametrize("key", ["wrokers", "inner.steps", "section"])
def test_load_toml_unknown_key(tmp_path: Path, key: str) -> None:
    path = tmp_path / "typo.toml"
    body = "[section]\nworkers = 2\n" if key == "section" else f'workers = 2\n"{key}" = 3\n'
    path.write_text(body, encoding="utf-8")
    with pytest.raises(UserError) as info:
        load_toml(path)
    message = str(info.value)
    assert f"unknown key {key!r}" in message and str(path) in message
    assert "valid keys:" in message and "inner-steps" in message and "bandwidth-mbps" in message


def test_load_toml_bad_value_names_the_option(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('workers = "four"\n', encoding="utf-8")
    with pytest.raises(UserError, match="--workers must be int, got 'four'"):
        load_toml(path)
    path.write_text('codec = "fp8"\n', encoding="utf-8")
    with pytest.raises(UserError, match="unknown --codec 'fp8'"):
        load_toml(path)


def test_load_toml_nan_is_caught_by_validate(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("alpha = nan\n", encoding="utf-8")
    values = load_toml(path)
    with pytest.raises(UserError, match="--alpha must be a finite number"):
        build_config(values, {})


def test_load_toml_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="--config"):
        load_toml(tmp_path)


# ---- algo_settings / inner_settings ----


def test_algo_settings_maps_every_field() -> None:
    cfg = build_config(
        {},
        {
            "algo": "cocodc",
            "inner_steps": "16",
            "fragments": "2",
            "pattern": "sequential",
            "overlap": "3",
            "alpha": "0.3",
            "dc_lambda": "0.2",
            "dc_rule": "step",
            "dc_lambda_max": "4",
            "dc_wd_debias": "true",
            "outer_lr": "0.5",
            "outer_momentum": "0.8",
            "gap_penalty": "2",
            "momentum_clip": "1.5",
        },
    )
    s = cfg.algo_settings()
    assert isinstance(s, AlgoSettings)
    assert (s.algo, s.inner_steps, s.fragments, s.pattern, s.overlap) == ("cocodc", 16, 2, "sequential", 3)
    assert (s.alpha, s.dc_lambda, s.dc_rule, s.dc_lambda_max, s.dc_wd_debias) == (0.3, 0.2, "step", 4.0, True)
    assert s.transmissions == 2  # defaults to --fragments
    o = s.outer
    assert (o.lr, o.momentum, o.gap_penalty, o.momentum_clip) == (0.5, 0.8, 2.0, 1.5)


def test_algo_settings_transmissions() -> None:
    assert build_config({}, {"fragments": "3"}).algo_settings().transmissions == 3
    assert build_config({}, {"fragments": "3", "transmissions": "7"}).algo_settings().transmissions == 7


def test_algo_settings_resolves_auto() -> None:
    cfg = build_config({}, {"overlap": "auto", "transmissions": "auto"})
    s = cfg.algo_settings(overlap=5, transmissions=6)
    assert (s.overlap, s.transmissions) == (5, 6)
    with pytest.raises((UserError, ValueError)):
        cfg.algo_settings()  # 'auto' must be resolved before the core sees it
    # explicit numbers win over the config's own values
    assert TrainConfig().algo_settings(overlap=0).overlap == 0


@pytest.mark.parametrize(
    ("algo", "inner_steps", "tau"),
    [("ddp", 48, 0), ("diloco", 48, 0), ("streaming", 48, 12), ("cocodc", 8, 2)],
)
def test_each_algorithm_has_its_own_default_overlap(algo: str, inner_steps: int, tau: int) -> None:
    cfg = build_config({}, {"algo": algo, "inner_steps": str(inner_steps), "fragments": "2"})
    assert cfg.overlap is None and cfg.algo_settings().overlap == tau


def test_inner_settings() -> None:
    cfg = build_config(
        {}, {"lr": "0.002", "warmup": "7", "steps": "99", "weight_decay": "0.01", "grad_clip": "0"}
    )
    i = cfg.inner_settings()
    assert (i.lr, i.warmup, i.total_steps, i.weight_decay, i.grad_clip) == (0.002, 7, 99, 0.01, 0.0)


# ---- derived values: τ and N (config/derived.py) ----


def test_a_transfer_longer_than_h_steps_is_an_error_but_on_a_paced_link() -> None:
    """2 Mbit/s, 1 MB per sync, 0.1 s steps: 40 steps to hide a transfer against H = 24. The
    simulator (and a streaming peer) says what to change; a cocodc peer, whose swarm widens its send
    pace to what the link carries, takes τ = H − 1 and at least K sends per H, and trains."""
    from p2p_cocodc.config.derived import Link, sync_shape

    slow = Link([1_000_000], 0.0, 2e6, 0.1)
    with pytest.raises(UserError, match="a fragment transfer takes 4.00 s = 40 inner steps"):
        sync_shape("cocodc", 24, 2, AUTO, AUTO, slow)
    assert sync_shape("cocodc", 24, 2, AUTO, AUTO, replace(slow, paced=True)) == (23, 1)  # --pace fixed
    # a peer that asks for a pace: N = K = 2, not the 1 the declared link fits (slots every ⌊H/K⌋
    # steps, which the measured pace widens)
    assert sync_shape("cocodc", 24, 2, AUTO, AUTO, replace(slow, paced=True, asks_pace=True)) == (23, 2)
    fast = Link([1_000], 0.0, 2e9, 0.1)  # where the link fits more than K sends per H, that many
    assert sync_shape("cocodc", 24, 2, AUTO, AUTO, replace(fast, paced=True, asks_pace=True)) == sync_shape(
        "cocodc", 24, 2, AUTO, AUTO, fast
    )
    assert sync_shape("cocodc", 24, 2, AUTO, AUTO, fast)[1] > 2
    assert sync_shape("cocodc", 24, 2, AUTO, 2, replace(slow, paced=True, step_time=1.0)) == (4, 2)


def test_sync_shape_defaults() -> None:
    from p2p_cocodc.config.derived import sync_shape

    assert sync_shape("cocodc", 48, 4, None, None) == (12, 4)  # H/4, N = K
    assert sync_shape("streaming", 10, 2, None, None) == (2, 2)  # H/4 rounded down
    assert sync_shape("diloco", 48, 4, None, None) == (0, 4)  # blocking: no overlap
    assert sync_shape("ddp", 48, 4, None, 7) == (0, 7)
    assert sync_shape("cocodc", 48, 4, 3, 6) == (3, 6)  # given numbers as they are
    with pytest.raises(ValueError, match="'auto'"):
        sync_shape("cocodc", 48, 4, AUTO, None)  # 'auto' needs the link


def test_sync_shape_auto_from_the_link() -> None:
    """Transfers of 1.1 s and 3.1 s (0.1 s latency, 1 MB/s) at 0.5 s a step: the slowest hides
    behind τ = ⌈3.1 / 0.5⌉ = 7 steps; H = 48 steps (24 s) fit ⌊24 / 2.1⌋ = 11 transfers of the mean."""
    from p2p_cocodc.config.derived import Link, sync_shape

    link = Link(wire_bytes=[1_000_000, 3_000_000], latency_s=0.1, bandwidth_bps=8e6, step_time=0.5)
    assert sync_shape("cocodc", 48, 2, AUTO, AUTO, link) == (7, 11)
    assert sync_shape("cocodc", 48, 2, AUTO, None, link) == (7, 2)
    assert sync_shape("cocodc", 8, 2, None, AUTO, link) == (2, 1)  # never fewer than one send
    fast = Link([1000], 0.0, 1e9, 1.0)
    assert sync_shape("cocodc", 8, 2, AUTO, AUTO, fast) == (1, 8)  # never more than one per step
    with pytest.raises(UserError) as info:
        sync_shape("streaming", 6, 2, AUTO, None, link)
    assert str(info.value) == (
        "--overlap auto: a fragment transfer takes 3.10 s = 7 inner steps, not less than --inner-steps 6; "
        "raise --inner-steps, --fragments or --bandwidth-mbps, or pick a smaller --codec"
    )


def test_algo_settings_with_the_link_are_the_setups() -> None:
    """A peer's and the simulator's τ and N (``TrainingSetup.settings``, from the model's fragments
    and the codec's wire bytes) are ``TrainConfig.algo_settings`` with the link, for every algorithm."""
    import itertools

    from p2p_cocodc.algorithms.fragments import make_fragments
    from p2p_cocodc.config.derived import Link
    from p2p_cocodc.run.setup import TrainingSetup, allreduce_wire_bytes

    tiny = {"model": "nano", "tokenizer": "byte", "seq_len": "32", "batch_size": "4"}
    setup = TrainingSetup(build_config({}, tiny))
    cases = itertools.product(["ddp", "diloco", "streaming", "cocodc"], [None, "2", AUTO], [None, "3", AUTO])
    links = [(0.1, 5e7, 0.05), (0.0, 1e6, 0.3), (0.02, 1e9, 0.001), (0.5, 1e5, 0.01)]  # the last: τ ≥ H
    for (algo, tau, n), (latency, bandwidth, step_time) in itertools.product(cases, links):
        if algo in ("ddp", "diloco") and tau not in (None, "0"):
            continue
        setup.cfg = cfg = build_config({}, {**tiny, "algo": algo, "overlap": tau, "transmissions": n})
        units = (
            make_fragments(setup.base, cfg.fragments, cfg.pattern) if algo in ("streaming", "cocodc") else []
        )
        sizes = [u.numel for u in units] or [setup.num_params]
        link = Link(
            [allreduce_wire_bytes(setup.codec, s, cfg.workers) for s in sizes], latency, bandwidth, step_time
        )
        try:
            expected: object = setup.settings(latency, bandwidth, step_time)
        except UserError as exc:
            expected = str(exc)
        try:
            got: object = cfg.algo_settings(link=link)
        except UserError as exc:
            got = str(exc)
        assert got == expected, (algo, tau, n, latency, bandwidth, step_time)


def test_the_paced_codec_is_q2_where_it_is_coarser_and_never_silently_finer() -> None:
    """--paced-codec auto gives q2 to a cocodc swarm whose --codec sends more bytes than q2, with
    error feedback, which q2 needs; elsewhere the syncs keep --codec. An explicit one is for cocodc
    only and must send fewer bytes than --codec."""
    from p2p_cocodc.algorithms.codecs import get_codec
    from p2p_cocodc.names import DEFAULT_TOPK, FINER_THAN_Q2
    from p2p_cocodc.run.setup import sync_codecs

    def paced(**options: object) -> str | None:
        return build_config({}, {"algo": "cocodc", **options}).paced_wire_codec

    assert paced() == "q2" and paced(codec="fp32") == "q2"
    assert paced(codec="q2") is None and paced(codec="topk2") is None and paced(error_feedback=False) is None
    assert paced(paced_codec="same") is None and paced(paced_codec="topk2") == "topk2"
    assert build_config({}, {"algo": "streaming"}).paced_wire_codec is None
    for members in (2, 3, 8):  # FINER_THAN_Q2 is what it says (a top-k round's size depends on k and M)
        q2 = get_codec("q2").round_bytes(1 << 16, members)
        assert all(get_codec(name).round_bytes(1 << 16, members) > q2 for name in FINER_THAN_Q2)
    with pytest.raises(UserError, match="--paced-codec applies to cocodc"):
        build_config({}, {"algo": "diloco", "paced_codec": "q2"})
    with pytest.raises(UserError, match="--paced-codec q2 is too coarse without error feedback"):
        build_config({}, {"algo": "cocodc", "paced_codec": "q2", "error_feedback": False})
    with pytest.raises(UserError, match="--paced-codec int8 sends as many bytes as --codec fp4 or more"):
        sync_codecs(get_codec("fp4"), "int8", DEFAULT_TOPK, True)
    codecs = sync_codecs(get_codec("fp4"), "q2", DEFAULT_TOPK, True)
    assert (codecs.at(False).name, codecs.at(True).name) == ("fp4", "q2")
