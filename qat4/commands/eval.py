"""`qat4 eval TASK`: score a model's answers question by question (gsm8k, bfcl, recall) against an
OpenAI-compatible server, its next-token distributions against a reference (kld), or pair two runs
(compare)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from qat4.commands.model_args import DEVICES
from qat4.errors import Qat4Error

DEFAULT_CONCURRENCY = 8
GSM8K_MAX_TOKENS = 2048
BFCL_MAX_TOKENS = 1024
RECALL_MAX_TOKENS = 16  # a six-digit code and a little more
REFERENCE_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "eval", help="score answers (gsm8k, bfcl, recall), KL divergence (kld), or pair two runs (compare)",
        description="Score a model question by question against an OpenAI-compatible server (--url: qat4, "
        "llama-server, vLLM) or a qat4 serve it starts (--model), writing every question to a JSONL file and "
        "the figures to a JSON summary; measure KL divergence from a reference in process (kld); or pair two "
        "runs of a task (compare). Data sets are read from --data, else $QAT4_DATA, else ~/.cache/qat4/data.")
    tasks = p.add_subparsers(dest="eval_task", required=True, metavar="TASK")
    gsm8k = _server_task(tasks, "gsm8k", "GSM8K test problems: the final number of each reply against the reference",
                         max_tokens=GSM8K_MAX_TOKENS)
    gsm8k.set_defaults(run=run_gsm8k)
    bfcl = _server_task(tasks, "bfcl", "BFCL v4 function calling: each question's functions sent as tools, the "
                        "tool calls scored by the Berkeley checker (bfcl-eval)", max_tokens=BFCL_MAX_TOKENS)
    bfcl.add_argument("--categories", default="simple_python",
                      help="comma-separated: simple_python, multiple, parallel, parallel_multiple, irrelevance; "
                           "--limit applies to each (default: %(default)s)")
    bfcl.set_defaults(run=run_bfcl)
    recall = _server_task(tasks, "recall", "long-context recall: the code of the record a quarter of the way into "
                          "a prompt of numbered records, at several depths and seeds, thinking off",
                          max_tokens=RECALL_MAX_TOKENS, concurrency=1)
    recall.add_argument("--depths", default="4k,32k,128k", help="prompt sizes in tokens (default: %(default)s)")
    recall.add_argument("--seeds", default="0,1,2",
                        help="comma-separated seeds; each draws other codes (default: %(default)s)")
    recall.set_defaults(run=run_recall)
    _add_kld_parser(tasks)
    compare = tasks.add_parser("compare", help="pair two runs of a task question by question",
                               description="Pair the JSONL files of two runs of one task by question: both right, "
                               "only A, only B, and B's accuracy minus A's with a 95%% paired-bootstrap interval "
                               "(fixed seed) and McNemar's exact p.")
    compare.add_argument("a", metavar="A.jsonl")
    compare.add_argument("b", metavar="B.jsonl")
    compare.add_argument("--names", default=None, metavar="A,B", help="column names (default: the file names)")
    compare.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    compare.set_defaults(run=run_compare)


def _add_kld_parser(tasks) -> None:
    p = tasks.add_parser(
        "kld", help="KL divergence, same top token and perplexity ratio against a reference, in process",
        description="Read WikiText-2 in chunks with the qat4 engine in this process and compare its next-token "
        "distributions with a reference's, as llama-perplexity --kl-divergence does: --reference hf is "
        "transformers' own Gemma 4 on the same weights; --reference FILE is a logits file that "
        "llama-perplexity -f TEXT --kl-divergence-base FILE (or --save-logits here) wrote, whose chunks are read "
        "instead of the text. --save-logits FILE keeps qat4's own distributions in that format, for "
        "llama-perplexity --kl-divergence-base FILE --kl-divergence.")
    p.add_argument("--model", required=True, metavar="PATH|ID",
                   help="checkpoint folder or file, Hub id, or synthetic:e2b / synthetic:tiny")
    p.add_argument("--device", choices=DEVICES, default=None, help="default: cuda when available, else cpu")
    p.add_argument("--reference", metavar="hf|FILE", help="what to compare with (default: nothing, perplexity only)")
    p.add_argument("--reference-dtype", choices=sorted(REFERENCE_DTYPES), default="bf16",
                   help="precision of --reference hf (default: %(default)s)")
    p.add_argument("--save-logits", metavar="FILE", help="write qat4's distributions as a llama.cpp logits file")
    p.add_argument("--chunks", type=int, default=16, metavar="N", help="chunks of the text (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=512, metavar="N", help="tokens per chunk (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", help="data folder (default: $QAT4_DATA, else ~/.cache/qat4/data)")
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.set_defaults(run=run_kld)


def _server_task(tasks, name: str, what: str, *, max_tokens: int,
                 concurrency: int = DEFAULT_CONCURRENCY) -> argparse.ArgumentParser:
    """A task's parser with the flags every server task shares, and their defaults for this task."""
    p = tasks.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}. Without --url it starts "
                         "`qat4 serve --model ...` on a free loopback port and stops it afterwards.")
    p.add_argument("--url", help="base URL of a running OpenAI-compatible server (http://host:port)")
    p.add_argument("--model", help="with --url: the model name sent (default: the first /v1/models lists); "
                   "without: the checkpoint, Hub id or synthetic:PRESET the started qat4 serve loads")
    p.add_argument("--api-key", default=os.environ.get("QAT4_API_KEY"), metavar="KEY", help="bearer token to send")
    p.add_argument("--device", choices=DEVICES, default=None, help="device of the started qat4 serve")
    p.add_argument("--server-args", default="", metavar="ARGS", help="more flags for the started qat4 serve")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="only the first N questions")
    p.add_argument("--concurrency", type=int, default=concurrency, metavar="C",
                   help="requests in flight at once (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, metavar="N",
                   help="most tokens of each reply (default: %(default)s)")
    p.add_argument("--data", metavar="DIR", help="data folder (default: $QAT4_DATA, else ~/.cache/qat4/data)")
    p.add_argument("--jsonl", metavar="FILE", help=f"every question's record (default: {name}.jsonl)")
    p.add_argument("--json", metavar="FILE", help=f"the summary (default: {name}.json)")
    return p


