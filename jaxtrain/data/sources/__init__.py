"""Random-access document sources, for `grain.MapDataset.source(...)`.

Each source is a sequence of documents: `__len__()`, `__getitem__(i)` and a one-line
`describe()`. The text sources (`TextFileSource`, `JsonlSource`, `ParquetSource`) return `str`;
tokenization is a later map step. `PreparedCorpus` reads a corpus tokenized once by
`python -m jaxtrain.data.prepare` (flat token arrays written by `write_token_shard`, memory-mapped)
and returns int32 arrays; it also offers the pipeline's `doc_lengths()` / `read(doc, start, stop)`
protocol, reading just the slice asked for. The text sources' paths may be s3:// or gs:// URLs
and globs: each object is downloaded once into a local cache and read there (remote_files.py).

Sources pickle into grain's worker processes: they hold paths and small indexes, never open
files or maps. Files open lazily in the process that reads them (a handle shared by read threads
is used under a lock) and are reopened after a fork, since a forked child shares its parent's
file offsets; memory maps, which have no offset, are opened once per process and shared.

Errors in the data raise `DataError`, whose message names the file (and line, byte or row) and
the fix, so the CLI can print it as one line.
"""

from jaxtrain.data.sources.common import DataError, check_mixture_weights, resolve_paths
from jaxtrain.data.sources.jsonl import JsonlSource, nonblank_line_starts
from jaxtrain.data.sources.parquet import ParquetSource
from jaxtrain.data.sources.prepared import PreparedCorpus, token_dtype, write_token_shard
from jaxtrain.data.sources.text import TextFileSource

__all__ = [
    "DataError", "JsonlSource", "ParquetSource", "PreparedCorpus", "TextFileSource",
    "check_mixture_weights", "nonblank_line_starts", "resolve_paths", "token_dtype",
    "write_token_shard",
]
