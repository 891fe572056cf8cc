"""The GPT and its presets, and the plug-in path for other models."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from p2p_cocodc.config.train import TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.build import build_model, count_parameters
from p2p_cocodc.models.gpt import PRESETS
from p2p_cocodc.run.records import RunLog
from p2p_cocodc.run.simulator import Simulation


@pytest.mark.parametrize("preset,millions", [("tiny", 1.3), ("small", 4.2), ("base", 15.7)])
def test_preset_sizes_with_bpe_vocabulary(preset: str, millions: float) -> None:
    assert count_parameters(build_model(preset, 4096, 128)) / 1e6 == pytest.approx(millions, rel=0.05)


def test_gpt_is_causal_and_ties_embeddings() -> None:
    torch.manual_seed(0)
    model = build_model("nano", 256, 16).eval()
    x = torch.randint(0, 256, (2, 16))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(y)
    assert a.shape == (2, 16, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert "lm_head.weight" not in model.state_dict()  # the output layer is the embedding


def test_gpt2_init_gives_uniform_starting_perplexity() -> None:
    torch.manual_seed(0)
    model = build_model("tiny", 4096, 64).eval()
    x, targets = torch.randint(0, 4096, (2, 4, 64))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 4096), targets.reshape(-1))
    assert abs(float(loss) - torch.log(torch.tensor(4096.0)).item()) < 0.1


@pytest.mark.parametrize("preset", list(PRESETS))
def test_fragment_units_list_every_parameter_once(preset: str) -> None:
    model = build_model(preset, 256, 32)
    names = [n for unit in model.fragment_units() for n in unit]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    assert len(model.fragment_units()) == PRESETS[preset][0] + 2


def test_plugin_model_trains_in_the_simulator() -> None:
    cfg = TrainConfig(
        model="tests.plugin_models:two_layer",
        tokenizer="byte",
        seq_len=16,
        batch_size=4,
        workers=2,
        steps=16,
        inner_steps=4,
        fragments=2,
        overlap=1,
        eval_every=8,
        eval_batches=2,
        step_time=0.05,
        lr=1e-2,
        warmup=2,
    )
    summary = Simulation(cfg.validate()).run(RunLog(None))
    assert summary["num_params"] == 256 * 32 + 32 * 256 + 256
    assert summary["final_val_ppl"] < summary["initial_val_ppl"]
    with pytest.raises(UserError, match="--fragments 3 must be between 1 and the model's 2 units"):
        Simulation(replace(cfg, fragments=3).validate())


@pytest.mark.parametrize(
    "spec,message",
    [
        ("tests.plugin_models:missing_unit", r"exactly once \(missing \['head.bias'\]"),
        ("tests.plugin_models:no_units", "must be a torch.nn.Module with a fragment_units"),
        ("tests.plugin_models:nothing_here", "cannot load model factory"),
        ("no_such_module_xyz:factory", "cannot load model factory"),
        ("huge", "unknown model 'huge': use a preset"),
    ],
)
def test_bad_model_specs_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_model(spec, 256, 16)
