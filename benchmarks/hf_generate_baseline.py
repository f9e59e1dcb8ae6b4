"""HF transformers baseline for the throughput benchmark's shape.

32 prompts of ~120 tokens (the same prompts as ``python -m jaxserve.main
--mode bench``), 128 new tokens each, EOS ignored, f32 on CPU, one batched
``generate`` call with left padding. Prints output tokens/s. Not a test.

    python benchmarks/hf_generate_baseline.py [--num_requests 32]
"""

import argparse
import time

import torch
import transformers

from checkpoints.fetch import resolve_model
from checkpoints.gguf_loader import load_gguf
from jaxserve.bench.throughput import make_prompts


class _PromptSource:
    """Just enough of an Engine for ``make_prompts``."""

    def __init__(self, tokenizer, vocab_size):
        self.tokenizer = tokenizer
        self.model_config = type("C", (), {"vocab_size": vocab_size})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_requests", type=int, default=32)
    ap.add_argument("--input_len", type=int, default=120)
    ap.add_argument("--output_len", type=int, default=128)
    args = ap.parse_args()
    path = resolve_model("smollm2-135m")
    ck = load_gguf(path, show_progress=False)
    prompts = make_prompts(_PromptSource(ck.tokenizer, ck.config.vocab_size),
                           args.num_requests, args.input_len, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, torch_dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        for label in ("warm-up", "timed"):
            t0 = time.monotonic()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False,
                                 pad_token_id=0)
            wall = time.monotonic() - t0
            n_out = (out.shape[1] - width) * out.shape[0]
            print(f"HF transformers {transformers.__version__} {label}: {n_out} output tokens "
                  f"in {wall:.2f} s = {n_out / wall:.1f} output tokens/s "
                  f"(torch threads {torch.get_num_threads()})", flush=True)


if __name__ == "__main__":
    main()
