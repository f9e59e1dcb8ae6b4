"""Greedy answers of SmolLM2-135M (Q4_1 GGUF) to 24 chat questions, first 16
tokens: jaxserve in each ``--quantization`` named on the command line (default
none gguf gguf_a16 gguf_a8) against llama.cpp (the same prompt token ids; top_k=1,
no repeat penalty). Prints how many of the 24 token sequences each pair shares and
the decoded answers; writes result.json in the current folder. Run from a result
folder: ``python ../survey.py [FORMAT ...]`` (llama-cpp-python from the ``peers``
extra; ``epyc_stop49/`` ran ``none gguf gguf_a8``)."""

import glob
import json
import os
import sys

from jaxserve import LLM, SamplingParams

QS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Who wrote Romeo and Juliet?",
    "What is the boiling point of water in Celsius?",
    "Give me a synonym for happy.",
    "What is photosynthesis?",
    "Translate 'thank you' into Spanish.",
    "What is the largest planet in the solar system?",
    "How many days are in a leap year?",
    "What does CPU stand for?",
    "Write a haiku about the sea.",
    "What is the chemical symbol for gold?",
    "Explain what a hash table is in one sentence.",
    "Who painted the Mona Lisa?",
    "What is the square root of 81?",
    "Name a mammal that can fly.",
    "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?",
    "List two benefits of exercise.",
    "What is the speed of light?",
    "Who was the first president of the United States?",
    "What is the tallest mountain on Earth?",
]
N = 16
sp = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
res = {}
FORMATS = sys.argv[1:] or ["none", "gguf", "gguf_a16", "gguf_a8"]
for q in FORMATS:
    llm = LLM("smollm2-135m", quantization=q, num_pages=256)
    ids = [list(llm.apply_chat_template([{"role": "user", "content": x}])) for x in QS]
    outs = llm.chat([[{"role": "user", "content": x}] for x in QS], sp)
    res[q] = [list(o.outputs[0].token_ids) for o in outs]
    tok = llm.engine.tokenizer
    del llm
from llama_cpp import Llama

path = glob.glob(os.path.expanduser("~/.cache/jaxserve/smollm2-135m/*.gguf"))[0]
ll = Llama(model_path=path, n_ctx=512, verbose=False, n_threads=2)
res["llama.cpp"] = []
for i in ids:
    out = []
    for t in ll.generate(i, top_k=1, temp=0.0, repeat_penalty=1.0):
        out.append(t)
        if len(out) == N:
            break
    ll.reset()
    res["llama.cpp"].append(out)
names = list(res)
print("first-16-token sequences equal, out of", len(QS))
for a in names:
    print(f"{a:10s}", " ".join(f"{b}:{sum(x == y for x, y in zip(res[a], res[b]))}" for b in names))
for j, x in enumerate(QS[:24]):
    print(
        repr(x[:30]),
        "|",
        *(repr(tok.decode(res[n][j])[:40]) for n in [*FORMATS, "llama.cpp"] if n != "gguf"),
    )
json.dump(res, open("result.json", "w"))
