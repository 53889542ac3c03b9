"""Input data: the zero-download stdlib byte corpus and the Grain packing pipeline."""

from jaxtrain.data.documents import SOURCES
from jaxtrain.data.documents import load_mixture
from jaxtrain.data.documents import load_sources
from jaxtrain.data.pipeline import BATCH_KEYS
from jaxtrain.data.pipeline import make_eval_batches
from jaxtrain.data.pipeline import make_train_iterator
from jaxtrain.data.pipeline import packed_batch_dataset
from jaxtrain.data.pipeline import packing_stats
from jaxtrain.data.pipeline import piece_index
from jaxtrain.data.pipeline import reads_global_stream
from jaxtrain.data.pipeline import summary
from jaxtrain.data.stdlib_corpus import BYTE_VOCAB_SIZE
from jaxtrain.data.stdlib_corpus import ByteDocumentSource
from jaxtrain.data.stdlib_corpus import EOS_ID
from jaxtrain.data.stdlib_corpus import unigram_entropy

__all__ = [
    "BATCH_KEYS", "BYTE_VOCAB_SIZE", "EOS_ID", "SOURCES", "ByteDocumentSource", "load_mixture",
    "load_sources", "make_eval_batches", "make_train_iterator", "packed_batch_dataset",
    "packing_stats", "piece_index", "reads_global_stream", "summary", "unigram_entropy",
]
