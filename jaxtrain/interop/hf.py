"""Hugging Face import/export of every model family: `load_model`, `save_model`, and the CLI
around them (its two commands in hf_commands.py, its arguments in hf_cli.py).

    model, config = load_model("Qwen3-0.6B/")          # config.json + *.safetensors
    logits_BTV = model(input_ids_BT)                     # float32 [B, T, V]
    save_model(model, config, "exported/")               # loads with Qwen3ForCausalLM

config.json's `model_type` picks the family (llama, qwen3, qwen2, mistral, gemma3_text, and the
language model of a multimodal gemma3 checkpoint, whose vision tower is left out) and sets
`model.family`; export writes the family's *ForCausalLM.

A reward model is a *ForSequenceClassification with one label (`architectures`): its score head
`score.weight` [1, D] imports as `score_D1` [D, 1] (`model.score_head`), the model's call gives
scores [B, T], and export writes the family's *ForSequenceClassification back (hf_config.py,
hf_export_config.py: num_labels, pad_token_id).

    model, config = load_model("reward-model/")        # LlamaForSequenceClassification
    scores_BT = model(input_ids_BT)                      # float32 [B, T]
    rewards_B = sequence_rewards(model, input_ids_BT, attention_mask_BT)  # objectives/reward/loss.py

    python -m jaxtrain.interop.hf import --hf_dir=DIR --out=WEIGHTS_DIR [--dtype=bfloat16]
    python -m jaxtrain.interop.hf export --checkpoint=RUN_OR_WEIGHTS_DIR [--config=CONFIG.py]
        --out=HF_DIR

Reading and writing are in hf_io.py (streamed shard by shard: host memory holds one shard at a
time), the tensor names and layouts in hf_weights.py, the config.json mapping in hf_config.py.
This module is the public face: these two functions and the command line.
"""

from __future__ import annotations

import sys

from jaxtrain.interop import hf_cli
from jaxtrain.interop.hf_io import load_model, save_model

__all__ = ["load_model", "main", "save_model"]


def main(argv: list[str] | None = None) -> int:
  """`python -m jaxtrain.interop.hf import|export ...`; the command line is parsed in hf_cli.py."""
  return hf_cli.main(argv)


if __name__ == "__main__":
  # Entry point: choose the backends before JAX starts one.
  from jaxtrain import platforms  # pylint: disable=import-outside-toplevel
  platforms.choose_jax_platforms()
  sys.exit(main())