def _log(task: str, line: str) -> None:
    print(f"[eval {task}] {line}", file=sys.stderr, flush=True)


@contextmanager
def _serving(args: argparse.Namespace, task: str) -> Iterator[Any]:
    """The server the questions go to: --url as given, or a qat4 serve --model started for the run."""
    from qat4.eval.client import Server
    from qat4.serve_process import serving

    with serving(f"qat4 eval {task}", args.url, args.model, api_key=args.api_key, device=args.device,
                 server_args=args.server_args, max_queue=args.concurrency, log=lambda line: _log(task, line)) as served:
        yield Server(served.url, served.model, args.api_key)


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--concurrency", args.concurrency), ("--limit", args.limit), ("--max-tokens", args.max_tokens)):
        if value is not None and value < 1:
            raise Qat4Error(f"{flag} must be at least 1, got {value}")


def _run_questions(args: argparse.Namespace, task: str, questions: Sequence, score: Callable,
                   details: Callable[[list], dict] = lambda records: {}) -> int:
    """Ask `questions` on the server, write the records and the summary, print the summary."""
    from qat4.commands.progress import ProgressLine
    from qat4.eval import records as eval_records
    from qat4.eval import runner

    if not questions:
        raise Qat4Error(f"the {task} data has no questions")
    jsonl, summary_path = Path(args.jsonl or f"{task}.jsonl"), Path(args.json or f"{task}.json")
    for path in (jsonl, summary_path):  # found out before the run rather than after it
        if not path.parent.is_dir():
            raise Qat4Error(f"cannot write {path}: there is no folder {path.parent}")
    line, done = ProgressLine(), {"questions": 0, "right": 0, "failed": 0}

    def show(record) -> None:
        done["questions"] += 1
        done["right"] += record.correct
        done["failed"] += record.reply is None
        line.update(f"[eval {task}] {done['questions']}/{len(questions)} questions, {done['right']} right, "
                    f"{done['failed']} failed requests")

    with _serving(args, task) as server:
        start = time.perf_counter()
        try:
            records = runner.run(server, questions, score, args.concurrency, on_record=show)
        finally:
            line.done()
        seconds = time.perf_counter() - start
    summary = eval_records.summary(task, records, url=server.url, model=server.model, concurrency=args.concurrency,
                                   wall_s=round(seconds, 3), **details(records))
    eval_records.write_jsonl(records, jsonl)
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    _log(task, f"{len(records)} questions in {seconds:.1f} s; records in {jsonl}, summary in {summary_path}")
    if summary["failed_requests"] == len(records):
        first = records[0].reason
        raise Qat4Error(f"every one of the {len(records)} requests failed; the first: {first}")
    return 0


def run_gsm8k(args: argparse.Namespace) -> int:
    from qat4.eval import data, gsm8k

    _check_counts(args)
    questions = gsm8k.load(data.gsm8k_file(data.data_dir(args.data)), args.limit, args.max_tokens)
    return _run_questions(args, "gsm8k", questions, gsm8k.score)


