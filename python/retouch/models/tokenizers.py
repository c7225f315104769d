"""Tokenizers for the built-in models, built on this machine from a small prompt corpus.

Nothing here is downloaded: the CLIP tokenizer is a byte-level BPE whose merges are learned from
`PROMPT_CORPUS`, and the T5 tokenizer is a Unigram model whose piece scores are the corpus word
frequencies. Both are the transformers classes the diffusers pipelines expect, so they save and load
with `save_pretrained` / `from_pretrained` like the published ones. They are deterministic: the same
code gives the same vocabulary in every process, which the export cache relies on.
"""

import math
import re
from collections import Counter

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, T5TokenizerFast

# Inpainting prompts of the kind retouch serves; the learned vocabulary covers their words as whole
# tokens, so test prompts tokenize to a few ids rather than to bytes.
PROMPT_CORPUS = (
    "a photo of a cat sitting on a wooden bench in the park",
    "a photo of a dog lying on the grass in the garden",
    "replace the sky with a dramatic sunset over the mountains",
    "remove the person from the background and fill it with grass and trees",
    "a red car parked on a city street at night, neon lights, rain",
    "portrait of a woman wearing a blue hat, studio lighting",
    "portrait of a man with a beard, soft light, shallow depth of field",
    "a bowl of fresh fruit on a kitchen table, morning light",
    "a cup of coffee on a wooden table next to a window",
    "an old stone bridge over a river in the forest",
    "a white house with a red door and flowers in the garden",
    "snow covered mountains under a clear blue sky",
    "a sandy beach with palm trees and blue water",
    "a small boat on a calm lake at sunrise",
    "fill the hole in the wall with red bricks",
    "replace the text on the sign with a blank white board",
    "add a pair of glasses to the face",
    "change the color of the shirt to green",
    "make the sky cloudy and grey",
    "remove the watermark from the corner of the image",
    "restore the damaged part of the old photo",
    "a city skyline at night with tall buildings and lights",
    "a field of yellow flowers under a bright blue sky",
    "a black and white photo of a street in the rain",
    "a modern living room with a grey sofa and a lamp",
    "a plate of pasta with tomato sauce and basil",
    "a green forest path in autumn with orange leaves",
    "a painting of a ship on a stormy sea, oil on canvas",
    "a watercolor of a small village by the sea",
    "a close up photo of a flower with water drops",
    "a high quality photo, detailed, sharp focus, 4k",
    "the same scene with the car removed",
    "the same room with the window open and light coming in",
    "a cat and a dog sitting together on the floor",
    "two people walking on the beach at sunset",
    "a person riding a bicycle on a city street",
    "a bird sitting on a branch of a tree",
    "a horse running in a green field",
    "an empty road through the desert under a blue sky",
    "a wooden table with a vase of flowers",
)

CLIP_MAX_LENGTH = 77  # CLIP's position table; every CLIP pipeline pads prompts to exactly this
T5_MAX_LENGTH = 512  # the published T5 tokenizers' limit; pipelines truncate to max_sequence_length

_CLIP_END_OF_WORD = "</w>"
_T5_WORD_START = "\u2581"  # SentencePiece's word-start marker, what T5's Metaspace pre-tokenizer emits
_T5_CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()-_/&%+#@*"
# Unigram scores are log-probabilities; an unseen character costs more than any corpus word so that
# Viterbi prefers whole words and falls back to characters only where it must.
_T5_CHARACTER_SCORE = -14.0
_T5_WORD = re.compile(r"[A-Za-z0-9']+")
_T5_WORD_START_SCORE = -10.0


def build_clip_tokenizer() -> CLIPTokenizer:
    """A byte-level BPE CLIP tokenizer (vocab ~ 900 ids) laid out like OpenAI's.

    Ids 0..255 are the byte-level alphabet, 256..511 the same symbols with the end-of-word suffix,
    then the learned merges, then `<|startoftext|>` and `<|endoftext|>` last, as in the published
    vocabulary (CLIPTextModel finds the pooled token by the end-of-text id).
    """
    alphabet = sorted(ByteLevel.alphabet())
    merges = _learn_bpe_merges(_clip_word_counts())
    tokens = alphabet + [symbol + _CLIP_END_OF_WORD for symbol in alphabet]
    tokens += [left + right for left, right in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=CLIP_MAX_LENGTH)


def build_t5_tokenizer() -> T5TokenizerFast:
    """A Unigram T5 tokenizer: `<pad>`=0, `</s>`=1, `<unk>`=2, corpus words, then single characters."""
    word_counts = Counter(word for prompt in PROMPT_CORPUS for word in _T5_WORD.findall(prompt))
    total = sum(word_counts.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), (_T5_WORD_START, _T5_WORD_START_SCORE)]
    pieces += [(_T5_WORD_START + word, math.log(count / total)) for word, count in sorted(word_counts.items())]
    pieces += [(character, _T5_CHARACTER_SCORE) for character in _T5_CHARACTERS]
    # extra_ids=0: the 100 sentinel tokens exist for span-corruption pretraining, not for encoding prompts.
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)


def _clip_word_counts() -> Counter[str]:
    """Pre-token -> count over PROMPT_CORPUS, split by CLIP's own normalizer and pre-tokenizer."""
    backend = CLIPTokenizer().backend_tokenizer
    counts: Counter[str] = Counter()
    for prompt in PROMPT_CORPUS:
        normalized = backend.normalizer.normalize_str(prompt)
        counts.update(piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized))
    return counts


def _learn_bpe_merges(word_counts: Counter[str], min_count: int = 2) -> list[tuple[str, str]]:
    """Classic BPE (Sennrich et al. 2016): merge the most frequent adjacent pair until none repeats.

    The end-of-word suffix is glued to each word's last symbol, as CLIP's BPE model expects. Ties go to
    the lexicographically smallest pair, which keeps the result identical across processes (the
    `tokenizers` trainer does not promise that).
    """
    words = {tuple(word[:-1]) + (word[-1] + _CLIP_END_OF_WORD,): count for word, count in word_counts.items()}
    merges: list[tuple[str, str]] = []
    while True:
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            return merges
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        if pair_counts[best] < min_count:
            return merges
        merges.append(best)
        words = {_merge_pair(symbols, best): count for symbols, count in words.items()}


def _merge_pair(symbols: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    index = 0
    while index < len(symbols):
        if index + 1 < len(symbols) and (symbols[index], symbols[index + 1]) == pair:
            merged.append(symbols[index] + symbols[index + 1])
            index += 2
        else:
            merged.append(symbols[index])
            index += 1
    return tuple(merged)
