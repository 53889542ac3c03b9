"""The command line of `python -m jaxtrain.interop.hf`: its arguments, and errors as one line.

The commands themselves (`import_command`, `export_command`) are in hf_commands.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxtrain import storage
from jaxtrain.config import ConfigError
from jaxtrain.interop import hf_config
from jaxtrain.interop.hf_commands import export_command, import_command
from jaxtrain.interop.hf_config import HFFormatError


def parse_size(text: str) -> int:
  """"5GB", "500MB", "2e9" -> bytes (decimal units, as transformers' max_shard_size)."""
  units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
  t = text.strip().upper()
  for suffix, scale in units.items():
    if t.endswith(suffix):
      return int(float(t[:-len(suffix)]) * scale)
  return int(float(t))


class _Parser(argparse.ArgumentParser):
  """argparse that reports a bad command line as one line and exit code 2."""

  def error(self, message):
    print(f"error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def _parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m jaxtrain.interop.hf",
              description="Hugging Face (Llama, Qwen3, Qwen2, Mistral, Gemma 3) <-> "
                                  "jaxtrain weights.")
  sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
  imp = sub.add_parser("import", help="HF directory -> weights directory for "
                       "--config.checkpoint.init_from")
  imp.add_argument("--hf_dir", required=True,
                   help="directory with config.json + *.safetensors (a path, s3:// or gs:// URL)")
  imp.add_argument("--out", required=True,
                   help="weights directory to create (a path, s3:// or gs:// URL)")
  imp.add_argument("--dtype", default="float32", choices=hf_config.DTYPES,
                   help="dtype the weights are stored in (default float32)")
  imp.add_argument("--mtp_depth", type=int, default=None,
                   help="DeepSeek-V3: multi-token-prediction layers to keep (default: every one "
                        "the checkpoint holds; 0 leaves them out)")
  exp = sub.add_parser("export", help="run checkpoint or weights directory -> HF directory")
  exp.add_argument("--checkpoint", required=True,
                   help="weights directory, run workdir, or checkpoint step directory (a path, "
                        "s3:// or gs:// URL)")
  exp.add_argument("--config", default=None,
                   help="config file of the model (default: CHECKPOINT/config.py, else the "
                        "config a run saved with its checkpoint)")
  exp.add_argument("--out", required=True,
                   help="Hugging Face directory to create (a path, s3:// or gs:// URL)")
  exp.add_argument("--dtype", default=None, choices=hf_config.DTYPES,
                   help="dtype of the written tensors (default: the parameters' dtype)")
  exp.add_argument("--max_shard_size", default="5GB",
                   help="split the safetensors into files of at most this size (default 5GB)")
  exp.add_argument("--rope_spelling", default="rope_parameters",
                   choices=hf_config.ROPE_SPELLINGS,
                   help="rope_parameters (transformers >= 5) or rope_scaling (older readers)")
  exp.add_argument("--overwrite", action="store_true",
                   help="replace weights and config.json already in --out")
  return p


def _where(path: str) -> str:
  return path.rstrip("/") if storage.is_url(path) else os.path.abspath(path)


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  try:
    if args.command == "import":
      command = import_command(args.hf_dir, args.out, args.dtype, args.mtp_depth)
      how = "download it and train from it" if storage.is_url(args.out) else "train from it"
      print(f"wrote {_where(args.out)}; {how} with:\n{command}")
    else:
      try:
        max_bytes = parse_size(args.max_shard_size)
      except ValueError:
        raise HFFormatError(f"--max_shard_size={args.max_shard_size!r}: expected a size such "
                            f"as 5GB or 500MB") from None
      files = export_command(args.checkpoint, args.config, args.out, args.dtype, max_bytes,
                             args.rope_spelling, args.overwrite)
      print(f"wrote {_where(args.out)}: {', '.join(files)}")
  # A StorageError (a DataError) is a bucket or URL the user can fix, as a ConfigError is.
  except (ConfigError, storage.StorageError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  return 0
