"""Checkpoints of ``simulate``: atomic files, bit-exact resume (in process and after a SIGKILL),
refusal of checkpoints that are damaged or from another run, stops on SIGTERM/SIGINT, and output
paths checked before any set-up."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import signal
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from p2p_cocodc.cli.main import check_output_paths
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import Stopped, UserError
from p2p_cocodc.run.checkpoint import (
    KEEP,
    CheckpointWriter,
    atomic_write,
    committed,
    find_resume_point,
    read_checkpoint,
)
from p2p_cocodc.run.records import RunLog
from p2p_cocodc.run.simulator import Simulation
from tests.swarm_procs import records, run_cli, sigkill_like_a_crash, spawn, wait_for
from tests.test_cli import assert_one_error_line
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

BASE = TrainConfig(
    model="nano",
    tokenizer="byte",
    seq_len=32,
    batch_size=4,
    workers=2,
    steps=20,
    inner_steps=8,
    fragments=2,
    overlap=2,
    eval_every=8,
    eval_batches=2,
    step_time=0.05,
    warmup=4,
)
CASES = {  # every strategy and schedule; cocodc's N = 3 keeps syncs in flight at odd steps
    "ddp": {"algo": "ddp", "overlap": 0},
    "diloco": {"algo": "diloco", "overlap": 0},
    "streaming": {"algo": "streaming", "codec": "int8"},
    "cocodc": {"algo": "cocodc", "transmissions": 3, "codec": "fp4"},
    "cocodc-step": {"algo": "cocodc", "dc_rule": "step", "dc_wd_debias": True, "overlap": 3},
    # three workers: slice owners screen, and their cosine records are part of the state
    "cocodc-screened": {"algo": "cocodc", "workers": 3},
}
CLI_RUN = [*TINY_MODEL, *TINY_SYNCS, "--workers", "2", "--step-time", "0.05", "--threads", "1", "--quiet"]


def assert_same(a: Any, b: Any, where: str = "state") -> None:
    """Bit-exact equality of two nested states (tensors: same dtype, shape and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    else:
        assert a == b and type(a) is type(b), (where, a, b)


def stop_at(sim: Simulation, step: int):
    """A stop request, as SIGTERM makes one, once ``sim`` has done ``step`` steps."""
    return lambda: signal.SIGTERM if sim.step == step else None


def without_config(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "config"} for r in recs]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# ---- in process: checkpoint, load into a fresh simulation, go on, compare everything ----


@pytest.mark.parametrize("case", list(CASES))
def test_resume_in_process_is_bit_exact(tmp_path: Path, case: str) -> None:
    cfg = replace(BASE, **CASES[case], checkpoint_dir=str(tmp_path / "ck")).validate()
    stop_after = random.Random(case).randint(1, cfg.steps - 1)  # seeded: a reproducible random step

    reference = Simulation(cfg)
    reference_summary = reference.run(RunLog(str(tmp_path / "reference.jsonl")))

    first = Simulation(cfg)
    writer = CheckpointWriter(cfg.checkpoint_dir, 0, cfg.computing_options(), first.setup.data_sha256())
    with pytest.raises(Stopped, match=f"stopped by SIGTERM after step {stop_after} of 20"):
        first.run(RunLog(None), checkpoints=writer, stop=stop_at(first, stop_after))
    if case == "cocodc":  # a send every 2 steps, applied 2 steps later: always one in flight
        assert first.pending, "the checkpoint should hold a sync in flight"
    if case == "cocodc-screened":
        assert any(r.cosines for r in first.cosine_records.values()), "nothing was screened yet"

    checkpoint = find_resume_point(replace(cfg, resume=True))
    assert checkpoint is not None and checkpoint.step == stop_after
    resumed = Simulation.resumed(cfg, checkpoint)
    assert_same(resumed.state_dict(), first.state_dict())  # what was saved is what is loaded
    summary = resumed.run(RunLog(str(tmp_path / "resumed.jsonl")))

    assert_same(resumed.state_dict(), reference.state_dict())
    assert summary == reference_summary
    assert records(tmp_path / "resumed.jsonl") == records(tmp_path / "reference.jsonl")


