"""Training pieces the worker loop uses: the offline corpus, its byte tokenizer and batches, and the model."""

from .corpus import Batches as Batches
from .corpus import CorpusError as CorpusError
from .corpus import decode as decode
from .corpus import encode as encode
from .corpus import load_corpus as load_corpus
from .corpus import load_tokens as load_tokens
from .model import GPT as GPT
from .model import GPTConfig as GPTConfig
