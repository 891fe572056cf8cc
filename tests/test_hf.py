"""``--model hf:PATH``: a Hugging Face causal LM trained by the simulator and the swarm.

The models are real transformers models, tiny (a 2-layer Llama with 64-wide layers, a 2-layer
GPT-2), saved with ``save_pretrained`` into a temporary folder with a real tokenizer (the project's
own BPE, wrapped as a ``PreTrainedTokenizerFast``). Nothing is downloaded.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the hf extra, which the test extra includes

from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.models.data import SHIPPED_BPE, BpeTokenizer, load_corpus, tokenize_corpus
from tests.swarm_procs import end_group, records, run_cli, run_here, spawn, start_bootstrap
from tests.test_cli import assert_one_error_line

LAYERS = 2
SMALL = [
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--workers",
    "2",
    "--steps",
    "6",
    "--inner-steps",
    "4",
    "--fragments",
    "2",
    "--overlap",
    "1",
    "--eval-every",
    "3",
    "--eval-batches",
    "2",
    "--step-time",
    "0.05",
    "--threads",
    "1",
    "--quiet",
]


def tokenizer() -> Any:
    from tokenizers import Tokenizer

    backend = Tokenizer.from_str(SHIPPED_BPE.read_text(encoding="utf-8"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend)


def llama_config(tied: bool, **changes: Any) -> Any:
    values = dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
    )
    return transformers.LlamaConfig(**{**values, **changes})


def save_model(folder: Path, config: Any, weights: bool, with_tokenizer: bool = True) -> Path:
    """config.json (and weights, seeded) and the tokenizer in ``folder``, as save_pretrained writes them."""
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if weights:
        torch.manual_seed(7)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    if with_tokenizer:
        tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Good and bad model folders, and a small text file to train on."""
    root = tmp_path_factory.mktemp("models")
    bert = transformers.BertConfig(
        vocab_size=4096, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    gpt2 = transformers.GPT2Config(vocab_size=4096, n_embd=32, n_layer=LAYERS, n_head=2, n_positions=64)
    found = {
        "llama": save_model(root / "llama", llama_config(tied=False), weights=False),
        "llama-tied": save_model(root / "llama-tied", llama_config(tied=True), weights=True),
        "gpt2": save_model(root / "gpt2", gpt2, weights=False),
        "bert": save_model(root / "bert", bert, weights=False),
        "bert-mlm": save_model(
            root / "bert-mlm", replace_config(bert, architectures=["BertForMaskedLM"]), False
        ),
        "no-tokenizer": save_model(
            root / "no-tokenizer", llama_config(tied=False), False, with_tokenizer=False
        ),
    }
    (root / "no-config").mkdir()
    found["no-config"] = root / "no-config"
    docs = load_corpus(None).train_docs[:30]  # ~0.5 MB: tokenized in well under a second
    found["data"] = root / "speeches.txt"
    found["data"].write_text("\n\n".join(docs), encoding="utf-8")
    return found


def replace_config(config: Any, **changes: Any) -> Any:
    return type(config)(**{**config.to_dict(), **changes})


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One token cache for this file's runs, never ~/.cache."""
    return {**os.environ, "P2P_COCODC_CACHE": str(tmp_path_factory.mktemp("cache")), "OMP_NUM_THREADS": "1"}


def cli(env: dict[str, str], *args: Any, prelude: str = "pass") -> subprocess.CompletedProcess[str]:
    """``p2p-cocodc ARGS`` in a fresh interpreter that first runs ``prelude``."""
    code = f"import sys; {prelude}; from p2p_cocodc.cli.main import main; sys.argv[0] = 'p2p-cocodc'; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=180, env=env
    )


def config(models: dict[str, Path], model: str, **changes: Any) -> TrainConfig:
    values = dict(
        model=f"hf:{models[model]}",
        data=str(models["data"]),
        seq_len=32,
        batch_size=4,
        workers=2,
        steps=6,
        inner_steps=4,
        fragments=2,
        overlap=1,
        eval_every=3,
        eval_batches=2,
        step_time=0.05,
    )
    return replace(TrainConfig(), **{**values, **changes}).validate()