def test_checkpoint_options_do_not_change_the_peer_fingerprint() -> None:
    from p2p_cocodc.peer.node import shared_options
    from p2p_cocodc.run.setup import TrainingSetup
    from p2p_cocodc.swarm.run_options import fingerprint

    with_options = replace(BASE, checkpoint_dir="ck", checkpoint_every=4, resume=True, out="o", save="s")
    prints = [fingerprint(shared_options(TrainingSetup(c), c.algo_settings())) for c in (BASE, with_options)]
    assert prints[0] == prints[1]
    assert BASE.computing_options() == with_options.computing_options()
    assert "lr" in BASE.computing_options() and "threads" not in BASE.computing_options()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"resume": True}, "--resume needs --checkpoint-dir"),
        ({"checkpoint_every": 4}, "--checkpoint-every needs --checkpoint-dir"),
        ({"checkpoint_dir": "ck", "checkpoint_every": -1}, "--checkpoint-every must be ≥ 0, got -1"),
    ],
)
def test_checkpoint_options_are_validated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UserError, match=message):
        replace(BASE, **options).validate()


# ---- the atomic writer and the last KEEP checkpoints ----


def test_writer_keeps_the_last_three_and_no_temporary_file(tmp_path: Path) -> None:
    writer = CheckpointWriter(str(tmp_path), 2, {"lr": 1.0}, "data")
    (tmp_path / ".step-00000009.json.tmp-123").write_bytes(b"a write that was killed")
    (tmp_path / "step-00000011.safetensors").write_bytes(b"tensors whose JSON never came")
    (tmp_path / "notes.txt").write_text("not ours: stays")
    for step in range(1, 7):
        state = {"x": torch.full((3,), float(step)), "step": step, "nested": [{"y": torch.arange(step)}]}
        path = writer.write(step, state)
        assert path == tmp_path / f"step-{step:08d}.json"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["notes.txt"] + [
        f"step-{s:08d}.{ext}" for s in (4, 5, 6) for ext in ("json", "safetensors")
    ]
    assert [s for s, _ in committed(tmp_path)] == [4, 5, 6] and KEEP == 3
    back = read_checkpoint(tmp_path / "step-00000006.json", {"lr": 1.0})
    assert_same(back.state, {"x": torch.full((3,), 6.0), "step": 6, "nested": [{"y": torch.arange(6)}]})
    assert writer.due(4, 20) and not writer.due(5, 20) and writer.due(20, 20)


