"""``--save DIR`` and the model in it: ``p2p-cocodc generate`` and ``p2p-cocodc eval`` on real
runs of the CLI (p2p_cocodc/models/saved.py, p2p_cocodc/models/inference.py).

One tiny simulated run is saved once for the whole file; tests that change a folder work on a copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors.torch import load_file

from p2p_cocodc.cli.main import check_output_paths
from p2p_cocodc.cli.main import cli as cli_group
from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.build import build_model
from p2p_cocodc.models.data import load_corpus
from p2p_cocodc.models.inference import generate
from p2p_cocodc.models.saved import load_saved
from p2p_cocodc.run.records import params_sha256, perplexity
from tests.swarm_procs import records
from tests.test_cli import assert_one_error_line
from tests.tiny_options import TINY_MODEL, TINY_SYNCS

RUN = [*TINY_MODEL, "--workers", "2", "--steps", "16", *TINY_SYNCS, "--step-time", "0.05", "--threads", "1"]
PROMPT = "Fellow citizens of the Senate"
PERPLEXITY = re.compile(r"perplexity (\S+) on (\d+) tokens")


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {
        **os.environ,
        "P2P_COCODC_CACHE": str(tmp_path_factory.mktemp("cache")),
        "OMP_NUM_THREADS": "1",
        "PYTHONIOENCODING": "utf-8",
    }


def cli(env: dict[str, str], *args: Any, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``p2p-cocodc ARGS``; output decoded as UTF-8 with nothing translated (a model may print '\\r')."""
    done = subprocess.run(
        [sys.executable, "-m", "p2p_cocodc", *map(str, args)],
        capture_output=True,
        env=env,
        cwd=cwd,
        timeout=180,
    )
    return subprocess.CompletedProcess(
        done.args, done.returncode, done.stdout.decode("utf-8"), done.stderr.decode("utf-8")
    )


def in_parallel(env: dict[str, str], *commands: list[Any]) -> list[subprocess.CompletedProcess[str]]:
    """The commands two at a time (the machine has two cores), results in order."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(lambda args: cli(env, *args), commands))


@pytest.fixture(scope="module")
def saved(env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A finished tiny run saved to a folder, and its summary record."""
    work = tmp_path_factory.mktemp("run")
    done = cli(env, "simulate", *RUN, "--quiet", "--out", "run.jsonl", "--save", "model", cwd=work)
    assert done.returncode == 0, done.stderr
    return work / "model", records(work / "run.jsonl")[-1]


def copy_of(saved: tuple[Path, dict[str, Any]], where: Path) -> Path:
    folder = where / "model"
    shutil.copytree(saved[0], folder)
    return folder


# ---- the folder ----


