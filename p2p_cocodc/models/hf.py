"""Hugging Face causal language models as the model of a run: ``--model hf:PATH_OR_NAME``.

PATH_OR_NAME is a local folder holding a ``config.json`` and a tokenizer (what ``save_pretrained``
writes), or the name of a model already in the local Hugging Face cache. Nothing is ever
downloaded. With weights in the folder the run starts from them; without, the model is built from
its config and initialised with the run's ``--seed``. Weights are float32 whatever the checkpoint
holds (the master weights of every replica and θ̄ are fp32; ``--precision bf16`` adds autocast).

transformers is an optional extra (``pip install -e '.[hf]'``): it is imported here, inside the
functions that need it, so importing p2p_cocodc never needs it.

The model's fragment units come from its layer list: its embeddings (and whatever the model
registers before its decoder layers), each decoder layer, then the final norm and the ``lm_head``
(the head only when it is not tied to the embedding). The HF model runs in eval mode even while
training (no dropout, no router noise), so an inner step is a pure function of the weights and the
batch, as swarm ≡ simulator needs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from p2p_cocodc.config.train import FIELDS, TrainConfig
from p2p_cocodc.errors import UserError
from p2p_cocodc.models.units import check_fragment_units
from p2p_cocodc.names import HF_PREFIX
from p2p_cocodc.run.records import params_sha256

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
PROBE_TOKENS = 8  # length of the sequence the causality probe runs
# config keys that name where or by what a config was read, not what the model is
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")


def is_hf_model(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


# ---- transformers, quietly ----


def _transformers(spec: str) -> ModuleType:
    try:
        import transformers
    except ImportError:
        raise UserError(
            f"--model {spec} needs the transformers package, which is not installed: pip install -e '.[hf]'"
        ) from None
    return transformers


@contextlib.contextmanager
def _quiet(transformers: ModuleType) -> Iterator[None]:
    """transformers' warnings and progress bars off while it works for us: a run's stderr is ours."""
    hf_logging = transformers.utils.logging
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# ---- where the model is, and what it is ----


def _folder(spec: str) -> Path:
    """The local folder of ``hf:PATH_OR_NAME``: PATH itself, or NAME's snapshot in the HF cache."""
    name = spec[len(HF_PREFIX) :]
    if not name:
        raise UserError("--model hf: needs a model: hf:PATH (a folder with config.json and a tokenizer)")
    folder = Path(name).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise UserError(
                f"--model {spec}: {folder} has no config.json; give the folder a Hugging Face model "
                "was saved to (model.save_pretrained and tokenizer.save_pretrained)"
            )
        return folder
    if folder.exists():
        raise UserError(f"--model {spec}: {folder} is a file; give the model's folder (with its config.json)")
    cached = _cached_snapshot(name)
    if cached is None:
        raise UserError(
            f"--model {spec}: no such folder, and no model {name!r} in the local Hugging Face cache "
            "(nothing is downloaded); give a folder with config.json and a tokenizer"
        )
    return cached