# ---- the model: fragment units, fingerprint ----


@pytest.mark.parametrize(
    ("model", "embeddings", "layers", "last"),
    [
        (
            "llama",
            ["hf.model.embed_tokens.weight"],
            "hf.model.layers",
            ["hf.model.norm.weight", "hf.lm_head.weight"],
        ),
        ("llama-tied", ["hf.model.embed_tokens.weight"], "hf.model.layers", ["hf.model.norm.weight"]),
        (
            "gpt2",
            ["hf.transformer.wte.weight", "hf.transformer.wpe.weight"],
            "hf.transformer.h",
            ["hf.transformer.ln_f.weight", "hf.transformer.ln_f.bias"],
        ),
    ],
)
def test_fragment_units_cover_every_parameter_once_in_layer_order(
    models: dict[str, Path], model: str, embeddings: list[str], layers: str, last: list[str]
) -> None:
    from p2p_cocodc.models.build import build_model

    torch.manual_seed(0)
    built = build_model(f"hf:{models[model]}", 4096, 32)
    units = built.fragment_units()
    assert len(units) == LAYERS + 2
    assert units[0] == embeddings
    for i, unit in enumerate(units[1:-1]):
        assert unit and all(name.startswith(f"{layers}.{i}.") for name in unit), unit
    assert units[-1] == last
    declared = [name for unit in units for name in unit]
    assert sorted(declared) == sorted(name for name, _ in built.named_parameters())
    assert len(declared) == len(set(declared))
    assert all(p.dtype == torch.float32 for p in built.parameters())


def test_a_tied_head_is_in_state_dicts_once_and_loads_back(models: dict[str, Path]) -> None:
    from p2p_cocodc.models.build import build_model

    torch.manual_seed(0)
    model = build_model(f"hf:{models['llama-tied']}", 4096, 32)
    state = model.state_dict()
    assert "hf.lm_head.weight" not in state and "hf.model.embed_tokens.weight" in state
    state = {k: v + 1.0 for k, v in state.items()}
    model.load_state_dict(state)  # strict: the tied head is filled in from the embedding
    assert model.hf.lm_head.weight is model.hf.model.embed_tokens.weight
    assert torch.equal(model.hf.lm_head.weight, state["hf.model.embed_tokens.weight"])


