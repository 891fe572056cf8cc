"""The ``p2p-cocodc`` command line, run for real as ``python -m p2p_cocodc`` in a subprocess, or through
the same entry point in this process (``run_here``) where the process is not what a test checks: the
other algorithms' runs beside cocodc's two processes, and the refused values.

Tiny settings keep each run to a few seconds; ``--threads 1`` keeps a shared 2-core machine from
turning torch's thread pool into a spin-wait (and makes the hashes independent of the core count).
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.swarm_procs import records, run_here
from tests.tiny_options import TINY_MODEL

TINY = [
    *TINY_MODEL,
    "--workers",
    "2",
    "--steps",
    "24",
    "--inner-steps",
    "8",
    "--fragments",
    "2",
    "--eval-every",
    "8",
    "--eval-batches",
    "2",
    "--step-time",
    "0.05",
    "--threads",
    "1",
    "--quiet",
]
# each algorithm's default τ, which the runs below leave to the CLI: H/4 (H = 8) or 0 for the blocking ones
OVERLAP = {"ddp": 0, "diloco": 0, "streaming": 2, "cocodc": 2}
EVAL_KEYS = {"kind", "step", "sim_time_s", "val_loss", "val_ppl", "bytes_sent", "stall_s"}
SUMMARY_KEYS = {
    "kind",
    "algo",
    "final_val_ppl",
    "initial_val_ppl",
    "bytes_sent",
    "stall_s",
    "sim_time_s",
    "global_params_sha256",
    "config",
}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One token cache for every run of this file, never ~/.cache."""
    return {
        **os.environ,
        "P2P_COCODC_CACHE": str(tmp_path_factory.mktemp("cache")),
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def cli(env: dict[str, str], *args: Any, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "p2p_cocodc", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def simulate(env: dict[str, str], algo: str, out: Path, *extra: Any) -> subprocess.CompletedProcess[str]:
    return cli(env, "simulate", "--algo", algo, *TINY, "--out", out, *extra)


def in_parallel(jobs: dict[str, list[Any]], env: dict[str, str]) -> dict[str, Any]:
    """Run the commands two at a time (the machine has two cores); results by key."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(cli, env, *args) for key, args in jobs.items()}
        return {key: f.result() for key, f in futures.items()}


def assert_one_error_line(proc: subprocess.CompletedProcess[str], *names: str) -> str:
    """Exit 2, no traceback, exactly one non-empty stderr line 'error: …' naming what to fix."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def runs(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One finished run per algorithm, plus a rerun of cocodc and one with another seed. cocodc and its
    rerun are processes of their own, the others run in this process meanwhile (``run_here``: the
    folder and environment it sets for them meanwhile mean nothing to the processes, whose paths and
    environment are given in full)."""
    folder = tmp_path_factory.mktemp("runs")
    extra = {"again": [], "seed1": ["--seed", "1"]}
    outs = {key: folder / f"{key}.jsonl" for key in [*OVERLAP, *extra]}
    jobs = {algo: ["simulate", "--algo", algo, *TINY, "--out", str(outs[algo])] for algo in OVERLAP}
    jobs.update({key: [*jobs["cocodc"][:-1], str(outs[key]), *args] for key, args in extra.items()})
    with ThreadPoolExecutor(max_workers=1) as pool:
        processes = {key: pool.submit(cli, env, *jobs[key]) for key in ("cocodc", "again")}
        cache = {"P2P_COCODC_CACHE": env["P2P_COCODC_CACHE"]}
        procs = {key: run_here(args, folder, cache) for key, args in jobs.items() if key not in processes}
        procs |= {key: future.result() for key, future in processes.items()}
    return {key: (procs[key], outs[key]) for key in jobs}


# ---- simulate, end to end ----


@pytest.mark.parametrize("algo", list(OVERLAP))
def test_simulate_end_to_end(runs: dict[str, Any], algo: str) -> None:
    proc, out = runs[algo]
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"{algo}: 2 workers" in proc.stderr  # the header line
    assert "final val ppl" in proc.stdout

    recs = records(out)
    evals, summary = recs[:-1], recs[-1]
    assert summary["overlap"] == OVERLAP[algo]  # no --overlap given: the algorithm's own default
    assert [r["kind"] for r in evals] == ["eval"] * 4
    assert [r["step"] for r in evals] == [0, 8, 16, 24]
    for r in evals:
        assert EVAL_KEYS <= r.keys(), EVAL_KEYS - r.keys()

    assert summary["kind"] == "summary"
    assert SUMMARY_KEYS <= summary.keys(), SUMMARY_KEYS - summary.keys()
    assert summary["algo"] == algo
    assert re.fullmatch(r"[0-9a-f]{64}", summary["global_params_sha256"])

    ppl = [r["val_ppl"] for r in evals]
    assert ppl[-1] < ppl[0], ppl
    assert summary["final_val_ppl"] == ppl[-1]
    assert summary["initial_val_ppl"] == ppl[0]

    sent = [r["bytes_sent"] for r in evals]
    assert sent[0] == 0
    assert sent[-1] > 0
    assert sent == sorted(sent), sent
    assert summary["bytes_sent"] == sent[-1]
    clock = [r["sim_time_s"] for r in evals]
    assert clock == sorted(clock) and clock[-1] >= 24 * 0.05, clock
    assert summary["stall_s"] >= 0


def test_ddp_and_diloco_stall_for_every_transfer(runs: dict[str, Any]) -> None:
    """Blocking algorithms wait for every transfer; overlapping ones hide part of it."""
    summaries = {algo: records(out)[-1] for algo, (_, out) in runs.items()}
    for algo in ("ddp", "diloco"):
        assert summaries[algo]["stall_s"] > 0
        assert summaries[algo]["sim_time_s"] == pytest.approx(24 * 0.05 + summaries[algo]["stall_s"])
    for algo in ("streaming", "cocodc"):
        assert summaries[algo]["stall_s"] < summaries["diloco"]["stall_s"]


# ---- determinism and the parameter fingerprint ----


def test_same_command_same_hash_other_seed_other_hash(runs: dict[str, Any]) -> None:
    for key in ("cocodc", "again", "seed1"):
        assert runs[key][0].returncode == 0, runs[key][0].stderr
    first, second, reseeded = (records(runs[key][1]) for key in ("cocodc", "again", "seed1"))

    assert second[-1]["global_params_sha256"] == first[-1]["global_params_sha256"]
    assert [r["val_loss"] for r in second[:-1]] == [r["val_loss"] for r in first[:-1]]
    assert reseeded[-1]["config"]["seed"] == 1
    assert reseeded[-1]["global_params_sha256"] != first[-1]["global_params_sha256"]


def test_hash_is_sha256_of_global_params_as_float32_le(runs: dict[str, Any]) -> None:
    """Recompute the fingerprint by hand from an in-process run of the same config."""
    import torch

    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation

    summary = records(runs["streaming"][1])[-1]
    cfg = build_config({}, {**summary["config"], "out": None})
    sim = Simulation(cfg)
    assert sim.run(RunLog(None))["global_params_sha256"] == summary["global_params_sha256"]
    state = sim.global_state()
    assert list(state) == list(sim.eval_model.state_dict())
    digest = hashlib.sha256()
    for tensor in state.values():
        digest.update(tensor.detach().to(torch.float32).numpy().astype("<f4").tobytes())
    assert digest.hexdigest() == summary["global_params_sha256"]


# ---- --config ----


@pytest.fixture(scope="module")
def config_runs(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same file with `inner-steps` and with `inner_steps`; the command line overrides two keys."""
    folder = tmp_path_factory.mktemp("config")
    jobs, outs = {}, {}
    for key in ("inner-steps", "inner_steps"):
        config = folder / f"{key}.toml"
        config.write_text(
            'algo = "streaming"\nmodel = "nano"\ntokenizer = "byte"\nseq-len = 32\nbatch_size = 4\n'
            f"workers = 2\nsteps = 8\n{key} = 4\nfragments = 2\noverlap = 1\neval-every = 4\n"
            'eval_batches = 2\nstep-time = 0.05\nthreads = 1\nseed = 5\ncodec = "bf16"\n',
            encoding="utf-8",
        )
        outs[key] = folder / f"{key}.jsonl"
        jobs[key] = [
            "simulate",
            "--config",
            config,
            "--seed",
            "7",
            "--codec",
            "int8",
            "--quiet",
            "--out",
            outs[key],
        ]
    procs = in_parallel(jobs, env)
    return {key: (procs[key], outs[key]) for key in jobs}


@pytest.mark.parametrize("key", ["inner-steps", "inner_steps"])
def test_config_file_is_used_and_cli_overrides_it(config_runs: dict[str, Any], key: str) -> None:
    proc, out = config_runs[key]
    assert proc.returncode == 0, proc.stderr
    recs = records(out)
    summary = recs[-1]
    assert summary["config"]["inner_steps"] == 4  # from the file (default is 48)
    assert summary["config"]["algo"] == summary["algo"] == "streaming"
    assert summary["config"]["model"] == "nano"
    assert summary["config"]["batch_size"] == 4 and summary["config"]["seq_len"] == 32
    assert summary["config"]["seed"] == 7  # the command line wins over the file's 5
    assert summary["config"]["codec"] == "int8"  # and over its bf16
    assert [r["step"] for r in recs[:-1]] == [0, 4, 8]


# ---- compare ----


def test_compare_table_and_plot(runs: dict[str, Any], env: dict[str, str], tmp_path: Path) -> None:
    named = {"alpha": "diloco", "beta": "cocodc"}
    for name, algo in named.items():
        (tmp_path / f"{name}.jsonl").write_bytes(runs[algo][1].read_bytes())
    plot = tmp_path / "plots" / "ppl.png"
    proc = cli(env, "compare", tmp_path / "alpha.jsonl", tmp_path / "beta.jsonl", "--plot", plot)
    assert proc.returncode == 0, proc.stderr
    assert "final ppl" in proc.stdout and "MB sent" in proc.stdout
    worst = max(records(runs[algo][1])[-1]["final_val_ppl"] for algo in named.values())
    assert f"steps→{worst:.2f}" in proc.stdout  # default target: the worst final perplexity
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines() if line.split()}
    for name, algo in named.items():
        summary = records(runs[algo][1])[-1]
        row = rows[name]
        assert row[1] == algo
        assert float(row[2]) == pytest.approx(summary["final_val_ppl"], abs=1e-3)
        assert 0 < float(row[3]) <= 24  # both runs reach the worst final perplexity
        assert row[5] == "simulated"  # the clock of the time column
        assert float(row[6]) == pytest.approx(summary["bytes_sent"] / 1e6, abs=0.01)
    data = plot.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_compare_unreachable_target(runs: dict[str, Any], env: dict[str, str]) -> None:
    proc = cli(env, "compare", runs["ddp"][1], "--target-ppl", "1.0")
    assert proc.returncode == 0, proc.stderr
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("ddp"))
    assert row[3] == row[4] == "—"