def test_the_folder_holds_theta_with_its_model_tokenizer_and_facts(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    folder, summary = saved
    config = json.loads((folder / "p2p-cocodc.json").read_text())
    assert summary["saved"] == "model"
    expected = dict(model="nano", model_kind="preset", vocab_size=256, seq_len=32, tokenizer="byte")
    assert {key: config[key] for key in expected} == expected
    assert config["global_params_sha256"] == summary["global_params_sha256"]
    run = config["run"]
    assert run["finished"] and run["steps"] == 16 and run["final_val_ppl"] == summary["final_val_ppl"]
    assert run["options"]["eval_batches"] == 2 and run["data"] is None  # the embedded corpus
    # the weights file is θ̄ as it was: safetensors loads it into the same preset, hash for hash
    model = build_model("nano", 256, 32)
    model.load_state_dict(load_file(folder / "model.safetensors"))
    assert params_sha256(model.state_dict()) == summary["global_params_sha256"]
    loaded, tokenizer, info = load_saved(str(folder))
    assert params_sha256(loaded.state_dict()) == summary["global_params_sha256"] and not loaded.training
    assert tokenizer.name == "byte" and info == config


def test_a_bpe_tokenizer_is_saved_with_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bpe4096 trained on the run's own text: the folder's tokenizer.json encodes as the run did."""
    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation

    monkeypatch.setenv("P2P_COCODC_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "speeches.txt"
    text.write_text("\n\n".join(load_corpus(None).train_docs[:8]), encoding="utf-8")
    cfg = TrainConfig(
        model="nano",
        data=str(text),
        seq_len=32,
        batch_size=4,
        workers=1,
        steps=2,
        inner_steps=2,
        fragments=2,
        eval_every=2,
        eval_batches=1,
        step_time=0.05,
        save=str(tmp_path / "model"),
    )
    sim = Simulation(cfg)
    summary = sim.run(RunLog(None))
    model, tokenizer, info = load_saved(str(tmp_path / "model"))
    assert info["tokenizer"] == "bpe4096" and info["run"]["data"] == str(text.resolve())
    sample = "The state of the Union, 1790–2021."
    assert tokenizer.encode(sample) == sim.setup.tokenizer.encode(sample)
    assert tokenizer.vocab_size == info["vocab_size"] == sim.setup.tokens.vocab_size
    assert params_sha256(model.state_dict()) == summary["global_params_sha256"]


# ---- eval ----


def run_in_process(env: dict[str, str], *args: Any) -> str:
    """``p2p-cocodc ARGS`` in this process (no second import of torch): its stdout."""
    result = CliRunner().invoke(cli_group, [str(a) for a in args], env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result.stdout


def test_eval_gives_back_the_run_final_perplexity(
    saved: tuple[Path, dict[str, Any]], env: dict[str, str]
) -> None:
    folder, summary = saved
    found = PERPLEXITY.search(run_in_process(env, "eval", folder))
    assert found is not None
    assert float(found[1]) == pytest.approx(summary["final_val_ppl"], rel=1e-4)
    assert int(found[2]) == 2 * 4 * 32  # the run's --eval-batches of --batch-size windows of --seq-len


def test_eval_scores_the_validation_split_of_new_text(
    saved: tuple[Path, dict[str, Any]], env: dict[str, str], tmp_path: Path
) -> None:
    """Against a perplexity computed here by hand: the first 4 windows of 16 bytes of the text's
    validation documents (every 20th from the 10th, joined by a blank line)."""
    folder, summary = saved
    paragraphs = [f"Paragraph {i}: the people of district {i} ask for roads and schools." for i in range(40)]
    text = tmp_path / "new.txt"
    text.write_text("\n\n".join(paragraphs), encoding="utf-8")
    found = PERPLEXITY.search(
        run_in_process(env, "eval", folder, "--data", text, "--batches", 1, "--seq-len", 16)
    )
    assert found is not None and int(found[2]) == 4 * 16

    val = "\n\n".join(load_corpus(str(text)).val_docs).encode("utf-8")
    ids = torch.tensor(list(val[: 4 * 16 + 1]))
    x = torch.stack([ids[i * 16 : i * 16 + 16] for i in range(4)])
    y = torch.stack([ids[i * 16 + 1 : i * 16 + 17] for i in range(4)])
    model, _, _ = load_saved(str(folder))
    with torch.no_grad():
        loss = float(F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)))
    assert float(found[1]) == pytest.approx(perplexity(loss), rel=1e-4)
    assert float(found[1]) != pytest.approx(summary["final_val_ppl"], rel=1e-2)


# ---- generate ----


def greedy(model: torch.nn.Module, prompt: str, tokens: int) -> str:
    """The likeliest byte, again and again: the oracle of --temperature 0."""
    ids = list(prompt.encode("utf-8"))
    with torch.no_grad():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids[-32:]]))[0, -1].argmax()))
    return bytes(ids).decode("utf-8", errors="replace")


def test_generate_is_greedy_at_temperature_zero_and_repeats_itself_under_a_seed(
    saved: tuple[Path, dict[str, Any]], env: dict[str, str]
) -> None:
    folder, _ = saved
    model, tokenizer, _ = load_saved(str(folder))
    greedy_text = run_in_process(
        env, "generate", folder, "--prompt", PROMPT, "--max-new-tokens", 40, "--temperature", 0
    )
    assert greedy_text == greedy(model, PROMPT, 40) + "\n"  # the model sees its last 32 tokens only

    sampled = [
        "generate",
        folder,
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        40,
        "--temperature",
        1,
        "--seed",
        7,
    ]
    first, second = run_in_process(env, *sampled), run_in_process(env, *sampled)
    assert first == second and first.startswith(PROMPT)

    def sample(seed: int) -> str:
        return generate(
            model, tokenizer, PROMPT, max_new_tokens=40, temperature=1.0, top_k=50,
            generator=torch.Generator().manual_seed(seed), context=32, device=torch.device("cpu"),
        )  # fmt: skip

    assert first == sample(7) + "\n" and sample(7) != sample(8) != greedy_text


def test_an_empty_prompt_is_refused(saved: tuple[Path, dict[str, Any]]) -> None:
    model, tokenizer, _ = load_saved(str(saved[0]))
    with pytest.raises(UserError, match="--prompt is empty"):
        generate(
            model, tokenizer, "", max_new_tokens=1, temperature=0, top_k=0,
            generator=torch.Generator(), context=32, device=torch.device("cpu"),
        )  # fmt: skip


# ---- hf: models ----


def test_an_hf_model_is_saved_then_generates_and_evaluates(
    env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation
    from tests.test_hf import llama_config
    from tests.test_hf import save_model as save_hf_model

    monkeypatch.setenv("P2P_COCODC_CACHE", env["P2P_COCODC_CACHE"])
    start = save_hf_model(tmp_path / "llama", llama_config(tied=True), weights=True)
    text = tmp_path / "speeches.txt"
    text.write_text("\n\n".join(load_corpus(None).train_docs[:30]), encoding="utf-8")
    cfg = TrainConfig(
        model=f"hf:{start}", data=str(text), seq_len=32, batch_size=4, workers=2, steps=4, inner_steps=4,
        fragments=2, overlap=1, eval_every=4, eval_batches=2, step_time=0.05, save=str(tmp_path / "saved"),
    )  # fmt: skip
    summary = Simulation(cfg).run(RunLog(None))
    folder = tmp_path / "saved"
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()  # from_pretrained's

    prompt = "The state of the Union"
    generated = run_in_process(
        env, "generate", folder, "--prompt", prompt, "--max-new-tokens", 6, "--temperature", 0
    )
    model, tokenizer, info = load_saved(str(folder))  # θ̄ hashes as the run's, or it would refuse
    assert info["model_kind"] == "hf" and info["global_params_sha256"] == summary["global_params_sha256"]
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1, : tokenizer.vocab_size].argmax()))
    assert generated == tokenizer.decode(ids) + "\n"
    found = PERPLEXITY.search(run_in_process(env, "eval", folder))
    assert found is not None
    assert float(found[1]) == pytest.approx(summary["final_val_ppl"], rel=1e-4)


# ---- nothing is overwritten without --force ----


def test_out_and_save_are_not_replaced_without_force(
    saved: tuple[Path, dict[str, Any]], env: dict[str, str], tmp_path: Path
) -> None:
    folder = copy_of(saved, tmp_path)
    shutil.copy(saved[0].parent / "run.jsonl", tmp_path)
    before = (tmp_path / "run.jsonl").read_text()
    again = ["simulate", *RUN, "--quiet", "--seed", "1"]
    refused_save, refused_out = in_parallel(
        env,
        [*again, "--save", folder, "--out", tmp_path / "other.jsonl"],
        [*again, "--out", tmp_path / "run.jsonl"],
    )
    assert_one_error_line(refused_save, f"--save {folder}", "already holds a saved model", "--force")
    assert_one_error_line(refused_out, f"--out {tmp_path / 'run.jsonl'}", "already exists", "--force")
    assert (tmp_path / "run.jsonl").read_text() == before and not (tmp_path / "other.jsonl").exists()
    assert json.loads((folder / "p2p-cocodc.json").read_text()) == json.loads(
        (saved[0] / "p2p-cocodc.json").read_text()
    )

    run_in_process(env, *again, "--save", folder, "--out", tmp_path / "run.jsonl", "--force")
    summary = records(tmp_path / "run.jsonl")[-1]
    assert summary["config"]["seed"] == 1
    replaced = json.loads((folder / "p2p-cocodc.json").read_text())["global_params_sha256"]
    assert replaced == summary["global_params_sha256"] != saved[1]["global_params_sha256"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "run.jsonl"]  # nothing left aside


BASE = TrainConfig(model="nano", tokenizer="byte")


def test_what_force_and_resume_may_replace(tmp_path: Path, saved: tuple[Path, dict[str, Any]]) -> None:
    out = tmp_path / "run.jsonl"
    out.write_text("an earlier run\n")
    check_output_paths(replace(BASE, out=str(out), force=True))
    check_output_paths(replace(BASE, out=str(out), resume=True, checkpoint_dir=str(tmp_path / "ck")))
    (tmp_path / "empty").mkdir()
    check_output_paths(replace(BASE, save=str(tmp_path / "empty")))  # nothing there to lose
    check_output_paths(replace(BASE, save=str(copy_of(saved, tmp_path)), force=True))
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"\xff\xd8")
    for path, message in ((foreign, "other files in it"), (out, "is a file")):
        with pytest.raises(UserError, match=message):  # --force replaces only a saved model
            check_output_paths(replace(BASE, save=str(path), force=True))


# ---- a damaged, foreign or missing folder: one line ----


def test_a_damaged_folder_is_one_line_through_the_cli(
    saved: tuple[Path, dict[str, Any]], env: dict[str, str], tmp_path: Path
) -> None:
    no_config = copy_of(saved, tmp_path / "a")
    (no_config / "p2p-cocodc.json").unlink()
    truncated = copy_of(saved, tmp_path / "b")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    generated, scored = in_parallel(
        env, ["generate", no_config, "--prompt", PROMPT], ["eval", truncated, "--device", "cpu"]
    )
    assert_one_error_line(generated, str(no_config), "has no p2p-cocodc.json")
    assert_one_error_line(scored, str(weights), "is damaged")


def flip_last_byte(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))


def set_config(key: str, value: Any) -> Any:
    def change(folder: Path) -> None:
        file = folder / "p2p-cocodc.json"
        file.write_text(json.dumps({**json.loads(file.read_text()), key: value}))

    return change


DAMAGED = {
    "altered-weights": (flip_last_byte, "do not hash to the sha256"),
    "no-weights": (lambda f: (f / "model.safetensors").unlink(), "has no model.safetensors"),
    "garbled-config": (lambda f: (f / "p2p-cocodc.json").write_text("{"), "cannot be read"),
    "foreign-config": (lambda f: (f / "p2p-cocodc.json").write_text("{}"), "not the config of a model"),
    "newer-format": (set_config("format_version", 99), "upgrade"),
    "no-seq-len": (set_config("seq_len", None), "seq_len should be an int, not None"),
    "other-model": (set_config("model", "micro"), "does not fit model 'micro'"),
    "folder-is-a-file": (lambda f: (shutil.rmtree(f), f.write_text("tensors")), "is a file"),
    "no-folder": (shutil.rmtree, "no such folder"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_folder_is_refused_with_what_is_wrong(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, case: str
) -> None:
    damage, message = DAMAGED[case]
    folder = copy_of(saved, tmp_path)
    damage(folder)
    with pytest.raises(UserError, match=message) as refused:
        load_saved(str(folder))
    assert "\n" not in str(refused.value) and str(folder) in str(refused.value)


# ---- a --save that fails after training ----


def test_a_save_that_fails_after_training_keeps_the_model_beside_out_and_the_summary(tmp_path: Path) -> None:
    """--save's parent became a file while the run trained: θ̄ goes to a fallback folder beside --out,
    loads with the run's hash, and the summary (written to --out) says where and why; the command
    then exits 2 naming both."""
    from p2p_cocodc.cli.main import check_saved
    from p2p_cocodc.config.train import build_config
    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation

    options = dict(zip(RUN[::2], RUN[1::2], strict=True))
    cfg = build_config({}, {k[2:].replace("-", "_"): v for k, v in options.items()})
    out = tmp_path / "runs" / "sim.jsonl"
    cfg = replace(cfg, save=str(tmp_path / "taken" / "model"), out=str(out))
    (tmp_path / "taken").write_text("a file where --save's folder should go\n")
    log = RunLog(str(out))
    try:
        summary = Simulation(cfg).run(log)
    finally:
        log.close()
    fallback = out.parent / "p2p-cocodc-cocodc-step-16"
    assert summary["saved"] == str(fallback)
    assert summary["save_failed"].startswith(f"--save {tmp_path / 'taken' / 'model'}: cannot write it")
    assert records(out)[-1] == json.loads(json.dumps(summary))  # the summary is written, to the end
    model, _, info = load_saved(str(fallback))
    assert params_sha256(model.state_dict()) == summary["global_params_sha256"]
    assert info["global_params_sha256"] == summary["global_params_sha256"]
    with pytest.raises(UserError, match=f"; θ̄ saved to {re.escape(str(fallback))} instead$"):
        check_saved(summary)
