"""`launch/export.py`: a run (or a plain model plus the units to keep) -> a compact dense model, as a
transformers directory or (--format gguf) one llama.cpp file."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path

from apt_ds.cli.arguments import ExportArguments, build_export_parser, parse_with_positional
from apt_ds.cli.errors import report, user_errors
from apt_ds.config import ConfigError
from apt_ds.io import run_lock
from apt_ds.io.run_dir import set_aside_note


def main(argv: list[str] | None = None) -> int:
    parser = build_export_parser()
    args = parse_with_positional(parser, argv, ExportArguments, "run_dir", "run")
    for flag, value in (("RUN/--run-dir", args.run_dir), ("--model", args.model), ("--kept", args.kept)):
        if value is not None and not value.strip():  # Path("") is ".": never the directory meant
            parser.error(f"{flag} is empty: give the path, or leave it out")
    if args.run_dir and args.kept:
        parser.error("--kept is for exporting a plain model: give either RUN_DIR [--model BASE], or --model and --kept")
    if not args.run_dir and not (args.model and args.kept):
        parser.error("give either RUN_DIR [--model BASE], or --model and --kept")
    if not args.out.strip():  # Path("") is "."
        parser.error("--out is empty: give the directory for the exported model")
    try:
        from apt_ds.export.merge import export_run
        from apt_ds.export.pruned import export_pruned
        from apt_ds.export.writer import check_options
        from apt_ds.io.hub import resolve_model
        from apt_ds.io.modeling import model_file

        if args.model:  # a Hub name: its snapshot in the local cache; a directory holding one .gguf and no config.json:
            args.model = model_file(resolve_model(args.model, "--model"))  # that file, as train and evaluate read it

        with run_lock.held(Path(args.out), "export"):  # before --out is checked: a second export into it is refused
            if args.run_dir:
                if note := set_aside_note(Path(args.run_dir)):  # a killed --overwrite start: where the previous run is
                    print(note, file=sys.stderr)
                report_ = export_run(Path(args.run_dir), Path(args.out), dtype=args.dtype, overwrite=args.overwrite,
                                     model_path=args.model, max_shard_size=args.max_shard_size, format=args.format,
                                     merge_into=args.merge_into)
            else:
                if args.merge_into is not None:
                    raise ConfigError("--merge-into is for a run trained with --base-quant, not for --model with --kept")
                check_options(args.dtype, args.max_shard_size, args.format)  # before the (slow) model load
                model, kept = _plain_model_and_kept(args.model, args.kept)
                with _tokenizer_dir(args.model) as tokenizer_dir:
                    report_ = export_pruned(model, kept, Path(args.out), dtype=args.dtype,
                                            tokenizer_dir=tokenizer_dir, overwrite=args.overwrite,
                                            max_shard_size=args.max_shard_size, format=args.format, base=args.model)
    except KeyboardInterrupt:  # first: user_errors() imports torch, which the interrupt may have left half-imported
        print(f"interrupted: the export to {args.out} did not finish (it is written to a temporary directory first; the "
              f"next export to {args.out} clears what is left and puts back a previous export set aside)", file=sys.stderr)
        return 130
    except user_errors() as err:
        return report(err)
    print(json.dumps(report_["final"], indent=1))
    training = run_lock.training_now(Path(args.run_dir)) if args.run_dir else None
    print(done_message(report_, args.out, training), file=sys.stderr)
    return 0


def done_message(report_: dict, out: str, training: str | None = None) -> str:
    """Where the export went and what it holds; a warning first when the run had not finished
    (its last checkpoint is what was exported), or is still training (`training`: who trains it)."""
    final, original = report_["final"], report_.get("original")
    size = f"{final['total_params']:,} parameters"
    if original:
        size += f" (density {final['block_params'] / original['block_params']:.3f} of the prunable blocks)"
    target = Path(out) / report_["file"] if report_.get("format") == "gguf" else Path(out)
    message = f"exported {size} to {target}"
    message += "".join(f"\nnote: {note}" for note in report_.get("notes", ()))
    if report_.get("finished") is False:
        steps = f" of {report_['steps']}" if report_.get("steps") else ""
        message = (f"warning: the run is still training ({training}); its last checkpoint, step {report_.get('step')}{steps}, "
                   f"was exported\n" if training else
                   f"warning: the run stopped at step {report_.get('step')}{steps}, so its last checkpoint was exported; "
                   f"its launch/train.py command run again with --resume finishes it\n") + message
    return message


@contextlib.contextmanager
def _tokenizer_dir(model_path: str):
    """The directory whose tokenizer files the export carries: the model's own, or for a .gguf base
    (whose tokenizer is inside the file) the tokenizer read from it, saved to a temporary one, as a
    run trained from that file saves it."""
    path = Path(model_path)
    if not path.is_file():
        yield path
        return
    from apt_ds.io.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    with tempfile.TemporaryDirectory(prefix="apt-export-tokenizer-") as folder:
        tokenizer.save_pretrained(folder)
        yield Path(folder)


def _plain_model_and_kept(model_path: str, kept_path: str):
    from apt_ds.io.modeling import TINY_MODELS, load_model

    if model_path in TINY_MODELS:  # seeded random weights, not files: nothing ties them to the kept units' run
        raise ConfigError(f"--model {model_path} is the built-in random model, which --kept cannot export; "
                          f"export its run instead: launch/export.py RUN_DIR --out OUT")

    widths = None
    if kept_path.endswith(".safetensors"):
        from apt_ds.export.kept import kept_from_masks

        kept, widths = kept_from_masks(kept_path)
    else:
        try:
            kept = json.loads(Path(kept_path).read_text())
        except UnicodeDecodeError:  # e.g. a pickled .pt/.bin, which is never unpickled
            raise ConfigError(f"cannot read --kept {kept_path}: it is not JSON text; give a run's checkpoint/apt_state.json, "
                              f"a JSON of kept unit indices, or binary masks over the original model (.safetensors)") from None
        except (OSError, ValueError) as err:  # ValueError: bad JSON
            raise ConfigError(f"cannot read --kept {kept_path}: {err}") from None
    if isinstance(kept, dict) and "kept" in kept:  # a run's checkpoint/apt_state.json
        kept = kept["kept"]
    from apt_ds.export.kept import read_kept_record

    read_kept_record(kept)  # before the (slow) model load
    if widths is not None:
        from apt_ds.export.kept import check_mask_widths, config_widths
        from apt_ds.io.modeling import check_model_path

        expected = config_widths(check_model_path(model_path, flag="--model"))  # {} config for a GGUF file: None
        if expected is not None:
            check_mask_widths(kept_path, widths, expected)
            widths = None
    if Path(model_path).is_dir():  # a head that contradicts config.json: before any weight is read
        from apt_ds.io.fingerprint import check_base_head
        from apt_ds.io.modeling import check_model_path
        from apt_ds.models import ENCODERS, UnsupportedModelError

        if check_model_path(model_path, flag="--model").get("model_type") in ENCODERS:
            raise UnsupportedModelError(f"--model {model_path} is a sequence classifier: --kept exports a causal LM; a "
                                        f"classifier's head is trained by a run: export the run (launch/export.py RUN)")

        check_base_head(model_path)
    model = load_model(model_path)
    if widths is not None:  # a GGUF's or a per-layer export's widths are known once it is loaded
        from apt_ds.export.kept import model_widths

        check_mask_widths(kept_path, widths, model_widths(model))
    return model, kept
