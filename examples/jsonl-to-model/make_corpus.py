#!/usr/bin/env python3
"""A JSON Lines corpus as datasets ship them, from a text of titled stories (a title line, a
blank line, the story): one object per story, {"id": ..., "title": ..., "text": title and
story}, gzip-compressed:

    .venv/bin/python examples/jsonl-to-model/make_corpus.py examples/finetune-hf/fables.txt OUT/corpus.jsonl.gz
"""
import gzip
import json
import sys


def main():
    text, out = sys.argv[1], sys.argv[2]
    blocks = [b.strip() for b in open(text, encoding="utf-8").read().split("\n\n") if b.strip()]
    stories = list(zip(blocks[0::2], blocks[1::2]))
    with gzip.open(out, "wt", encoding="utf-8") as f:
        for i, (title, story) in enumerate(stories):
            row = {"id": i, "title": title, "text": f"{title}\n\n{story}\n"}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{out}: {len(stories)} documents")


if __name__ == "__main__":
    main()
