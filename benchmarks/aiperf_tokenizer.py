"""Writes a byte-level Hugging Face tokenizer (one token per UTF-8 byte, like the bundled pair's)
for standard OpenAI-API load generators that count tokens themselves (aiperf's --tokenizer), so
their input/output token counts match the server's on a machine without network access.

    python benchmarks/aiperf_tokenizer.py /tmp/byte_tokenizer
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/byte_tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
