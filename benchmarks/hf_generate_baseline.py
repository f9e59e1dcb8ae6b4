"""HF transformers baseline for the offline throughput pass's shape.

32 prompts of ~120 tokens (the same prompts as ``python -m jaxserve.main
--mode bench``: ``workloads.corpus_slices``), 128 new tokens each, EOS
ignored, f32 on CPU, one batched ``generate`` with left padding
(``peers.run_hf``, the serving and throughput benchmarks' HF peer). Prints
output tokens/s of an untimed and a timed pass. Not a test.

    python benchmarks/hf_generate_baseline.py [--num_requests 32]
"""

import argparse
import time

import torch
import transformers

from checkpoints.fetch import resolve_model
from checkpoints.gguf_loader import load_gguf
from jaxserve.bench import peers
from jaxserve.bench.workloads import BenchRequest, corpus_slices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num_requests", type=int, default=32)
    ap.add_argument("--input_len", type=int, default=120)
    ap.add_argument("--output_len", type=int, default=128)
    args = ap.parse_args()
    path = resolve_model("smollm2-135m")
    ck = load_gguf(path, show_progress=False)
    reqs = [BenchRequest("offline", p, args.output_len) for p in corpus_slices(
        ck.tokenizer, ck.config.vocab_size, args.num_requests, args.input_len, seed=0)]
    model = peers.load_hf(path)
    for label in ("warm-up", "timed"):
        t0 = time.monotonic()
        recs = peers.run_hf(model, reqs, len(reqs))  # one static batch of all of them
        wall = time.monotonic() - t0
        n_out = sum(r.output_tokens for r in recs)
        print(f"HF transformers {transformers.__version__} {label}: {n_out} output tokens "
              f"in {wall:.2f} s = {n_out / wall:.1f} output tokens/s "
              f"(torch threads {torch.get_num_threads()})", flush=True)


if __name__ == "__main__":
    main()
