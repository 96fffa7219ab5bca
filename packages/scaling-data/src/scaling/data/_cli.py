"""The ``scaling-data`` console command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from scaling.data._build import tokenize_files
from scaling.data._tokens import MMapTokenDataset


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scaling-data", description="Scaling data tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser(
        "build",
        help="tokenise .jsonl/.txt files into a memory-mapped .bin/.idx pair",
        description="Tokenise .jsonl (one JSON object per line) or .txt (one document per line) files "
        "with a Hugging Face tokenizers file into OUTPUT.bin / OUTPUT.idx.",
    )
    build.add_argument("inputs", nargs="+", help="input .jsonl / .txt files, read in this order")
    build.add_argument("--tokenizer", required=True, help="path of a tokenizer.json (Hugging Face tokenizers)")
    build.add_argument("--output", required=True, help="output prefix: writes OUTPUT.bin and OUTPUT.idx")
    build.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "uint8", "uint16", "int32", "uint32", "int64"],
        help="token dtype; auto = smallest that holds the vocabulary",
    )
    build.add_argument(
        "--workers",
        type=int,
        default=max(1, (os.cpu_count() or 2) - 1),
        help="tokenising processes (default: cores - 1)",
    )
    build.add_argument("--text-key", default="text", help="JSON field with the text (default: text)")
    build.add_argument("--txt-whole-file", action="store_true", help="read each .txt file as one document")
    build.add_argument("--eod-token", default=None, help="token appended to every document, e.g. '</s>'")
    build.add_argument("--chunk-size", type=int, default=256, help="documents per worker task")
    build.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    inspect = sub.add_parser("inspect", help="check a .bin/.idx pair (CRC included) and print its counts")
    inspect.add_argument("prefix", help="path without .bin/.idx")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``scaling-data``; returns the exit status (2 on bad input)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "build":
            ds = tokenize_files(
                args.inputs,
                args.tokenizer,
                args.output,
                dtype=None if args.dtype == "auto" else args.dtype,
                num_workers=args.workers,
                text_key=args.text_key,
                txt_whole_file=args.txt_whole_file,
                eod_token=args.eod_token,
                chunk_size=args.chunk_size,
                progress=not args.no_progress,
            )
        else:
            ds = MMapTokenDataset(args.prefix, verify_data=True)
    except (ValueError, FileNotFoundError, ImportError) as err:
        print(f"scaling-data {args.command}: error: {err}", file=sys.stderr)
        return 2
    print(f"{ds.prefix}: {ds.num_documents} documents, {ds.num_tokens} tokens, dtype {ds.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
