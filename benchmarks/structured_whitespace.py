"""Which whitespace rule gives valid JSON most often: free, bounded, or single spaces only.

The bundled SmolLM2-135M-Instruct is asked "Give me <description> as JSON." through its chat
template for each of the 22 schemas of ``json_schemas.py``, constrained by the schema, with
``max_tokens`` = 128: once greedy, and ``--seeds`` times at temperature 0.7 (seeds 0, 1, ...).
Each whitespace rule is a per-request setting on one ``LLM`` whose server-wide default is free
whitespace:

    free        any run of space, tab, CR, LF between JSON tokens (xgrammar's own default)
    max N       at most N of them (xgrammar's ``max_whitespace_cnt``)
    compact     only the single spaces of ", " and ": " (``disable_any_whitespace``)

An answer is valid when it finished with reason "stop" (not cut at ``max_tokens``), parses as
JSON and validates against its schema. Prints one line per rule and temperature: valid answers,
answers cut at max_tokens, mean output tokens, and the wall time of that batch.

    python -m benchmarks.structured_whitespace
    python -m benchmarks.structured_whitespace --seeds 1 --rules free,max2,compact
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root (axon, benchmarks) importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import model_folder
from benchmarks.json_schemas import SCHEMAS

TEMPERATURE = 0.7


@dataclass
class Outcome:
    rule: str
    temperature: float
    num_valid: int
    num_cut: int  # finished by length: the whitespace (or anything else) ran to max_tokens
    num_answers: int
    mean_tokens: float
    wall_s: float

    def line(self) -> str:
        return (
            f"{self.rule:>8} T={self.temperature:<3}: {self.num_valid:>3}/{self.num_answers} valid, "
            f"{self.num_cut:>3} cut at max_tokens, {self.mean_tokens:5.1f} tokens on average, "
            f"{self.wall_s:5.1f} s"
        )


def rule_settings(rule: str) -> dict[str, Any]:
    """The per-request StructuredOutputsParams fields of a rule name: free, compact or maxN."""
    if rule == "free":
        return {}
    if rule == "compact":
        return {"disable_any_whitespace": True}
    if rule.startswith("max") and rule[3:].isdigit() and int(rule[3:]) > 0:
        return {"max_whitespace_cnt": int(rule[3:])}
    raise ValueError(f"unknown rule {rule!r}; supported: free, compact, max<N> (N >= 1)")


def is_valid(text: str, finish_reason: str | None, schema: dict[str, Any]) -> bool:
    import jsonschema

    if finish_reason != "stop":
        return False
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def run_rule(llm: Any, rule: str, temperature: float, seeds: list[int | None], max_tokens: int) -> Outcome:
    from axon import SamplingParams, StructuredOutputsParams

    conversations, params, schemas = [], [], []
    for seed in seeds:
        for description, schema in SCHEMAS:
            conversations.append([{"role": "user", "content": f"Give me {description} as JSON."}])
            so = StructuredOutputsParams(json=schema, **rule_settings(rule))
            params.append(
                SamplingParams(
                    temperature=temperature, seed=seed, max_tokens=max_tokens, structured_outputs=so
                )
            )
            schemas.append(schema)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    wall_s = time.perf_counter() - start
    completions = [o.outputs[0] for o in outputs]
    return Outcome(
        rule=rule,
        temperature=temperature,
        num_valid=sum(
            is_valid(c.text, c.finish_reason, s) for c, s in zip(completions, schemas, strict=True)
        ),
        num_cut=sum(c.finish_reason == "length" for c in completions),
        num_answers=len(completions),
        mean_tokens=statistics.mean(len(c.token_ids) for c in completions),
        wall_s=wall_s,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rules", default="free,max1,max2,max4,compact", help="comma-separated: free, maxN, compact"
    )
    p.add_argument("--seeds", type=int, default=3, help=f"sampled answers per schema at T={TEMPERATURE}")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    args.rules = args.rules.split(",")
    for rule in args.rules:
        try:
            rule_settings(rule)
        except ValueError as e:
            p.error(str(e))
    if args.seeds < 0 or args.max_tokens < 1:
        p.error("--seeds must be >= 0 and --max-tokens >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    import torch

    from axon import LLM

    args = parse_args(argv)
    num_rows = len(SCHEMAS) * max(args.seeds, 1)
    llm = LLM(
        model=model_folder("smollm2"),
        dtype=args.dtype,
        max_model_len=512,
        max_num_seqs=num_rows,
        enforce_eager=True,  # a measure of answers, not speed: no compile time in the wall times
        structured_outputs_config={"max_whitespace_cnt": None},  # free unless a request says otherwise
    )
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; smollm2, {len(SCHEMAS)} schemas, "
        f"max_tokens {args.max_tokens}, greedy and {args.seeds} seeds at T={TEMPERATURE}, {args.dtype}",
        flush=True,
    )
    outcomes = []
    for rule in args.rules:
        for temperature, seeds in ((0.0, [None]), (TEMPERATURE, list(range(args.seeds)))):
            if not seeds:
                continue
            outcomes.append(run_rule(llm, rule, temperature, seeds, args.max_tokens))
            print(outcomes[-1].line(), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "outcomes": [o.__dict__ for o in outcomes]}, f, indent=2)


if __name__ == "__main__":
    main()
