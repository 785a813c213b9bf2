"""Conversations against instruction rows on a real model (issue 46): the same SST-2 answers taught
to SmolLM2-135M-Instruct once as instruction rows under `--template chat` and once as a
conversational mix, then scored the same way.

  instruction    the task's training rows (instruction / input / output, prepare_tasks.py
                 --prompt-style alpaca), one user and one assistant turn each under the chat template;
  conversations  the same rows two by two as conversations with a system prompt and two exchanges,
                 alternately in TRL's `messages` and ShareGPT's `conversations` format; half the
                 micro-batch, so every step teaches the same number of answers.
Both train with the same method, steps, seed and learning rate, are exported merged, and are scored
on the same held-out rows: the label of highest likelihood after the chat template's prompt
(apt_ds.training.evaluate.label_accuracy, template chat). The untouched model is scored beside them.

    python benchmarks/chat_data.py --out bench_out/chat_data          # ~25 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import add_model_arguments, cpu_model_name, ensure_hf_model, git_commit, write_json  # noqa: E402
from prepare_tasks import write_jsonl  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You label the sentiment of movie review sentences."


def conversational_mix(rows: list[dict]) -> list[dict]:
    """Rows two by two as two-exchange conversations with a system prompt, formats alternating."""
    conversations = []
    for index in range(0, len(rows) - 1, 2):
        turns = [{"role": "system", "content": SYSTEM}]
        for row in rows[index : index + 2]:
            turns += [{"role": "user", "content": f"{row['instruction']}\n\n{row['input']}"},
                      {"role": "assistant", "content": row["output"]}]
        if (index // 2) % 2:
            sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
            conversations.append({"conversations": [{"from": sharegpt[t["role"]], "value": t["content"]} for t in turns]})
        else:
            conversations.append({"messages": turns})
    return conversations


def train(hf_dir: Path, data: Path, out: Path, micro_batch: int, args) -> float:
    command = [sys.executable, str(ROOT / "launch" / "train.py"), "--model", str(hf_dir), "--data", str(data),
               "--template", "chat", "--method", args.method, "--steps", str(args.steps), "--micro-batch-size",
               str(micro_batch), "--max-seq-len", str(args.max_seq_len * (2 if micro_batch < args.micro_batch_size else 1)),
               "--lr", str(args.lr), "--seed", str(args.seed), "--out", str(out), "--overwrite"]
    started = time.time()
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"training {out.name} failed:\n{result.stderr[-3000:]}")
    return time.time() - started


def score(model_dir: Path, tokenizer_dir: Path, rows: list[dict], labels: list[str], args) -> float:
    from apt_ds.io.modeling import load_model
    from apt_ds.io.tokenizer import load_tokenizer
    from apt_ds.training.evaluate import label_accuracy

    model = load_model(model_dir)
    return label_accuracy(model, load_tokenizer(tokenizer_dir), rows, labels, max_seq_len=args.max_seq_len,
                          batch_size=16, template="chat")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--tasks-dir", type=Path, default=Path("bench_out/tasks_alpaca"))
    parser.add_argument("--out", type=Path, default=Path("bench_out/chat_data"))
    parser.add_argument("--method", choices=("apt", "lora"), default="lora")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--micro-batch-size", type=int, default=8, help="instruction rows per step (conversations: half)")
    parser.add_argument("--max-seq-len", type=int, default=128, help="per instruction row (conversations: twice)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-examples", type=int, default=200)
    args = parser.parse_args(argv)

    from apt_ds.export.merge import export_run

    hf_dir = ensure_hf_model(args.model, args.hf_cache)
    task_dir = args.tasks_dir / "sst2"
    if not (task_dir / "train.jsonl").is_file():
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "prepare_tasks.py"), "--out", str(args.tasks_dir),
                        "--tasks", "sst2", "--prompt-style", "alpaca"], check=True)
    labels = json.loads((task_dir / "task.json").read_text())["labels"]
    train_rows = [json.loads(line) for line in (task_dir / "train.jsonl").read_text().splitlines() if line.strip()]
    test_rows = [json.loads(line) for line in (task_dir / "test.jsonl").read_text().splitlines() if line.strip()]
    test_rows = test_rows[: args.eval_examples]
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "instruction.jsonl", train_rows)
    write_jsonl(args.out / "conversations.jsonl", conversational_mix(train_rows))
    results = {"zero_shot": {"accuracy": score(hf_dir, hf_dir, test_rows, labels, args)}}
    print(f"zero_shot: {results['zero_shot']['accuracy']:.3f}", flush=True)
    for name, micro_batch in (("instruction", args.micro_batch_size), ("conversations", args.micro_batch_size // 2)):
        run = args.out / f"run_{name}"
        seconds = train(hf_dir, args.out / f"{name}.jsonl", run, micro_batch, args)
        export_run(run, args.out / f"export_{name}", dtype="fp32")
        record = json.loads((run / "run.json").read_text())
        results[name] = {"accuracy": score(args.out / f"export_{name}", run / "tokenizer", test_rows, labels, args),
                         "train_s": round(seconds, 1), "micro_batch_size": micro_batch,
                         "truncation": record["truncation"]}
        print(f"{name}: {results[name]['accuracy']:.3f} ({seconds:.0f} s)", flush=True)
    write_json(args.out / "chat_data.json", {"results": results, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                             "test_rows": len(test_rows), "train_rows": len(train_rows),
                                             "commit": git_commit(), "cpu": cpu_model_name()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