def run_bfcl(args: argparse.Namespace) -> int:
    from qat4.eval import bfcl, data

    _check_counts(args)
    categories = bfcl.parse_categories(args.categories)
    questions = bfcl.load(data.data_dir(args.data), categories, args.limit, args.max_tokens)
    return _run_questions(args, "bfcl", questions, bfcl.score, lambda records: {"by_category": bfcl.by_category(records)})


def run_recall(args: argparse.Namespace) -> int:
    from qat4.commands.model_args import synthetic_tokenizer
    from qat4.eval import recall

    _check_counts(args)
    depths = recall.parse_depths(args.depths)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        raise Qat4Error(f"--seeds must be comma-separated integers, got {args.seeds!r}") from None
    questions = recall.questions(depths, seeds, synthetic_tokenizer(), args.max_tokens)[:args.limit]
    return _run_questions(args, "recall", questions, recall.score, lambda records: {"by_depth": recall.by_depth(records)})


def run_compare(args: argparse.Namespace) -> int:
    from qat4.eval import compare
    from qat4.eval.records import read_jsonl

    names = args.names.split(",") if args.names else [Path(args.a).stem, Path(args.b).stem]
    if len(names) != 2 or not all(n.strip() for n in names):
        raise Qat4Error(f"--names takes two names, A,B; got {args.names!r}")
    comparison = compare.pair(read_jsonl(args.a), read_jsonl(args.b))
    print(compare.format_table(comparison, *names))
    if args.json:
        Path(args.json).write_text(json.dumps({"a": args.a, "b": args.b, **comparison.to_json()}, indent=2) + "\n")
    return 0


def run_kld(args: argparse.Namespace) -> int:
    import torch

    from qat4.commands.bench import load_packed_for_bench
    from qat4.commands.model_args import resolve_device, synthetic_tokenizer
    from qat4.commands.progress import ProgressLine
    from qat4.config import SYNTHETIC
    from qat4.engine import Engine
    from qat4.eval import data, kld
    from qat4.eval.logits_file import LogitsFile, LogitsWriter

    if args.chunks < 1 or args.ctx < 4:
        raise Qat4Error("--chunks must be at least 1 and --ctx at least 4")
    base = LogitsFile.open(args.reference) if args.reference not in (None, "hf") else None
    n_ctx = base.n_ctx if base is not None else args.ctx
    device = torch.device(resolve_device(args.device))
    _log("kld", f"loading {args.model}")
    packed = load_packed_for_bench(args.model, device, seed=0)
    tokenizer = synthetic_tokenizer() if args.model.startswith(SYNTHETIC) else None
    engine = Engine.from_packed(packed, device, tokenizer=tokenizer, max_ctx=n_ctx, max_num_seqs=1)
    vocab = packed.config.vocab_size
    if base is not None:
        if base.n_vocab != vocab:
            raise Qat4Error(f"{args.reference} holds distributions over {base.n_vocab} tokens; the model has {vocab}")
        chunks, reference, name = base.chunks, lambda index, ids: base.log_probs(index), str(args.reference)
    else:
        if engine.tokenizer is None:
            raise Qat4Error(f"{args.model} has no tokenizer to read the text with")
        text = data.required(data.data_dir(args.data) / "wikitext-2" / "wiki.test.raw", "WikiText-2's test text")
        chunks = kld.text_chunks(engine.tokenizer.encode(text.read_text(encoding="utf-8"), add_bos=True), args.chunks, n_ctx)
        reference = name = None
        if args.reference == "hf":
            reference = kld.reference_of(_hf_logits(packed, device, args.reference_dtype))
            name = f"transformers {args.reference_dtype}"
    writer = LogitsWriter(args.save_logits, n_ctx, vocab, chunks) if args.save_logits else None
    line = ProgressLine()
    try:
        report = kld.run(engine.logits, chunks, packed.config.bos_token_id, reference, name, writer,
                         on_chunk=lambda done, total: line.update(f"[eval kld] chunk {done}/{total}"))
    finally:
        line.done()
        if writer is not None:
            writer.close()
    print(kld.format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, **report.to_json()}, indent=2) + "\n")
    return 0


def _hf_logits(packed, device, dtype: str) -> Callable:
    """transformers' Gemma 4 on `packed`'s weights in `dtype`, as a function of a chunk's ids."""
    import torch

    try:
        from qat4.reference import cast, hf_model
    except ImportError:
        raise Qat4Error("--reference hf needs transformers: pip install 'qat4[eval]'") from None
    model = cast(hf_model(packed, device), getattr(torch, REFERENCE_DTYPES[dtype]))

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([ids], device=device)).logits[0].float()

    return logits
