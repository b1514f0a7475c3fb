#!/usr/bin/env python3
"""A byte-level BPE tokenizer (as GPT-2's) trained on the text field of JSON Lines files, saved
as a Hugging Face tokenizer.json that `zrun prepare --tokenizer` reads:

    .venv/bin/python examples/jsonl-to-model/train_tokenizer.py OUT/tokenizer.json CORPUS.jsonl[.gz]... [--vocab-size 512] [--field text]

Every byte is a token, so any text encodes; merges are learned from the documents, which are
streamed (plain or gzip-compressed lines). <|endoftext|> is a special token: `zrun prepare`
appends it after every document. Nothing is downloaded.
"""
import argparse
import gzip
import json

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS = "<|endoftext|>"


def documents(paths, field):
    """The `field` string of every JSON object, file after file, line after line."""
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)[field]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the tokenizer.json to write")
    p.add_argument("corpus", nargs="+", help="JSON Lines files (.jsonl or .jsonl.gz)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--field", default="text", help="the key holding each document's text")
    a = p.parse_args()

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(a.corpus, a.field), trainer)
    tok.save(a.out)
    print(f"{a.out}: {tok.get_vocab_size()} tokens, {EOS} = {tok.token_to_id(EOS)}")


if __name__ == "__main__":
    main()