# ---- bad input: one 'error:' line, exit 2, never a traceback ----

SIMULATE = ["simulate", "--algo", "cocodc", *TINY, "--overlap", "2"]
BAD_INPUTS = {  # id: (arguments, what the error line must name); {name} is a file of bad_files
    "overlap>=H": (["--overlap", "8"], ["--overlap", "--inner-steps"]),
    "fragments>units": (["--fragments", "5"], ["--fragments", "4 units"]),
    "fragments9": (["--fragments", "9"], ["--fragments"]),
    "algo": (["--algo", "foo"], ["--algo", "foo"]),
    "codec": (["--codec", "fp8"], ["--codec", "fp8"]),
    "data-missing": (["--data", "{missing}"], ["--data", "{missing}"]),
    "data-empty": (["--data", "{empty}"], ["{empty}"]),
    "data-not-utf8": (["--data", "{latin1}"], ["{latin1}", "UTF-8"]),
    "config-broken": (["--config", "{broken}"], ["--config", "{broken}", "TOML"]),
    "config-unknown-key": (["--config", "{unknown}"], ["{unknown}", "wrokers"]),
    "workers-four": (["--workers", "four"], ["--workers", "four"]),
    "workers-0": (["--workers", "0"], ["--workers"]),
    "alpha-nan": (["--alpha", "nan"], ["--alpha"]),
    "transmissions-0": (["--transmissions", "0"], ["--transmissions"]),
    "diloco-overlap": (["--algo", "diloco", "--overlap", "2"], ["--overlap"]),
    "ddp-overlap": (["--algo", "ddp", "--overlap", "2"], ["--overlap 2", "ddp"]),
    "seq-len-huge": (["--seq-len", "100000000"], ["--seq-len", "65536"]),
    "factory-fails": (["--model", "os:system"], ["os:system", "factory(vocab_size=", "TypeError"]),
}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("bad")
    files = {name: folder / name for name in ("empty.txt", "latin1.txt", "broken.toml", "unknown.toml")}
    files["empty.txt"].write_bytes(b"")
    files["latin1.txt"].write_bytes(("Fellow citizens of the Senate.\n\n" * 50).encode() + b"caf\xe9 \xff\n")
    files["broken.toml"].write_text("workers = [2,\nalgo = \n", encoding="utf-8")
    files["unknown.toml"].write_text("workers = 2\nwrokers = 3\n", encoding="utf-8")
    named = {name.split(".")[0]: str(path) for name, path in files.items()}
    return {**named, "missing": str(folder / "nowhere.txt"), "notjson": str(folder / "notes.jsonl")}


