"""Random-access document sources over raw corpora, for `grain.MapDataset.source(...)`.

Each source is a sequence of documents: `__len__()`, `__getitem__(i)` and a one-line
`describe()`. The text sources (`TextFileSource`, `JsonlSource`, `ParquetSource`) return `str`;
tokenization is a later map step. `ArrayRecordTokenSource` returns pre-tokenized int32 arrays and
also offers the pipeline's `doc_lengths()` / `read(doc, start, stop)` protocol.

Sources pickle into grain's worker processes: they hold paths and small indexes, never open
files. Files open lazily in the process (and thread-safe under a lock) that reads them, and are
reopened after a fork, since a forked child shares its parent's file offsets.

Errors in the data raise `DataError`, whose message names the file (and line, byte or row) and
the fix, so the CLI can print it as one line.
"""

from jaxtrain.data.sources.arrayrecord import ArrayRecordTokenSource, write_array_record_shard
from jaxtrain.data.sources.arrayrecord import LENGTHS_SUFFIX
from jaxtrain.data.sources.common import DataError, check_mixture_weights, resolve_paths
from jaxtrain.data.sources.jsonl import JsonlSource, nonblank_line_starts
from jaxtrain.data.sources.parquet import ParquetSource
from jaxtrain.data.sources.text import TextFileSource

__all__ = [
    "ArrayRecordTokenSource", "DataError", "JsonlSource", "LENGTHS_SUFFIX", "ParquetSource",
    "TextFileSource", "check_mixture_weights", "nonblank_line_starts", "resolve_paths",
    "write_array_record_shard",
]