def test_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "file"
    atomic_write(target, b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    (tmp_path / "folder").mkdir()
    with pytest.raises(OSError):
        atomic_write(tmp_path / "folder", b"cannot replace a folder by a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "folder"]


# ---- refused checkpoints: one clear message, nothing touched ----


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainConfig, Path]:
    """A cocodc run of 12 steps checkpointed every 4 (newest: step 12)."""
    folder = tmp_path_factory.mktemp("written") / "ck"
    cfg = replace(BASE, steps=12, checkpoint_dir=str(folder), checkpoint_every=4).validate()
    sim = Simulation(cfg)
    writer = CheckpointWriter(str(folder), 4, cfg.computing_options(), sim.setup.data_sha256())
    sim.run(RunLog(None), checkpoints=writer)
    return replace(cfg, resume=True), folder


def damage(folder: Path, how: str) -> None:
    """Damage the newest checkpoint (step 12) of ``folder`` in one way."""
    meta_path, tensor_path = folder / "step-00000012.json", folder / "step-00000012.safetensors"
    meta = json.loads(meta_path.read_text())
    if how == "truncated-tensors":
        tensor_path.write_bytes(tensor_path.read_bytes()[:-100])
    elif how == "flipped-bit":
        data = bytearray(tensor_path.read_bytes())
        data[-1] ^= 1
        tensor_path.write_bytes(bytes(data))
    elif how == "truncated-json":
        meta_path.write_bytes(meta_path.read_bytes()[:200])
    elif how == "other-version":
        meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    elif how in ("missing-tensor", "wrong-shape", "wrong-shape-listed"):
        tensors = load_file(tensor_path)
        name = "workers/1/strategy/outer/0/momentum"
        if how == "missing-tensor":
            del tensors[name]
        else:
            tensors[name] = torch.zeros(3)
        if how == "wrong-shape-listed":  # the skeleton agrees: only the model can tell
            meta["state"]["workers"][1]["strategy"]["outer"][0]["momentum"]["shape"] = [3]
        save_file(tensors, tensor_path)
        data = tensor_path.read_bytes()
        meta["tensors"].update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        meta_path.write_text(json.dumps(meta))
    else:
        raise AssertionError(how)


REFUSALS = {
    "truncated-tensors": "step-00000012.safetensors has",
    "flipped-bit": "step-00000012.safetensors: its sha256 differs",
    "truncated-json": "step-00000012.json is not valid JSON",
    "other-version": "step-00000012.json is checkpoint format version 99",
    "missing-tensor": "lacks tensor 'workers/1/strategy/outer/0/momentum'",
    "wrong-shape": "tensor 'workers/1/strategy/outer/0/momentum' is float32 [3]",
    "wrong-shape-listed": "step-00000012.json does not fit this run (momentum is torch.float32 [3], expected",
}


@pytest.mark.parametrize("how", list(REFUSALS))
def test_a_damaged_checkpoint_is_refused_and_left_alone(
    written: tuple[TrainConfig, Path], tmp_path: Path, how: str
) -> None:
    cfg, original = written
    folder = tmp_path / "ck"
    shutil.copytree(original, folder)
    damage(folder, how)
    before = folder_bytes(folder)
    with pytest.raises(UserError) as refused:
        Simulation.resumed(cfg, find_resume_point(replace(cfg, checkpoint_dir=str(folder))))
    message = str(refused.value)
    assert REFUSALS[how] in message and "\n" not in message, message
    assert folder_bytes(folder) == before


def test_a_checkpoint_of_other_data_is_refused(written: tuple[TrainConfig, Path], tmp_path: Path) -> None:
    cfg, folder = written
    text = tmp_path / "other.txt"
    words = random.Random(0).choices(["union", "state", "congress", "people", "nation"], k=30000)
    text.write_text(" ".join(words))
    before = folder_bytes(folder)
    other = replace(cfg, data=str(text))
    with pytest.raises(UserError, match="step-00000012.json was written for other training data"):
        Simulation.resumed(other, find_resume_point(other))
    assert folder_bytes(folder) == before


def test_fresh_run_into_a_used_folder_and_resume_from_an_empty_one_are_refused(
    written: tuple[TrainConfig, Path], tmp_path: Path
) -> None:
    cfg, folder = written
    with pytest.raises(
        UserError, match="already holds checkpoints .newest step-00000012.json.: add --resume"
    ):
        find_resume_point(replace(cfg, resume=False))
    with pytest.raises(UserError, match="holds no checkpoint"):
        find_resume_point(replace(cfg, checkpoint_dir=str(tmp_path)))


def test_cli_refuses_a_checkpoint_of_other_options(written: tuple[TrainConfig, Path], tmp_path: Path) -> None:
    _, folder = written
    before = folder_bytes(folder)
    out = tmp_path / "out.jsonl"
    out.write_text("kept\n")
    args = ["simulate", *CLI_RUN, "--steps", "12", "--warmup", "4", "--lr", "0.002"]
    proc = run_cli([*args, "--checkpoint-dir", str(folder), "--resume", "--out", str(out)], tmp_path, 120)
    line = assert_one_error_line(proc, str(folder / "step-00000012.json"), "other options")
    assert "--lr 0.001 there, 0.002 here" in line, line
    assert folder_bytes(folder) == before
    assert out.read_text() == "kept\n"  # not truncated: the run never started


# ---- real processes: SIGKILL at a random step, then --resume; SIGTERM / SIGINT ----


@pytest.mark.parametrize("algo", ["cocodc", "ddp"])
def test_a_killed_run_resumes_to_the_same_parameters(tmp_path: Path, algo: str) -> None:
    # cocodc sends a fragment every 4 steps (H = 8, N = K = 2) and applies it 2 steps later, so
    # every checkpoint (every 4 steps) holds a sync in flight
    steps, every = 40, 4
    kill_after = every * random.Random(algo).randint(1, 4)  # a seeded random checkpoint, ≤ step 16
    args = ["simulate", *CLI_RUN, "--algo", algo, "--steps", str(steps), "--warmup", "4"]
    if algo == "ddp":
        args += ["--overlap", "0"]
    reference = spawn([*args, "--out", "reference.jsonl"], tmp_path, "reference.log")
    folder = tmp_path / "ck"
    run = [*args, "--out", "run.jsonl", "--checkpoint-dir", str(folder), "--checkpoint-every", str(every)]
    killed = spawn(run, tmp_path, "killed.log")
    try:
        marker = folder / f"step-{kill_after:08d}.json"
        wait_for(lambda: marker.exists() or killed.poll() is not None, 120, f"{marker}", interval=0.001)
        sigkill_like_a_crash(killed.pid)
        assert killed.wait(30) == -signal.SIGKILL, (tmp_path / "killed.log").read_text()
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert reference.wait(120) == 0, (tmp_path / "reference.log").read_text()
    interrupted = records(tmp_path / "run.jsonl")
    assert interrupted[-1]["kind"] == "eval"  # no summary: the run never finished
    newest = json.loads(committed(folder)[-1][1].read_text())
    assert newest["step"] >= kill_after
    assert bool(newest["state"]["pending"]) == (algo == "cocodc")

    resumed = run_cli([*run, "--resume"], tmp_path, 120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed after step" in resumed.stderr
    expected, got = records(tmp_path / "reference.jsonl"), records(tmp_path / "run.jsonl")
    assert got[-1]["global_params_sha256"] == expected[-1]["global_params_sha256"]
    assert without_config(got) == without_config(expected)  # the records file is whole again
    assert got[-1]["config"]["resume"] is True
    assert len(committed(folder)) == KEEP and committed(folder)[-1][0] == steps
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_checkpoints_and_exits_non_zero(tmp_path: Path, sig: signal.Signals) -> None:
    steps = 64
    folder = tmp_path / "ck"
    run = ["simulate", *CLI_RUN, "--steps", str(steps), "--out", "run.jsonl", "--checkpoint-dir", str(folder)]
    run += ["--save", "model"]
    proc = spawn(run, tmp_path, "run.log")
    try:
        out = tmp_path / "run.jsonl"
        wait_for(lambda: out.exists() and out.read_text().count("\n") >= 2, 120, "the eval of step 8", 0.01)
        proc.send_signal(sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "run.log").read_text()
    assert code == 128 + sig, log
    step, path = committed(folder)[-1]
    last = log.strip().splitlines()[-1]
    assert last == (
        f"stopped by {sig.name} after step {step} of {steps}: checkpoint written to {path}; "
        "to continue, run the same command with --resume"
    ), log
    assert 8 <= step < steps and "Traceback" not in log
    assert records(out)[-1]["kind"] == "eval"
    # --save: never under the name a finished run's model takes
    assert not (tmp_path / "model").exists()
    partial = json.loads((tmp_path / f"model.partial-step-{step}" / "p2p-cocodc.json").read_text())
    assert partial["run"]["finished"] is False and partial["run"]["steps"] == step, partial["run"]
    if sig == signal.SIGTERM:
        resumed = run_cli([*run, "--resume"], tmp_path, 120)
        assert resumed.returncode == 0, resumed.stderr
        recs = records(out)
        assert [r["step"] for r in recs[:-1]] == list(range(0, steps + 1, 8))
        assert recs[-1]["kind"] == "summary" and recs[-1]["steps"] == steps
        saved = json.loads((tmp_path / "model" / "p2p-cocodc.json").read_text())
        assert saved["run"]["finished"] and saved["global_params_sha256"] == recs[-1]["global_params_sha256"]


# ---- output paths are checked before any set-up ----


@pytest.mark.parametrize("option", ["out", "save", "checkpoint_dir"])
def test_unwritable_output_paths_are_refused(tmp_path: Path, option: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    on_a_file = {"out": "already exists", "save": "is a file", "checkpoint_dir": "is a file, not a folder"}
    for path, message in (
        (blocker / "sub" / "x", "cannot create the folder"),
        (tmp_path, "is a folder" if option != "checkpoint_dir" else None),
        (blocker, on_a_file[option]),
    ):
        cfg = replace(BASE, **{option: str(path)})
        if message is None:
            check_output_paths(cfg)
            continue
        with pytest.raises(UserError, match=f"--{option.replace('_', '-')} {path}"):
            check_output_paths(cfg)
        with pytest.raises(UserError, match=message):
            check_output_paths(cfg)


def test_cli_checks_output_paths_before_set_up(tmp_path: Path) -> None:
    """A model that cannot be built would fail the set-up: the bad path must be reported first."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = str(blocker / "theta.safetensors")
    simulate = run_cli(
        ["simulate", *CLI_RUN, "--model", "no_such_module:factory", "--save", bad], tmp_path, 60
    )
    assert_one_error_line(simulate, "--save", bad)
    join = run_cli(["join", *CLI_RUN, "--bootstrap", "127.0.0.1:9", "--out", bad], tmp_path, 60)
    assert_one_error_line(join, "--out", bad)
    join_ck = run_cli(
        ["join", *CLI_RUN, "--bootstrap", "127.0.0.1:9", "--checkpoint-dir", "ck", "--resume"], tmp_path, 60
    )
    assert_one_error_line(join_ck, "--resume", "holds no checkpoint")


def test_a_checkpoint_gives_the_tau_and_n_its_run_agreed_or_is_refused() -> None:
    """A resumed peer proposes its checkpoint's τ and N (an 'auto' run's agreed ones); an older
    checkpoint without them leaves its own; anything else is the checkpoint's fault (Checkpoint.restore
    turns these errors into one line naming the file)."""
    from p2p_cocodc.peer.node import saved_shape

    assert saved_shape({}, (2, 4)) == (2, 4)
    assert saved_shape({"sync_shape": [3, 3]}, (2, 4)) == (3, 3)
    for bad in ([1], ["a", 2], [-1, 2], [2, 0], [1, 2, 3]):
        with pytest.raises((ValueError, TypeError)):
            saved_shape({"sync_shape": bad}, (2, 4))