@pytest.fixture(scope="module")
def bad_runs(
    env: dict[str, str], bad_files: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The bad values run in this process (``run_here``: what is checked is the command's answer, and
    a process each would cost seconds of imports); the usage error in a process of its own."""
    jobs = {key: [a.format(**bad_files) for a in [*SIMULATE, *args]] for key, (args, _) in BAD_INPUTS.items()}
    Path(bad_files["notjson"]).write_text("this is not json\n", encoding="utf-8")
    jobs["compare-notjson"] = ["compare", bad_files["notjson"]]
    jobs["out-full"] = [*SIMULATE, "--out", "/dev/full"]
    here, cache = tmp_path_factory.mktemp("bad-runs"), {"P2P_COCODC_CACHE": env["P2P_COCODC_CACHE"]}
    return {key: run_here(args, here, cache) for key, args in jobs.items()} | {
        "usage": cli(env, "simulate", "--wokers", "2")
    }


@pytest.mark.parametrize(
    "key",
    list(BAD_INPUTS),
)
def test_bad_input_is_one_error_line(bad_runs: dict[str, Any], bad_files: dict[str, str], key: str) -> None:
    proc = bad_runs[key]
    assert_one_error_line(proc, *(name.format(**bad_files) for name in BAD_INPUTS[key][1]))
    assert proc.stdout == ""


def test_compare_rejects_a_file_that_is_not_json(bad_runs: dict[str, Any], bad_files: dict[str, str]) -> None:
    assert_one_error_line(bad_runs["compare-notjson"], bad_files["notjson"] + ":1", "not a JSON record")


def test_a_full_disk_under_out_is_one_error_line_at_the_end(bad_runs: dict[str, Any]) -> None:
    proc = bad_runs["out-full"]  # /dev/full opens, and every write fails with ENOSPC
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "error: --out /dev/full: cannot write it (No space left on device)"
    )
    assert "final val ppl" not in proc.stdout


def test_click_usage_error_has_no_traceback(bad_runs: dict[str, Any]) -> None:
    proc = bad_runs["usage"]
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "Error: No such option '--wokers'" in proc.stderr


def test_every_config_field_is_an_option() -> None:
    from p2p_cocodc.cli.main import simulate as command
    from p2p_cocodc.config.train import FIELDS

    options = {p.name: p.opts for p in command.params}
    for name in FIELDS:
        assert options[name][0] == "--" + name.replace("_", "-")
    assert options["config_path"] == ["--config"]


# ---- bad output paths and partial run files, in process ----


def test_out_that_is_a_folder(tmp_path: Path) -> None:
    from p2p_cocodc.errors import UserError
    from p2p_cocodc.run.records import RunLog

    with pytest.raises(UserError, match="--out"):
        RunLog(str(tmp_path))


def test_compare_records_without_fields(tmp_path: Path) -> None:
    from p2p_cocodc.errors import UserError
    from p2p_cocodc.ops.compare import compare_runs

    bad = tmp_path / "partial.jsonl"
    bad.write_text('{"kind": "eval", "step": 0}\n{"kind": "summary"}\n', encoding="utf-8")
    with pytest.raises(UserError, match="partial.jsonl"):
        compare_runs([str(bad)], None, None)


def test_compare_runs_with_the_same_file_name(runs: dict[str, Any], tmp_path: Path) -> None:
    from p2p_cocodc.ops.compare import compare_runs

    paths = []
    for sub, algo in (("a", "diloco"), ("b", "cocodc")):
        (tmp_path / sub).mkdir()
        paths.append(tmp_path / sub / "run.jsonl")
        paths[-1].write_bytes(runs[algo][1].read_bytes())
    table = compare_runs([str(p) for p in paths], None, None)
    assert "diloco" in table and "cocodc" in table


def test_plot_is_written_where_asked(runs: dict[str, Any], tmp_path: Path) -> None:
    from p2p_cocodc.ops.compare import compare_runs

    plot = tmp_path / "ppl"
    assert f"plot written to {plot}" in compare_runs([str(runs["ddp"][1])], None, str(plot))
    assert plot.read_bytes().startswith(PNG_MAGIC)


def test_help_lists_every_choice_without_importing_torch(env: dict[str, str]) -> None:
    """`--help` must answer at once: the CLI module and its option choices do not pull in torch."""
    from p2p_cocodc.algorithms.codecs import CODECS
    from p2p_cocodc.names import CODEC_NAMES

    assert tuple(CODECS) == CODEC_NAMES
    probe = "import sys, p2p_cocodc.cli.main; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    help_text = subprocess.run(
        [sys.executable, "-m", "p2p_cocodc", "simulate", "--help"], capture_output=True, text=True, env=env
    ).stdout
    assert "[fp32|bf16|int8|fp4|q2|q1|topk2|topk4]" in help_text
    assert "[ddp|diloco|streaming|cocodc]" in help_text


# ---- conventions shared by every command ----


def command_helps() -> dict[str, str]:
    """Every command's --help, in-process (click's runner: no subprocess per command)."""
    from click.testing import CliRunner

    from p2p_cocodc.cli.main import cli as group

    runner = CliRunner()
    helps = {}
    for name in group.commands:
        result = runner.invoke(group, [name, "--help"], prog_name="p2p-cocodc")
        assert result.exit_code == 0, result.output
        short = runner.invoke(group, [name, "-h"], prog_name="p2p-cocodc")
        assert short.output == result.output, name
        helps[name] = result.output
    return helps


def test_every_command_states_defaults_once_and_names_types_alike() -> None:
    helps = command_helps()
    assert {"simulate", "join", "demo", "bootstrap", "compare", "keygen"} <= helps.keys()
    for name, text in helps.items():
        flat = " ".join(text.split())
        assert "(default" not in flat and "[default: None]" not in flat, (name, flat)
        assert flat.count("[default:") == len(re.findall(r"\[default: [^\]]+\]", flat)), name
        for metavar in re.findall(r"--[a-z-]+ ([A-Z][A-Z_/|a-z]*)", text):
            assert metavar not in ("STR", "INT", "PATH_OR_NAME"), (name, metavar)
    assert "--events" in helps["simulate"] and "--events" not in helps["join"]  # the simulator's own
    assert "--out FILE" in helps["simulate"] and "--checkpoint-dir DIR" in helps["join"]
    assert "--workers" in helps["demo"] and "--peers " not in helps["demo"]  # one name everywhere
    from click.testing import CliRunner

    from p2p_cocodc.cli.main import cli as group

    assert "P2P_COCODC_<COMMAND>_<OPTION>" in " ".join(CliRunner().invoke(group, ["-h"]).output.split())


def test_options_come_from_the_environment_between_the_profile_and_the_command_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    profile = tmp_path / "run.toml"
    profile.write_text("workers = 2\nseq-len = 0\n")
    from_env = {**env, "P2P_COCODC_SIMULATE_SEQ_LEN": "-3"}
    # the environment wins over the profile...
    assert_one_error_line(cli(from_env, "simulate", "--config", profile), "--seq-len must be ≥ 1, got -3")
    # ...and the command line over the environment
    proc = cli(from_env, "simulate", "--config", profile, "--seq-len", "-5")
    assert_one_error_line(proc, "--seq-len must be ≥ 1, got -5")
    flags = {**env, "P2P_COCODC_SIMULATE_ALGO": "diloco", "P2P_COCODC_SIMULATE_OVERLAP": "3"}
    assert_one_error_line(cli(flags, "simulate"), "diloco blocks on every sync")


def test_compare_says_which_plot_path_it_cannot_write(runs: dict[str, Any], env: dict[str, str]) -> None:
    proc = cli(env, "compare", runs["cocodc"][1], "--plot", "/proc/no/plot.png")
    assert_one_error_line(proc, "--plot /proc/no/plot.png", "cannot write it")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["bootstrap", "--announce", "???", "--port", "31999"],
            "--announce '???' is not an IP address or host name",
        ),
        (["bootstrap", "--host", "1.2.3.456"], "--host '1.2.3.456' is not a valid IP address"),
        (
            ["join", "--bootstrap", "127.0.0.1:9", "--announce", "a b", "--port", "31999"],
            "--announce 'a b' is not",
        ),
        (["join", "--bootstrap", "127.0.0.1:9", "--host", "::zz"], "--host '::zz' is not a valid IP address"),
    ],
)
def test_a_bad_address_is_one_line_before_anything_starts(
    env: dict[str, str], tmp_path: Path, args: list[str], message: str
) -> None:
    """hivemind's daemon fails on such an address in a child process and leaves its parent waiting
    (a hang): it is refused before any DHT, model or data is set up."""
    proc = subprocess.run(
        [sys.executable, "-m", "p2p_cocodc", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "XDG_STATE_HOME": str(tmp_path / "state")},
    )
    assert_one_error_line(proc, message)
    assert not (tmp_path / "bootstrap.id").exists() and not (tmp_path / "state").exists()


# ---- join's and bootstrap's own options: one schema, like the training options ----

# a good value of every option (as a TOML value; the command line and the environment get its text)
# and the value the options class then holds
GOOD = {
    "join": {
        "bootstrap": ("203.0.113.10:31338", "203.0.113.10:31338"),
        "run_id": ("r1", "r1"),
        "host": ("0.0.0.0", "0.0.0.0"),
        "port": (4101, 4101),
        "announce": ("203.0.113.20", "203.0.113.20"),
        "shard": ("1/3", (1, 3)),
        "identity": ("peer.id", "peer.id"),
        "swarm_key_file": ("swarm.key", "swarm.key"),
        "owner": ("QmOwner", "QmOwner"),
        "certificate": ("peer.cert", "peer.cert"),
        "wait_peers": (5.5, 5.5),
        "round_timeout": (7.25, 7.25),
        "pace": ("fixed", "fixed"),
        "region_parallel": ("fsdp", "fsdp"),
        "min_step_time": (0.05, 0.05),
        "region": ("eu-west", "eu-west"),
        "metrics_port": (9101, 9101),
    },
    "bootstrap": {
        "identity": ("boot.id", "boot.id"),
        "host": ("0.0.0.0", "0.0.0.0"),
        "port": (31500, 31500),
        "announce": ("203.0.113.10", "203.0.113.10"),
        "address_file": ("boot.json", "boot.json"),
        "state_dir": ("state", "state"),
        "status_host": ("0.0.0.0", "0.0.0.0"),
        "status_port": (31501, 31501),
        "refresh": (0.5, 0.5),
        "swarm_key_file": ("swarm.key", "swarm.key"),
        "owner": ("QmOwner", "QmOwner"),
        "metrics_port": (9102, 9102),
    },
}
# a bad value of every option that has one, and what the error line must say; the others take any
# text (files are read, and the bootstrap dialled, once the peer starts: `join --check` tries them)
BAD = {
    "join": {
        "run_id": ("a b", "--run-id 'a b'"),
        "host": ("::zz", "--host '::zz'"),
        "port": ("x", "--port must be int, got 'x'"),
        "announce": ("a b", "--announce 'a b'"),
        "shard": ("1-3", "--shard '1-3'"),
        "wait_peers": ("0", "--wait-peers must be > 0"),
        "round_timeout": ("-1", "--round-timeout must be > 0"),
        "pace": ("slow", "unknown --pace 'slow'"),
        "region_parallel": ("zero3", "unknown --region-parallel 'zero3'"),
        "min_step_time": ("-1", "--min-step-time -1.0: use 0 to 3600 seconds"),
        "region": ("a b", "--region 'a b'"),
        "metrics_port": ("4100", "--port and --metrics-port are both 4100"),
    },
    "bootstrap": {
        "identity": (".", "--identity . is a directory"),
        "host": ("1.2.3.456", "--host '1.2.3.456'"),
        "port": ("70000", "--port must be in [0, 65535]"),
        "announce": ("???", "--announce '???'"),
        "address_file": (".", "--address-file . is a directory"),
        "state_dir": ("/dev/null", "--state-dir /dev/null is a file, not a folder"),
        "status_port": ("x", "--status-port must be int, got 'x'"),
        "refresh": ("0", "--refresh must be in [0.1, 3600]"),
        "metrics_port": ("31337", "--port and --metrics-port are both 31337"),
    },
}
ANY_TEXT = {
    "join": {"bootstrap", "identity", "swarm_key_file", "owner", "certificate"},
    "bootstrap": {"status_host", "swarm_key_file", "owner"},
}
# what every join below gives besides the option under test (--announce needs a fixed --port)
JOIN_BASE = {"bootstrap": "127.0.0.1:31338", "port": "4100"}


def schema_of(command: str) -> Any:
    from p2p_cocodc.config.bootstrap import BOOTSTRAP
    from p2p_cocodc.config.join import SWARM

    return {"join": SWARM, "bootstrap": BOOTSTRAP}[command]


def built_options(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    command: str,
    args: list[str],
    environ: dict[str, str] | None = None,
    toml: str | None = None,
) -> Any:
    """The options class ``command`` builds from ``args``, the environment and a --config file
    holding ``toml``, in process; what stops it is returned instead (a UserError)."""
    from click.testing import CliRunner

    import p2p_cocodc.cli.main as cli_main
    import p2p_cocodc.ops.bootstrap as ops_bootstrap
    from p2p_cocodc.errors import UserError

    built = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_main, "preflight", lambda cfg, opts: built.append(opts) or 0)
    monkeypatch.setattr(ops_bootstrap, "run_bootstrap", lambda opts: built.append(opts.validate()) and 0)
    if toml is not None:
        (tmp_path / "options.toml").write_text(toml, encoding="utf-8")
        args = [*args, "--config", "options.toml"]
    check = ["--check"] if command == "join" else []
    result = CliRunner().invoke(cli_main.cli, [command, *check, *args], env=environ)
    if isinstance(result.exception, UserError):
        return result.exception
    assert result.exit_code == 0 and len(built) == 1, (result.output, result.exception)
    return built[0]


def option_cases(table: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    return [(command, key) for command, keys in table.items() for key in keys]


@pytest.mark.parametrize("command", ["join", "bootstrap"])
def test_every_option_of_join_and_bootstrap_is_declared_in_the_schema(command: str) -> None:
    """The tables above cover every option; the command's own flags are the schema's and these alone."""
    import click

    from p2p_cocodc.cli.main import cli as group
    from p2p_cocodc.config.train import FIELDS

    schema = schema_of(command)
    assert set(GOOD[command]) == set(schema.fields)
    assert set(BAD[command]) | ANY_TEXT[command] == set(schema.fields)
    assert not set(BAD[command]) & ANY_TEXT[command]
    own = {p.name for p in group.commands[command].params if isinstance(p, click.Option)}
    own -= {"config_path", "help", "check", "quiet", "verbose", *FIELDS}
    assert own == set(schema.fields)


@pytest.mark.parametrize(("command", "key"), option_cases(GOOD))
def test_every_option_of_join_and_bootstrap_is_in_help_with_its_default(command: str, key: str) -> None:
    import click
    from click.testing import CliRunner

    from p2p_cocodc.cli.main import cli as group

    schema = schema_of(command)
    text = " ".join(CliRunner().invoke(group, [command, "--help"], terminal_width=200).output.split())
    param = next(p for p in group.commands[command].params if p.name == key)
    names, help_text = param.get_help_record(click.Context(group.commands[command]))
    assert names == f"{schema.flag(key)} {schema.metavar(key)}"
    assert " ".join(f"{names} {help_text}".split()) in text
    meta = schema.fields[key].metadata
    if schema.required(key):
        assert "[default:" not in help_text
    else:
        assert help_text == f"{meta['help']}  [default: {meta['shown']}]"


@pytest.mark.parametrize("source", ["command line", "environment", "TOML"])
@pytest.mark.parametrize(("command", "key"), option_cases(GOOD))
def test_every_option_of_join_and_bootstrap_comes_from_each_source(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, key: str, source: str
) -> None:
    """The command line, P2P_COCODC_<COMMAND>_<OPTION>, and a --config file: join's [swarm] table,
    the bootstrap's own keys (with dashes)."""
    schema = schema_of(command)
    value, expected = GOOD[command][key]
    base = {k: v for k, v in JOIN_BASE.items() if k != key} if command == "join" else {}
    args = [a for k, v in base.items() for a in (schema.flag(k), v)]
    environ, toml = None, None
    if source == "command line":
        args += [schema.flag(key), str(value)]
    elif source == "environment":
        environ = {f"P2P_COCODC_{command.upper()}_{key.upper()}": str(value)}
    else:
        table = "[swarm]\n" if command == "join" else ""
        toml = f"{table}{schema.flag(key)[2:]} = {value!r}\n".replace("'", '"')
    opts = built_options(monkeypatch, tmp_path, command, args, environ, toml)
    assert getattr(opts, schema.fields[key].name) == expected


