"""Start-up reads that grow with the model, split among the ranks (issue 47): on 2 real ranks
(CPU accelerator) the base-model fingerprint is read once per job, each rank reading its own
share, and it equals the one-process fingerprint; each rank's record holds a digest of its kept
units, not the units, and still lets the ranks' decisions be compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import tiny_family

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_distributed import COMMON, TRAIN, check_identical_and_pruned, ds_config, launch, rank_records  # noqa: E402

from apt_ds.algorithm.state import shape_digest  # noqa: E402
from apt_ds.io.fingerprint import file_fingerprint  # noqa: E402

# launch/train.py with every element a rank reads while it fingerprints the base counted by tensor,
# written to READS/reads<RANK>.json when the rank exits
COUNTING_TRAIN = '''
import json, os, runpy, sys
from pathlib import Path

import apt_ds.training.run as run
from apt_ds.io.weights import SafetensorsWeights

reads, fingerprinting = {{}}, [False]
part, flat_range = run.file_fingerprint_part, SafetensorsWeights.flat_range


def counted_part(*args):
    fingerprinting[0] = True
    try:
        return part(*args)
    finally:
        fingerprinting[0] = False


def counted_range(self, name, start, length):
    chunk = flat_range(self, name, start, length)
    if fingerprinting[0]:
        reads[name] = reads.get(name, 0) + chunk.numel()
    return chunk


run.file_fingerprint_part, SafetensorsWeights.flat_range = counted_part, counted_range
sys.argv[0] = {train!r}
try:
    runpy.run_path({train!r}, run_name="__main__")
finally:
    Path({reads!r}, "reads" + os.environ["RANK"] + ".json").write_text(json.dumps(reads))
'''


def elements_read_by_one_process(base: Path, monkeypatch) -> dict[str, int]:
    from apt_ds.io.weights import SafetensorsWeights

    reads, flat_range = {}, SafetensorsWeights.flat_range

    def counted_range(self, name, start, length):
        chunk = flat_range(self, name, start, length)
        reads[name] = reads.get(name, 0) + chunk.numel()
        return chunk

    monkeypatch.setattr(SafetensorsWeights, "flat_range", counted_range)
    file_fingerprint(base)
    monkeypatch.undo()
    return reads


def test_two_ranks_read_the_base_once_between_them_and_record_digests(tmp_path, tokenizer, monkeypatch):
    base = tmp_path / "llama"
    tiny_family("llama", vocab=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(str(base))
    script = tmp_path / "counting_train.py"
    script.write_text(COUNTING_TRAIN.format(train=TRAIN, reads=str(tmp_path)))
    out = tmp_path / "run"
    result = launch(2, ["--deepspeed", ds_config(tmp_path, 2), *COMMON, "--micro-batch-size", "2", "--model", str(base),
                        "--out", str(out)], script=str(script))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    # Between them the ranks read exactly what one process reads, each about half of it, and the
    # fingerprint they combined is the one-process one (export and resume compare against it).
    per_rank = [json.loads((tmp_path / f"reads{rank}.json").read_text()) for rank in (0, 1)]
    whole = elements_read_by_one_process(base, monkeypatch)
    assert {name: sum(reads.get(name, 0) for reads in per_rank) for name in whole} == whole
    assert all(set(reads) <= set(whole) for reads in per_rank)
    total = sum(whole.values())
    assert all(0.25 * total < sum(reads.values()) < 0.75 * total for reads in per_rank), (per_rank, total)
    run_info = json.loads((out / "run.json").read_text())
    assert run_info["model_fingerprint"] == file_fingerprint(base)

    # The records compare the ranks' decisions through a digest of the kept units (the run's
    # checkpoint holds the units once) and hold nothing that grows with them.
    check_identical_and_pruned(out, 2)
    meta = json.loads((out / "checkpoint" / "apt_state.json").read_text())
    kept = [*meta["kept"]["groups"], *meta["kept"]["neurons"], meta["kept"]["hidden"]]
    for record in rank_records(out):
        assert set(record) == {"rank", "world_size", "shape_fingerprint", "ranks", "shape"}
        assert record["shape_fingerprint"] == shape_digest(kept, meta["ranks"])