def test_the_fingerprint_names_the_model_by_content_not_path(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from p2p_cocodc.peer.node import shared_options
    from p2p_cocodc.run.setup import TrainingSetup
    from p2p_cocodc.swarm.run_options import fingerprint

    copy = tmp_path / "elsewhere" / "same-model"
    shutil.copytree(models["llama-tied"], copy)
    monkeypatch.setenv("P2P_COCODC_CACHE", str(tmp_path / "cache"))
    cfg = config(models, "llama-tied")
    here, there = TrainingSetup(cfg), TrainingSetup(replace(cfg, model=f"hf:{copy}"))
    settings = cfg.algo_settings()
    assert fingerprint(shared_options(here, settings)) == fingerprint(shared_options(there, settings))
    # other weights (built from the config with another seed): another model
    other = TrainingSetup(replace(cfg, model=f"hf:{models['llama']}"))
    reseeded = TrainingSetup(replace(other.cfg, seed=1))
    assert fingerprint(shared_options(other, settings)) != fingerprint(shared_options(reseeded, settings))
    assert fingerprint(shared_options(here, settings)) != fingerprint(shared_options(other, settings))


def test_hf_tokens_are_cached_apart_from_bpe4096(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped BPE as an hf tokenizer encodes alike, but gets its own cache file."""
    from p2p_cocodc.models.hf import hf_tokenizer

    monkeypatch.setenv("P2P_COCODC_CACHE", str(tmp_path / "cache"))
    cfg = config(models, "llama")
    corpus = load_corpus(cfg.data)
    ours = tokenize_corpus(corpus, BpeTokenizer(SHIPPED_BPE.read_text(encoding="utf-8")))
    theirs = tokenize_corpus(corpus, hf_tokenizer(cfg))
    assert len(list((tmp_path / "cache" / "tokens").iterdir())) == 2
    assert torch.equal(ours.train, theirs.train)


# ---- simulate, --save ----


def test_simulate_trains_an_hf_model(models: dict[str, Path], env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    args = ["simulate", "--model", f"hf:{models['llama']}", "--data", models["data"], *SMALL]
    proc = cli(env, *args, "--algo", "cocodc", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # the header; no warnings, no bars
    evals = [r for r in records(out) if r["kind"] == "eval"]
    summary = records(out)[-1]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(math.isfinite(r["val_ppl"]) for r in evals)
    assert summary["final_val_ppl"] < summary["initial_val_ppl"]
    assert summary["num_params"] == 4096 * 64 * 2 + LAYERS * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64


def test_save_writes_a_folder_transformers_loads(
    models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """θ̄ saved as a folder: from_pretrained gives the logits θ̄ gives in the trainer's model, and
    the folder's tokenizer is the run's."""
    import json

    from p2p_cocodc.run.records import RunLog
    from p2p_cocodc.run.simulator import Simulation

    folder = tmp_path / "out" / "saved"
    monkeypatch.setenv("P2P_COCODC_CACHE", str(tmp_path / "cache"))
    cfg = config(models, "llama-tied", save=str(folder))
    sim = Simulation(cfg)
    summary = sim.run(RunLog(None))
    assert (
        json.loads((folder / "p2p-cocodc.json").read_text())["global_params_sha256"]
        == (summary["global_params_sha256"])
    )
    trainer_model = sim.setup.eval_model()
    trainer_model.load_state_dict(sim.global_state())
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    saved_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "The state of the Union is strong."
    ids = torch.tensor([saved_tokenizer.encode(text, add_special_tokens=False)])
    assert ids.tolist()[0] == BpeTokenizer(SHIPPED_BPE.read_text(encoding="utf-8")).encode(text)
    with torch.no_grad():
        expected, got = trainer_model(ids), saved(input_ids=ids).logits
    assert saved.dtype == torch.float32
    assert torch.allclose(expected, got, rtol=0, atol=1e-6), (expected - got).abs().max()
    start = transformers.AutoModelForCausalLM.from_pretrained(models["llama-tied"], local_files_only=True)
    with torch.no_grad():
        assert not torch.allclose(start(input_ids=ids).logits, got)  # it trained
    # with --force, a second --save to the same folder replaces the first
    Simulation(replace(cfg, seed=1, force=True)).run(RunLog(None))
    assert (
        json.loads((folder / "p2p-cocodc.json").read_text())["global_params_sha256"]
        != (summary["global_params_sha256"])
    )
    assert sorted(p.name for p in folder.parent.iterdir()) == ["saved"]


# ---- bad input: one line each ----

BAD = {
    "missing": (["--model", "hf:{root}/nowhere"], ["nowhere", "no such folder", "Hugging Face cache"]),
    "no-config": (["--model", "hf:{no-config}"], ["no config.json"]),
    "masked-lm": (["--model", "hf:{bert-mlm}"], ["BertForMaskedLM", "not a causal"]),
    "looks-ahead": (["--model", "hf:{bert}"], ["'bert'", "not a causal"]),
    "no-tokenizer": (["--model", "hf:{no-tokenizer}"], ["no tokenizer", "save_pretrained"]),
    "seq-len": (
        ["--model", "hf:{llama}", "--seq-len", "256"],
        ["--seq-len 256", "max_position_embeddings 128"],
    ),
    "tokenizer": (
        ["--model", "hf:{llama}", "--tokenizer", "byte"],
        ["--tokenizer byte", "leave --tokenizer out"],
    ),
    "save-file": (["--model", "hf:{llama}", "--save", "{data}"], ["--save", "is a file", "folder"]),
    "save-foreign": (["--model", "hf:{llama}", "--save", "{gpt2}"], ["--save", "other files"]),
}
NO_TRANSFORMERS = "sys.modules['transformers'] = None"  # what an environment without the package sees


@pytest.fixture(scope="module")
def bad_runs(
    models: dict[str, Path], env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each bad value in this process (``run_here``: refused before any training, so nothing of a
    process of its own is under test), and the run without transformers in a fresh interpreter."""
    names = {key: str(path) for key, path in models.items()} | {"root": str(models["data"].parent)}
    run = ["simulate", "--data", str(models["data"]), *SMALL]  # the bad value comes after, and wins
    here, cache = tmp_path_factory.mktemp("bad"), {"P2P_COCODC_CACHE": env["P2P_COCODC_CACHE"]}
    jobs = {key: [*run, *[a.format(**names) for a in args]] for key, (args, _) in BAD.items()}
    refused = {key: run_here(args, here, cache) for key, args in jobs.items()}
    refused["no-transformers"] = cli(env, *run, "--model", f"hf:{models['llama']}", prelude=NO_TRANSFORMERS)
    return refused


@pytest.mark.parametrize("key", list(BAD))
def test_bad_input_is_one_line(bad_runs: dict[str, Any], models: dict[str, Path], key: str) -> None:
    names = {k: str(v) for k, v in models.items()}
    assert_one_error_line(bad_runs[key], *(n.format(**names) for n in BAD[key][1]))
    assert (models["gpt2"] / "config.json").is_file()  # a folder --save refused is left alone


def test_without_transformers_an_hf_model_says_how_to_install_it(bad_runs: dict[str, Any]) -> None:
    assert_one_error_line(bad_runs["no-transformers"], "transformers", "pip install -e '.[hf]'")


def test_importing_the_package_never_needs_transformers() -> None:
    modules = ", ".join(
        ["p2p_cocodc", "p2p_cocodc.cli.main", "p2p_cocodc.models.hf", "p2p_cocodc.models.gpt"]
        + ["p2p_cocodc.run.simulator", "p2p_cocodc.peer.node"]
    )
    code = f"import sys; {NO_TRANSFORMERS}; import {modules}; print('ok')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "ok", proc.stderr


# ---- a swarm of two peers, each with its own copy of the model ----


def test_two_peers_with_the_model_at_different_paths_hold_one_global(
    models: dict[str, Path], tmp_path: Path
) -> None:
    for i in range(2):
        shutil.copytree(models["llama-tied"], tmp_path / f"region{i}" / "model")
    boot = start_bootstrap(tmp_path)
    peers = []
    try:
        for i in range(2):
            args = ["join", "--bootstrap", boot.host_port, "--model", f"hf:region{i}/model"]
            args += ["--data", str(models["data"]), *SMALL, "--shard", f"{i}/2", "--run-id", "hf"]
            args += ["--pace", "fixed", "--out", f"p{i}.jsonl"]
            peers.append(spawn(args, tmp_path, f"p{i}.log"))
        for i, peer in enumerate(peers):
            assert peer.wait(timeout=180) == 0, (tmp_path / f"p{i}.log").read_text()[-3000:]
    finally:
        for proc in [*peers, boot.proc]:
            end_group(proc)
    first, second = (records(tmp_path / f"p{i}.jsonl")[-1] for i in range(2))
    assert first["rounds_done"] >= 2 and first["rounds_failed"] == 0
    assert first["global_params_sha256"] == second["global_params_sha256"]
    simulated = run_cli(
        [
            "simulate",
            "--model",
            f"hf:{models['llama-tied']}",
            "--data",
            str(models["data"]),
            *SMALL,
            "--out",
            "sim.jsonl",
        ],
        tmp_path,
        timeout=120,
    )
    assert simulated.returncode == 0, simulated.stderr
    assert records(tmp_path / "sim.jsonl")[-1]["global_params_sha256"] == first["global_params_sha256"]