@pytest.mark.parametrize(("command", "key"), option_cases(BAD))
def test_a_bad_join_or_bootstrap_option_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str, key: str
) -> None:
    from p2p_cocodc.errors import UserError

    schema = schema_of(command)
    value, message = BAD[command][key]
    base = {k: v for k, v in JOIN_BASE.items() if k != key} if command == "join" else {}
    args = [a for k, v in {**base, key: value}.items() for a in (schema.flag(k), v)]
    error = built_options(monkeypatch, tmp_path, command, args)
    assert isinstance(error, UserError), error
    assert "\n" not in str(error) and message in str(error) and schema.flag(key) in str(error)


def test_the_command_line_beats_the_environment_and_the_environment_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    toml = "[swarm]\nbootstrap = 'h:1'\nrun-id = 'file'\nport = 4000\nwait-peers = 9\n"
    environ = {"P2P_COCODC_JOIN_RUN_ID": "env", "P2P_COCODC_JOIN_PORT": "4001"}
    opts = built_options(monkeypatch, tmp_path, "join", ["--port", "4002"], environ, toml)
    assert (opts.bootstrap, opts.run_id, opts.port, opts.wait_peers_s) == ("h:1", "env", 4002, 9.0)
    assert opts.region == "options"  # the profile's file name
    toml = "port = 4000\nrefresh = 2\nstatus-port = 4010\n"
    environ = {"P2P_COCODC_BOOTSTRAP_REFRESH": "3"}
    opts = built_options(monkeypatch, tmp_path, "bootstrap", ["--port", "4002"], environ, toml)
    assert (opts.port, opts.refresh_s, opts.status_port) == (4002, 3.0, 4010)
    error = built_options(monkeypatch, tmp_path, "bootstrap", [], None, "colour = 'red'\n")
    assert "--config options.toml: unknown key 'colour'; valid keys: identity, host, port" in str(error)


