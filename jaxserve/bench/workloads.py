"""Benchmark workloads named by the shape of their requests.

| workload | prompt tokens | output tokens | what it stands for |
|---|---|---|---|
| ``chat`` | ~100 | 200 | a chat turn: a little context and a question |
| ``rag`` | ~1,200 | 50 | retrieval-augmented: long documents, short answer |
| ``creative`` | ~20 | 400 | a short instruction, a long piece of writing |
| ``shared-prefix`` | 1,000 + ~20 | 100 | one fixed 1,000-token system prompt, varied questions |
| ``mixed`` | | | the four above in equal parts, in a seeded random order (each run of 4 requests has one of each) |

Prompts are real English text: the sentences of ``CORPUS`` (prose written for
this benchmark on everyday subjects, shipped here so nothing is downloaded),
shuffled by a seeded ``numpy`` generator, tokenized with the model's own
tokenizer and cut at the drawn length, so a prompt may end mid-sentence;
``chat``, ``rag`` and ``shared-prefix`` prompts end with one of ``QUESTIONS``,
``creative`` prompts start with one of ``CREATIVE_TASKS``. Prompt lengths are
drawn uniformly within +-10% of the target (``shared-prefix``: the system
prompt is exactly its target, the question adds its own length). Every
``chat``/``rag``/``creative`` prompt opens with a unique tag, so no two share
a prefix-cache page; ``shared-prefix`` prompts share the whole system prompt.
Outputs are exactly ``output_len`` tokens (greedy, EOS ignored), so every
engine produces the same shapes.

``scale`` multiplies every prompt and output length (``--scale 0.2`` for a
quick look on a slow machine; results then describe that smaller shape).
A model without a tokenizer gets seeded random token ids of the same lengths.

Every other benchmark's prompts come from here too, from the same text:
W1 and W2 (``comparison``: ``chat``-shaped requests, ``question_prompt`` with
``DOCS_INTRO``), the speculative decoding benchmark's copy tasks, chat
questions and passages (``COPY_TASKS``, ``CHAT_QUESTIONS``, ``passage``), the
prefix-cache benchmark's system prompts and turns (``system_prompt``,
``PREFIX_TURNS``), the offline throughput pass's corpus slices
(``corpus_slices``) and the soak run's sentences (``SENTENCES``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

CORPUS = """\
The harbour wakes before the town does, when the first boats slip their moorings and the gulls \
follow them out past the breakwater. Fishermen still read the sky the way their grandparents \
did, watching the colour of the clouds over the headland and the direction of the swell. A \
good catch depends on the water temperature, the tide and a great deal of patience. By noon \
the fish market is loud with prices called out in a dialect that visitors rarely follow. \
Bread is one of the oldest prepared foods, and its basic recipe has hardly changed in \
thousands of years. Flour, water, salt and yeast are mixed, kneaded and left to rise while the \
yeast turns sugars into gas and flavour. A slow rise in a cool kitchen gives a deeper taste \
than a quick one in a warm room. The crust forms when the surface dries and browns in the hot \
oven, and steam in the first minutes keeps it thin and crisp. Rivers shape the land more \
patiently than any engineer, carving valleys over millions of years and carrying soil down to \
the plains. Where a river slows near the sea it drops its load of silt and builds a delta, a \
flat and fertile fan of land. Many of the first cities grew up on such plains, because \
farmers there could grow more food than they needed. Floods brought both ruin and renewal, \
and early calendars were often built around their timing. The modern bicycle took its shape \
in the late nineteenth century, when the chain drive and two wheels of equal size replaced \
the dangerous high wheeler. Pneumatic tyres made the ride smoother, and within a few years \
cycling clubs had formed in almost every large town. For many workers the bicycle was the \
first machine that let them travel farther than they could walk in a day. Today it remains \
one of the most efficient ways to turn human effort into movement. A library is more than a \
room full of books; it is a promise that knowledge will be kept and shared. Librarians sort, \
repair and catalogue material so that a reader can find a single page among millions. Public \
libraries in the nineteenth century opened reading to people who could never have afforded \
their own books. Now they also lend laptops, run language classes and offer a quiet, warm \
place to anyone who walks in. Bees communicate the location of flowers with a dance that \
encodes both direction and distance. A worker returning to the hive moves in a figure of \
eight, and the angle of the straight run tells the others where to fly relative to the sun. \
A single colony can visit millions of blossoms in a season, and many crops depend on this \
work. When bee populations fall, farmers notice it first in smaller harvests of fruit and \
seeds. Mountains make their own weather, forcing moist air upward until it cools and falls as \
rain or snow. The side facing the wind is often green and wet, while the far side lies in a \
dry rain shadow. Climbers learn to start early, because afternoon storms can build quickly \
over high ridges in summer. Above a certain height trees give way to grass, then to rock and \
permanent ice. The printing press changed how ideas travelled, because a text could be copied \
hundreds of times without a single scribe's mistake. Pamphlets, newspapers and cheap books \
spread arguments faster than authorities could answer them. Spelling slowly became more \
uniform as printers settled on common forms. Within a few generations reading had become a \
skill that ordinary people expected to learn. A well kept garden is a small lesson in \
planning, since what is planted in autumn decides what can be picked in spring. Gardeners \
rotate crops so that pests do not settle and the soil is not drained of the same nutrients \
every year. Compost returns kitchen scraps and fallen leaves to the ground as dark, crumbly \
earth. Even a window box can grow herbs that taste better than anything bought in a shop. \
Trains opened up continents in the nineteenth century, linking ports to farms and mines far \
inland. Standard time zones were introduced largely because railway timetables could not cope \
with every town keeping its own local noon. Stations became the grand public buildings of \
their age, with iron roofs and great clocks above the platforms. High speed lines today carry \
passengers between cities faster than aircraft once the journey to the airport is counted. \
Music is organised sound, yet every culture organises it differently. Some traditions divide \
the octave into twelve steps, others into many more, and rhythm can follow cycles far longer \
than a simple beat of four. Children learn songs before they can read, and melodies often \
stay in memory long after words have faded. Recording made it possible for the first time to \
hear the same performance twice. Good writing is usually rewriting: a first draft finds out \
what the writer wants to say, and later drafts say it clearly. Short sentences carry weight, \
while longer ones can hold a chain of reasoning together. Editors look for the reader's point \
of view, asking where attention will wander and what needs to be explained. The best \
explanations often use a concrete example before a general rule. Clocks divided the day into \
equal hours only after mechanical escapements became reliable. Before that, hours in summer \
were longer than hours in winter, because daylight was simply split into twelve parts. Ships \
needed accurate clocks to find their longitude, and the search for one took decades of work. \
Today the time on a phone is set by signals traceable to atomic clocks that drift less than a \
second in millions of years. A forest is a community in which trees, fungi, insects and birds \
depend on each other. Fungal threads connect the roots of neighbouring trees and trade water \
and minerals for sugars. Fallen wood rots slowly, feeding beetles and the animals that eat \
them. Fire, once feared as pure destruction, is now understood to renew some kinds of forest \
by clearing the ground for seedlings. Cities are experiments in living close together, and \
their success depends on things that are easy to overlook. Clean water, sewers and rubbish \
collection did more for public health than almost any medicine. Parks give people a place to \
meet, to play and to cool down on hot days. Good public transport lets a city grow without \
drowning in traffic. Maps are arguments about what matters, because no map can show \
everything at once. A road atlas leaves out the geology, a geological map leaves out the \
restaurants, and both flatten a round planet onto a page. Sailors once drew coastlines from \
what they could see from the deck, guessing at the land behind. Satellites now measure the \
height of the ground to within a few centimetres.\
"""

QUESTIONS = (
    "What is the main idea of the text above, in two sentences?",
    "Which of the subjects mentioned changed ordinary people's lives the most, and why?",
    "List three facts from the passage that surprised you.",
    "Explain the passage to a ten year old.",
    "What question would you ask the author of this text?",
    "Which sentence in the text is the least convincing, and what evidence would help?",
    "Summarize the text as a short list of bullet points.",
    "How are the bakery and the garden described in similar ways?",
    "What does the passage say about how time was measured?",
    "Write a title for this text and explain your choice.",
    "Which two topics in the text are most closely connected?",
    "What might a city planner learn from the section about forests?",
)

CREATIVE_TASKS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a poem about the first snow of winter in a busy city.",
    "Describe a market day in an imaginary mountain village.",
    "Write a letter from a ship's cook to his sister back home.",
    "Tell the story of a clockmaker who builds a clock that runs backwards.",
    "Write a fable about a bee who is afraid of flowers.",
    "Describe a train journey across a desert at night.",
    "Write a dialogue between a librarian and a lost dragon.",
)

# The speculative decoding benchmark's prompts (``speculation``): copy-heavy
# tasks over a passage of the corpus, and short chat questions.
COPY_TASKS = (
    ("repeat", "Repeat the following text exactly, word for word, without adding anything."),
    ("edit", "Rewrite the following text with British spellings changed to American ones "
             "(harbour -> harbor, colour -> color, organised -> organized). Change nothing "
             "else."),
    ("summarise", "Summarise the following text in a few sentences."),
)
CHAT_QUESTIONS = (
    "What causes the seasons on Earth?", "How do I boil an egg?",
    "Give me three tips for learning a new language.", "Why is the sky blue?",
    "What is the difference between weather and climate?", "How does a bicycle stay upright?",
    "Write a haiku about autumn.", "What should I pack for a weekend camping trip?",
    "Explain what a prime number is.", "How can I sleep better at night?",
    "What is photosynthesis?", "Suggest a name for a small bakery.",
    "How do vaccines work?", "What are the planets of the solar system?",
    "Why do cats purr?", "How do I make a good cup of tea?",
)


SYSTEM_HEADER = ("You are a helpful assistant for a public library. Answer questions politely, "
                 "briefly and only from the reference text below.\n\nReference text:\n")
DOCS_INTRO = "Use the documents below to answer the question.\n\nDocument 1: "
SENTENCES = [s.strip() + "." for s in CORPUS.split(". ") if s.strip()]


@dataclasses.dataclass(frozen=True)
class Shape:
    """A workload's nominal request shape, tokens (before ``scale``)."""

    input_len: int
    output_len: int


