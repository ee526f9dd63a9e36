"""The embedded default task: stay on the prompt's topic, with long-tailed response lengths.

A prompt reads `"w1 w2 <topic> :"` (context words on the topic or filler). The hidden rule scores a response
by the fraction of its words that belong to the prompt's topic (`topic_fraction`, in [0, 1]). Everything is
generated deterministically from a seed, nothing is downloaded:

- SFT responses are mostly off-topic (on-topic word rate ~Beta(2, 6), mean 0.25) so the warm-started actor
  scores ~0.25 and PPO has room to improve it;
- response lengths follow a log-normal law clipped to `max_new_tokens - 1` (median ~6 words, a few near the
  limit): the long tail that generation fusion targets;
- with `phrase_length` n > 0 a response is a sequence of n-word phrases from a fixed phrase book per topic (8
  on-topic phrases of topic words, 8 off-topic ones; an on-topic phrase with the on-topic rate), cut to its
  length: repetitive text, where the sibling samples of a prompt share phrases;
- preference pairs rank two responses of one prompt by the hidden rule, with on-topic rates spread over
  [0, 1] so that a Bradley–Terry reward model learns the rule over its whole range.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rlhfuse.data.tokenizer import Tokenizer

TOPICS: dict[str, tuple[str, ...]] = {
    "animals": ("cat", "dog", "horse", "cow", "bird", "fish", "lion", "tiger", "bear", "wolf"),
    "food": ("bread", "rice", "apple", "cheese", "soup", "cake", "milk", "egg", "pasta", "salad"),
    "space": ("star", "moon", "planet", "comet", "orbit", "rocket", "galaxy", "sun", "mars", "nebula"),
    "music": ("song", "drum", "guitar", "piano", "melody", "rhythm", "choir", "violin", "jazz", "opera"),
    "sports": ("ball", "goal", "team", "race", "match", "coach", "score", "tennis", "golf", "swim"),
    "weather": ("rain", "snow", "wind", "cloud", "storm", "fog", "thunder", "sunny", "frost", "hail"),
}
FILLER: tuple[str, ...] = (
    "the", "a", "and", "of", "to", "in", "is", "it", "on", "with",
    "was", "for", "very", "some", "many", "this", "that", "then", "so", "big",
)  # fmt: skip
SEPARATOR = ":"


def vocabulary() -> list[str]:
    """Every word of the task (topic names, topic words, filler, separator), in a fixed order."""
    words = [*TOPICS, SEPARATOR]
    for topic_words in TOPICS.values():
        words.extend(topic_words)
    words.extend(FILLER)
    return words


def build_tokenizer() -> Tokenizer:
    return Tokenizer.from_words(vocabulary())


def prompt_topic(prompt: str) -> str:
    """The topic of a prompt `"... <topic> :"`: the word before the last separator ("" if none)."""
    words = prompt.split()
    if SEPARATOR not in words:
        return ""
    position = len(words) - 1 - words[::-1].index(SEPARATOR)
    return words[position - 1] if position > 0 else ""


def topic_fraction(prompt: str, response: str) -> float:
    """The hidden rule: fraction of the response's words that belong to the prompt's topic (0 if empty)."""
    topic = prompt_topic(prompt)
    words = response.split()
    on_topic = set(TOPICS.get(topic, ()))
    if not words:
        return 0.0
    return sum(word in on_topic for word in words) / len(words)


@dataclass
class SyntheticTask:
    """Deterministic generator of prompts, SFT examples and preference pairs for the topic task."""

    seed: int = 0
    max_new_tokens: int = 48
    length_median: float = 6.0  # words; the log-normal's median
    length_sigma: float = 0.8  # log-normal sigma: larger = heavier tail
    phrase_length: int = 0  # 0 = words drawn one by one; n = responses made of n-word phrases

    def prompt(self, index: int) -> str:
        # "<context words> <topic> :" -- the context words are the topic's own (plus filler), so the topic shows all
        # over the prompt, and the separator ends the prompt: every word after it belongs to the response.
        rng = random.Random(f"prompt-{self.seed}-{index}")
        topic = rng.choice(list(TOPICS))
        context = [rng.choice(TOPICS[topic] + FILLER) for _ in range(rng.randint(1, 4))]
        return " ".join([*context, topic, SEPARATOR])

    def prompts(self, count: int) -> list[str]:
        return [self.prompt(i) for i in range(count)]

    def tokenizer(self) -> Tokenizer:
        return build_tokenizer()

    def response_length(self, rng: random.Random) -> int:
        length = math.exp(rng.gauss(math.log(self.length_median), self.length_sigma))
        return max(1, min(self.max_new_tokens - 1, round(length)))

    def response(
        self, prompt: str, on_topic_rate: float, rng: random.Random, length: int | None = None
    ) -> str:
        topic = prompt_topic(prompt)
        others = [w for name, words in TOPICS.items() if name != topic for w in words] + list(FILLER)
        count = self.response_length(rng) if length is None else length
        if self.phrase_length > 0:
            on_topic, off_topic = self.phrase_book(topic)
            words: list[str] = []
            while len(words) < count:
                words.extend(rng.choice(on_topic if rng.random() < on_topic_rate else off_topic))
            return " ".join(words[:count])
        words = [
            rng.choice(TOPICS[topic]) if rng.random() < on_topic_rate else rng.choice(others)
            for _ in range(count)
        ]
        return " ".join(words)

    def phrase_book(self, topic: str) -> tuple[list[list[str]], list[list[str]]]:
        """The topic's 8 on-topic phrases (topic words) and 8 off-topic ones (other topics' words and filler)."""
        rng = random.Random(f"phrases-{self.seed}-{topic}")
        others = [w for name, words in TOPICS.items() if name != topic for w in words] + list(FILLER)
        n = self.phrase_length
        on_topic = [[rng.choice(TOPICS[topic]) for _ in range(n)] for _ in range(8)]
        off_topic = [[rng.choice(others) for _ in range(n)] for _ in range(8)]
        return on_topic, off_topic

    def sft_examples(self, count: int) -> list[tuple[str, str]]:
        """(prompt, response) pairs whose responses are mostly off-topic, lengths long-tailed."""
        rng = random.Random(f"sft-{self.seed}")
        examples = []
        for i in range(count):
            prompt = self.prompt(i)
            examples.append((prompt, self.response(prompt, rng.betavariate(2.0, 6.0), rng)))
        return examples

    def preference_pairs(self, count: int) -> list[tuple[str, str, str]]:
        """(prompt, chosen, rejected) triples ranked by `topic_fraction`; ties are redrawn.

        Length carries no information: the chosen response is the longer one in exactly half of the pairs, so a
        reward model must learn the fraction itself rather than a length bias (which a policy would exploit by
        changing its response lengths). One pair in eight rejects an empty response, which scores 0.
        """
        rng = random.Random(f"pairs-{self.seed}")
        pairs: list[tuple[str, str, str]] = []
        i = 0
        while len(pairs) < count:
            prompt = self.prompt(i)
            i += 1
            a = self.response(prompt, rng.random(), rng, self._pair_length(rng))
            if len(pairs) % 8 == 7:
                if topic_fraction(prompt, a) > 0:
                    pairs.append((prompt, a, ""))
                continue
            b = self.response(prompt, rng.random(), rng, self._pair_length(rng))
            score_a, score_b = topic_fraction(prompt, a), topic_fraction(prompt, b)
            if score_a == score_b or len(a.split()) == len(b.split()):
                continue
            chosen, rejected = (a, b) if score_a > score_b else (b, a)
            non_empty = len(pairs) - len(pairs) // 8
            if (len(chosen.split()) > len(rejected.split())) != (non_empty % 2 == 0):
                continue  # even slots: the longer response wins; odd slots: the shorter one
            pairs.append((prompt, chosen, rejected))
        return pairs

    def _pair_length(self, rng: random.Random) -> int:
        # Half the pair responses take uniform lengths up to the limit: the reward model must also be right about
        # long responses, which the SFT length law rarely shows it and a policy would otherwise drift into.
        return rng.randint(1, self.max_new_tokens - 1) if rng.random() < 0.5 else self.response_length(rng)
