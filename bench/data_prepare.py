"""Time the data pipeline: prepare_embedded (BPE and GPT-2) and loader throughput.

Run: ``.venv/bin/python bench/data_prepare.py``. Prints wall times; the machine's load
matters (HF tokenizers uses every core).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from nanoshampoo.data.loader import DistributedTokenLoader
from nanoshampoo.data.prepare import prepare_embedded


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        for tokenizer in ("bpe", "gpt2"):
            out = Path(tmp) / tokenizer
            start = time.perf_counter()
            data = prepare_embedded(out, tokenizer=tokenizer)
            fresh = time.perf_counter() - start
            start = time.perf_counter()
            prepare_embedded(out, tokenizer=tokenizer)
            cached = time.perf_counter() - start
            print(
                f"prepare_embedded tokenizer={tokenizer}: {fresh:.2f} s fresh, "
                f"{cached:.3f} s cached; {data.train_tokens} train / {data.val_tokens} val "
                f"tokens, vocab {data.vocab_size}"
            )
        loader = DistributedTokenLoader(data.train_pattern, 64, 1024, 0, 8)
        steps = 200
        start = time.perf_counter()
        for _ in range(steps):
            loader.next_batch()
        elapsed = time.perf_counter() - start
        print(
            f"loader next_batch (8 x 1024 tokens per rank): {1e3 * elapsed / steps:.3f} ms/step, "
            f"{steps * 8 * 1024 / elapsed / 1e6:.1f} M tokens/s"
        )


if __name__ == "__main__":
    main()