SHAPES = {
    "chat": Shape(100, 200),
    "rag": Shape(1200, 50),
    "creative": Shape(20, 400),
    "shared-prefix": Shape(1000, 100),  # input: the system prompt; the question adds ~20
}
WORKLOADS = (*SHAPES, "mixed")


@dataclasses.dataclass
class BenchRequest:
    """One request of a workload.

    Attributes:
      workload: the shape it was drawn from (``"chat"``, ...; never ``"mixed"``).
      prompt_ids: token ids, exactly what every engine is given.
      output_len: tokens to generate (greedy, EOS ignored).
      lora: the LoRA adapter's name (None: the base model; ``serving_lora``).
    """

    workload: str
    prompt_ids: list[int]
    output_len: int
    lora: str | None = None


class Text:
    """Token ids of corpus text, cut to lengths (random ids without a tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, rng: np.random.Generator):
        self.tok, self.vocab, self.rng = tokenizer, vocab_size, rng

    def encode(self, text: str) -> list[int]:
        if self.tok is None:  # about 4 characters per token
            return self.rng.integers(0, self.vocab, size=max(1, len(text) // 4)).tolist()
        return list(self.tok.encode(text, add_special_tokens=False))

    def shuffled(self, n: int) -> list[int]:
        """At least ``n`` token ids of corpus sentences in a random order."""
        out: list[int] = []
        while len(out) < n:
            out += self.encode(" ".join(SENTENCES[i] for i in self.rng.permutation(
                len(SENTENCES))) + " ")
        return out


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def _jitter(rng: np.random.Generator, n: int) -> int:
    lo, hi = max(1, int(n * 0.9)), max(1, int(n * 1.1))
    return int(rng.integers(lo, hi + 1))


def make_requests(tokenizer, vocab_size: int, workload: str, num_prompts: int, *,
                  seed: int = 0, scale: float = 1.0) -> list[BenchRequest]:
    """``num_prompts`` requests of ``workload``; see the module docstring.

    Args:
      tokenizer: the model's tokenizer (``encode(text, add_special_tokens=)``),
        or None for random ids.
      vocab_size: V, for random ids.
      workload: one of ``WORKLOADS``.
      num_prompts: requests to make (>= 1).
      seed: the same seed gives the same requests.
      scale: multiplies every prompt and output length (> 0).

    Raises:
      ValueError: unknown workload, ``num_prompts < 1`` or ``scale <= 0``.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = np.random.default_rng(seed)
    text = Text(tokenizer, vocab_size, rng)
    if workload == "mixed":
        # Blocks of one request of each shape, each block in a random order, so
        # every prefix of 4k requests (a smaller level) holds each shape k times.
        names = [list(SHAPES)[j] for _ in range(-(-num_prompts // len(SHAPES)))
                 for j in rng.permutation(len(SHAPES))][:num_prompts]
    else:
        names = [workload] * num_prompts
    system = None
    if "shared-prefix" in names:
        n = _scaled(SHAPES["shared-prefix"].input_len, scale)
        system = (text.encode(SYSTEM_HEADER) + text.shuffled(n))[:n]
    tags = rng.choice(np.arange(1000, 1000000), size=num_prompts, replace=False)
    out = []
    for i, name in enumerate(names):
        shape = SHAPES[name]
        out_len = _scaled(shape.output_len, scale)
        question = QUESTIONS[int(rng.integers(len(QUESTIONS)))]
        if name == "shared-prefix":
            ids = system + text.encode(f"\nUser: {question}\nAssistant:")
        else:
            n = _jitter(rng, _scaled(shape.input_len, scale))
            head = text.encode(f"Note {tags[i]}: ")
            if name == "creative":
                task = CREATIVE_TASKS[int(rng.integers(len(CREATIVE_TASKS)))]
                ids = (head + text.encode(task + " ") + text.shuffled(n))[:n]
            else:
                if name == "rag":
                    head += text.encode(DOCS_INTRO)
                ids = question_prompt(text, question, n, head)
        out.append(BenchRequest(name, [int(t) for t in ids], out_len))
    return out


def question_prompt(text: Text, question: str, n: int, head: list[int] = ()) -> list[int]:
    """``n`` token ids: ``head``, shuffled corpus text, then ``question`` as
    ``"Question: ... Answer:"``, the text cut so the question fits (at a very
    small ``n`` the question's end is kept)."""
    tail = text.encode(f"\n\nQuestion: {question}\nAnswer:")
    body = text.shuffled(n)
    ids = (list(head) + body)[:max(0, n - len(tail))] + tail
    return [int(t) for t in ids[-n:]]


def passage(tok, rng, n: int) -> str:
    """Corpus sentences in a random order until the text has >= ``n`` tokens."""
    order, text = rng.permutation(len(SENTENCES)), ""
    for i in np.concatenate([order, order]):
        text += SENTENCES[i] + " "
        if (len(tok.encode(text, add_special_tokens=False)) if tok else len(text) // 4) >= n:
            break
    return text.strip()


# The prefix-cache benchmark's prompts (``prefix_cache``): a long system
# prompt per trial, then one of two user turns.
PREFIX_TURNS = ("\nUser: What is the main idea of the text above? Answer briefly.\nAssistant:",
                "\nUser: Name two machines the text mentions, and say why they mattered.\n"
                "Assistant:")


def system_prompt(tokenizer, trial: int, system_len: int) -> list[int]:
    """``system_len`` token ids: a trial-specific opening line (so trials share
    no page) and ``CORPUS`` text."""
    head = tokenizer.encode(f"System prompt #{trial}. You are a careful assistant. "
                            "Reference text:\n")
    body = tokenizer.encode(CORPUS * (1 + system_len // 500))
    return (head + body)[:system_len]


def corpus_slices(tokenizer, vocab_size: int, num_requests: int, input_len: int,
                  seed: int) -> list[list[int]]:
    """The offline throughput pass's prompts (``python -m jaxserve.main --mode
    bench``): slices of ``CORPUS`` (repeated, tokenized once) of about
    ``input_len`` tokens (+-10%) at seeded random offsets; random ids of V
    ``vocab_size`` without a tokenizer."""
    rng = np.random.default_rng(seed)
    if tokenizer is not None:
        base = tokenizer.encode(CORPUS * (2 + input_len // 500), add_special_tokens=False)
    else:
        base = list(rng.integers(0, vocab_size, size=4 * input_len + 64))
    lo, hi = max(1, int(input_len * 0.9)), max(1, int(input_len * 1.1))
    prompts = []
    for _ in range(num_requests):
        n = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(base) - n))
        prompts.append([int(t) for t in base[start:start + n]])
    return prompts