def test_the_benchmarks_start_peers_with_options_that_join_accepts(tmp_path: Path) -> None:
    """The peers `benchmarks/thin_link.py` and `benchmarks/hivemind_baseline.py` start: their options
    parse and build a configuration (an option one benchmark added once broke the other's peers)."""
    from benchmarks import hivemind_baseline, thin_link
    from p2p_cocodc.algorithms.codecs import get_codec
    from p2p_cocodc.cli.main import _config_from, _swarm_from, join
    from p2p_cocodc.config.join import SWARM
    from p2p_cocodc.run.setup import sync_codecs

    link = thin_link.arguments(["--profile", "thin", "--overlap", "auto", "--paced-codec", "same"])
    argvs = [["--bootstrap", "10.0.0.1:1", *thin_link.training_options(link, link.mbps[0])]]
    held = thin_link.arguments(
        ["--profile", "thin", "--overlap", "auto", "--min-step-time", "0.3", "--eval-batches", "8"]
    )
    argvs += [["--bootstrap", "10.0.0.1:1", *thin_link.training_options(held, held.mbps[0])]]
    baseline = hivemind_baseline.arguments(["--profile", "thin", "--paced-codec", "q2", "--no-final-sync"])
    where = hivemind_baseline.Placement(("ns", "10.0.0.9"), [("ns", f"10.0.0.{i}") for i in range(3)])
    _, _, peers = hivemind_baseline.commands("ours", baseline, where, tmp_path, 2.0, 96)
    argvs += [argv[argv.index("join") + 1 :] for argv, _ in peers]
    min_steps, eval_batches = [], []
    for argv in argvs:
        options = dict(join.make_context("join", list(argv)).params)
        for flag in ("config_path", "check", "quiet", "verbose"):
            options.pop(flag)
        swarm = {k: options.pop(k) for k in list(options) if k in SWARM.fields}
        cfg = _config_from(None, options)
        min_steps.append(_swarm_from(None, swarm).min_step_s)
        eval_batches.append(cfg.eval_batches)
        assert cfg.model == "small" and cfg.overlap == "auto", argv
        sync_codecs(get_codec(cfg.wire_codec, cfg.topk), cfg.paced_wire_codec, cfg.topk, cfg.error_feedback)
    assert argvs[0][argvs[0].index("--paced-codec") + 1] == "same"
    assert argvs[-1][argvs[-1].index("--paced-codec") + 1] == "q2"
    assert "--no-final-sync" in argvs[-1] and "--no-final-sync" not in argvs[0]
    assert min_steps[:2] == [0.0, 0.3] and not any(min_steps[2:])  # thin_link --min-step-time reaches them
    assert eval_batches[:2] == [2, 8] and set(eval_batches[2:]) == {2}  # and --eval-batches