def _cached_snapshot(name: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repository name (a path, say): not in the cache either
        return None
    return Path(found).parent if isinstance(found, str) else None


def _config(spec: str, folder: Path, transformers: ModuleType) -> Any:
    """The model's config, if it is a causal language model."""
    try:
        with _quiet(transformers):
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise UserError(f"--model {spec}: cannot read {folder / 'config.json'}: {_first_line(exc)}") from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = config.architectures or []
    if (
        getattr(config, "is_encoder_decoder", False)
        or config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        or (architectures and not any(a in causal or a.endswith("ForCausalLM") for a in architectures))
    ):
        raise UserError(_not_causal(spec, config))
    return config


def _not_causal(spec: str, config: Any) -> str:
    kind = ", ".join(config.architectures or []) or f"model type {config.model_type!r}"
    return (
        f"--model {spec}: {kind} is not a causal (decoder-only) language model; give one that "
        "AutoModelForCausalLM loads, such as Llama, Qwen, Mistral or GPT-2"
    )


def _check_seq_len(spec: str, config: Any, seq_len: int) -> None:
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UserError(
            f"--seq-len {seq_len} is beyond the max_position_embeddings {limit} of --model {spec}; "
            f"lower --seq-len to at most {limit}"
        )


def _config_sha256(config: Any) -> str:
    """sha256 of the config as JSON, without the keys that say where it was read from."""
    values = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()


# ---- tokenizer ----


class PretrainedTokenizer:
    """A Hugging Face tokenizer as data.py's ``Tokenizer``: ids without special tokens (documents
    are joined with a blank line, as with the other tokenizers)."""

    name = "hf"

    def __init__(self, tokenizer: Any, transformers_version: str) -> None:
        self._tokenizer = tokenizer
        self.vocab_size: int = len(tokenizer)
        self.fingerprint: str = _tokenizer_sha256(tokenizer, transformers_version)

    def encode(self, text: str) -> list[int]:
        if getattr(self._tokenizer, "is_fast", False):  # the Rust tokenizer: fast, and no length warnings
            return self._tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        return self._tokenizer.convert_tokens_to_ids(self._tokenizer.tokenize(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


def _tokenizer_sha256(tokenizer: Any, transformers_version: str) -> str:
    """sha256 over the tokenizer as it saves itself (and the transformers version, whose code may
    tokenize differently): the token cache key, so an hf tokenizer never reuses another's ids."""
    digest = hashlib.sha256(f"{type(tokenizer).__name__} {transformers_version}".encode())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for file in sorted(Path(folder).rglob("*")):
            if file.is_file():
                digest.update(file.relative_to(folder).as_posix().encode() + b"\0")
                digest.update(file.read_bytes())
    return digest.hexdigest()


def _load_tokenizer(spec: str, folder: Path, transformers: ModuleType) -> Any:
    try:
        with _quiet(transformers):
            return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:
        raise UserError(
            f"--model {spec}: no tokenizer in {folder} that AutoTokenizer loads "
            f"({_first_line(exc)[:200].rstrip(':')}); save the model's tokenizer there with "
            "tokenizer.save_pretrained(FOLDER)"
        ) from None


def hf_tokenizer(cfg: TrainConfig) -> PretrainedTokenizer:
    """The tokenizer in the folder of the run's hf: model, after the checks that need no weights
    (folder, causal LM, --seq-len), so bad input fails before the corpus is tokenized."""
    spec = cfg.model
    transformers = _transformers(spec)
    if cfg.tokenizer != FIELDS["tokenizer"].default:  # --tokenizer given
        raise UserError(
            f"--tokenizer {cfg.tokenizer}: an hf: model tokenizes with the tokenizer in its folder; "
            "leave --tokenizer out"
        )
    folder = _folder(spec)
    config = _config(spec, folder, transformers)
    _check_seq_len(spec, config, cfg.seq_len)
    tokenizer = PretrainedTokenizer(_load_tokenizer(spec, folder, transformers), transformers.__version__)
    vocab = config.get_text_config().vocab_size
    if tokenizer.vocab_size > vocab:
        raise UserError(
            f"--model {spec}: its tokenizer has {tokenizer.vocab_size} tokens but the model only "
            f"{vocab} (vocab_size in config.json); give the tokenizer the model was made for"
        )
    return tokenizer


# ---- the model ----


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM as the trainer sees a model: ``model(idx) -> logits`` and
    ``fragment_units()``.

    Its parameters are the HF model's, named with an ``hf.`` prefix. A tied copy (an ``lm_head``
    that is the input embedding) is left out of state dicts and filled in on load, so θ̄ holds
    each tensor once and an averaged embedding is never overwritten by a replica's stale head.
    """

    def __init__(self, lm: nn.Module, folder: Path, config_sha256: str) -> None:
        super().__init__()
        self.hf = lm
        self.folder = folder  # where the tokenizer is, for --save
        self.config_sha256 = config_sha256
        self.hf.eval()
        first: dict[int, str] = {}
        self.tied: dict[str, str] = {}  # name of a tied copy -> name of the parameter it is
        for name, param in self.named_parameters(remove_duplicate=False):
            if id(param) in first:
                self.tied[name] = first[id(param)]
            else:
                first[id(param)] = name
        self.register_state_dict_post_hook(_drop_tied_copies)
        self.register_load_state_dict_pre_hook(_fill_tied_copies)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=idx, use_cache=False).logits

    def train(self, mode: bool = True) -> HFCausalLM:
        """Eval mode for the HF model always: no dropout, so steps are deterministic."""
        super().train(mode)
        self.hf.eval()
        return self

    def fragment_units(self) -> list[list[str]]:
        """Embeddings (and all registered before the layers), each decoder layer, then the final
        norm and the untied lm_head (and all registered after the layers)."""
        layers_prefix, count = _decoder_layers(self.hf)
        layers_prefix = f"hf.{layers_prefix}."
        head = self.hf.get_output_embeddings()
        head_ids = {id(p) for p in head.parameters()} if head is not None else set()
        embed_ids = {id(p) for p in self.hf.get_input_embeddings().parameters()}
        units: list[list[str]] = [[] for _ in range(count + 2)]
        after_layers = False
        for name, param in self.named_parameters():
            if not param.requires_grad:
                continue
            if name.startswith(layers_prefix):
                units[1 + int(name[len(layers_prefix) :].split(".")[0])].append(name)
                after_layers = True
            elif id(param) in embed_ids or (not after_layers and id(param) not in head_ids):
                units[0].append(name)
            else:
                units[-1].append(name)
        return [unit for unit in units if unit]


def _drop_tied_copies(module: HFCausalLM, state: dict[str, Any], prefix: str, metadata: Any) -> None:
    for name in module.tied:
        state.pop(prefix + name, None)


def _fill_tied_copies(module: HFCausalLM, state: dict[str, Any], prefix: str, *args: Any) -> None:
    for name, source in module.tied.items():
        if prefix + name not in state and prefix + source in state:
            state[prefix + name] = state[prefix + source]


def _decoder_layers(lm: nn.Module) -> tuple[str, int]:
    """Name and length of the model's decoder layer list: the ModuleList of num_hidden_layers
    modules holding the most parameters (any ModuleList if the config does not say)."""
    count = getattr(lm.config.get_text_config(), "num_hidden_layers", None)
    lists = [(name, m) for name, m in lm.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    candidates = [(name, m) for name, m in lists if len(m) == count] or lists
    if not candidates:
        raise UserError(f"{type(lm).__name__} has no list of decoder layers to make fragment units of")
    name, layers = max(candidates, key=lambda item: sum(p.numel() for p in item[1].parameters()))
    return name, len(layers)


def build_hf_model(spec: str, vocab_size: int, seq_len: int) -> HFCausalLM:
    """The model of ``hf:PATH_OR_NAME`` in float32: its weights if the folder has them, else built
    from its config with the torch seed the caller set."""
    transformers = _transformers(spec)
    folder = _folder(spec)
    config = _config(spec, folder, transformers)
    _check_seq_len(spec, config, seq_len)
    if vocab_size > config.get_text_config().vocab_size:
        raise UserError(
            f"--model {spec}: the data has {vocab_size} token ids but the model only "
            f"{config.get_text_config().vocab_size}; use the model's own tokenizer"
        )
    dtype_key = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
    auto = transformers.AutoModelForCausalLM
    try:
        with _quiet(transformers):
            if any((folder / name).is_file() for name in WEIGHT_FILES):
                lm = auto.from_pretrained(
                    folder, config=config, local_files_only=True, **{dtype_key: torch.float32}
                )
            else:
                lm = auto.from_config(config, **{dtype_key: torch.float32})
    except Exception as exc:
        raise UserError(f"--model {spec}: cannot build it from {folder}: {_first_line(exc)[:300]}") from None
    model = HFCausalLM(lm.float(), folder, _config_sha256(config))
    _check_causal(spec, model, config)
    check_fragment_units(model, spec)
    return model


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def _check_causal(spec: str, model: HFCausalLM, config: Any) -> None:
    """A model that AutoModelForCausalLM builds may still look ahead (a BERT without
    is_decoder): changing the last token must leave the logits of the earlier ones alone."""
    vocab = config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, PROBE_TOKENS), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    with torch.no_grad():
        before, after = model(ids)[:, :-1], model(changed)[:, :-1]
    if (before - after).abs().max() > 1e-5 * max(1.0, float(before.abs().max())):
        raise UserError(_not_causal(spec, config))


def model_identity(spec: str, model: nn.Module) -> str:
    """What peers compare for --model: a preset or plug-in by its spec; an hf: model, which
    regions may keep at different paths or cache names, by content (its config and its initial
    weights)."""
    if not isinstance(model, HFCausalLM):
        return spec
    return f"hf:config-{model.config_sha256[:16]}:params-{params_sha256(model.state_dict())[:16]}"


# ---- a saved model's folder (p2p_cocodc.models.saved) ----


def write_pretrained(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write θ̄ into ``folder`` as ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer
    .from_pretrained`` load it: float32 safetensors weights under the HF model's own names, its
    config, and the tokenizer of the folder the run's model came from (p2p_cocodc.models.saved
    adds its own config and puts the folder in place)."""
    if not isinstance(model, HFCausalLM):
        raise TypeError(f"write_pretrained needs the run's HFCausalLM, not a {type(model).__name__}")
    transformers = _transformers(f"{HF_PREFIX}{model.folder}")
    # a tied copy is not in θ̄: save_pretrained ties it again
    hf_state = {name.removeprefix("hf."): t.detach().to("cpu", torch.float32) for name, t in state.items()}
    with _quiet(transformers):
        model.hf.save_pretrained(folder, state_dict=hf_state)
        tokenizer = transformers.AutoTokenizer.from_pretrained(model.folder, local_files_only=True)
        tokenizer.save_pretrained(folder)


def folder_tokenizer(spec: str) -> PretrainedTokenizer:
    """The tokenizer in the folder of ``hf:PATH`` (a saved model's), without a run's checks."""
    transformers = _transformers(spec)
    return PretrainedTokenizer(_load_tokenizer(spec, _folder(spec), transformers), transformers.__version__)
