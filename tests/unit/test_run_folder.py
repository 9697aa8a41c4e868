"""The run-folder contract: its records round-trip, readers survive a line being written, and the one atomic
writer never leaves half a file or a temporary behind."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from megatron_hpc.atomic_write import write_json_atomic
from megatron_hpc.cli.main import main
from megatron_hpc.run_folder import (
    ATTEMPTS_FILE,
    AttemptRecord,
    FingerprintRecord,
    IterationRecord,
    JobRecord,
    SubmissionRecord,
    ValidationRecord,
    append_attempt,
    parse_attempts,
    read_metrics,
    read_spec,
)


def test_submission_record_round_trips_and_keeps_its_history():
    record = SubmissionRecord(cluster="slurm", jobs=[JobRecord(phase="compile", job_id="11", state="COMPLETED"),
                                                     JobRecord(phase="run", job_id="12", depends_on="11",
                                                               command=("sbatch", "--parsable", "run.sbatch"))],
                              ok=False, reason="run phase failed", fingerprint="ab" * 32,
                              history=[{"cluster": "slurm", "jobs": []}])
    data = json.loads(json.dumps(record.to_json()))
    assert data["jobs"][1]["command"] == ["sbatch", "--parsable", "run.sbatch"]
    assert "command" not in data["jobs"][0]
    back = SubmissionRecord.from_json(data)
    assert back == record
    # What an older submit wrote (no compile_left_out, no history) still reads.
    old = SubmissionRecord.from_json({"cluster": "local", "jobs": [{"phase": "run", "job_id": 7, "state": "RUNNING"}]})
    assert (old.jobs[0].job_id, old.compile_left_out, old.history) == ("7", None, [])


def test_attempts_append_and_a_line_being_written_is_skipped(tmp_path: Path):
    rec = AttemptRecord(time=1.0, phase="run", job_id="5", attempt=1, exit_code=1, action="requeue", requeued=True,
                        message="requeueing", iteration=40)
    append_attempt(tmp_path, rec)
    append_attempt(tmp_path, rec)
    text = (tmp_path / ATTEMPTS_FILE).read_text() + '{"time": 3.0, "phase": "ru'
    assert parse_attempts(text) == [rec, rec]


def test_an_attempt_appended_after_a_cut_line_is_kept(tmp_path: Path):
    # A node task killed in the middle of its write leaves a line without its newline; the next attempt's row
    # must start a line of its own, or status loses it with the cut one.
    rec = AttemptRecord(time=1.0, phase="run", job_id="5", attempt=1, exit_code=1, action="requeue", requeued=True,
                        message="requeueing", iteration=40)
    (tmp_path / ATTEMPTS_FILE).write_text('{"time": 0.5, "phase": "ru')
    append_attempt(tmp_path, rec)
    append_attempt(tmp_path, rec)
    assert parse_attempts((tmp_path / ATTEMPTS_FILE).read_text()) == [rec, rec]


def test_metrics_rows_are_the_trainers_records(tmp_path: Path):
    it = IterationRecord(iteration=10, train_iters=100, consumed_samples=80, elapsed_ms=12.5, lr=1e-4,
                         global_batch_size=8, lm_loss=math.nan, grad_norm=1.5, tokens_per_s=1e3,
                         tflops_per_worker=0.1, num_skipped_iterations=1, num_nan_iterations=1, phase="run")
    valid = ValidationRecord(iteration=10, consumed_samples=80, lm_loss=4.0, lm_loss_ppl=54.6, train_phase="run")
    path = tmp_path / "metrics.jsonl"
    path.write_text(it.jsonl() + "\n" + valid.jsonl() + "\n" + '{"iteration": 11, "lm_lo')
    rows = read_metrics(path)
    assert [type(r) for r in rows] == [IterationRecord, ValidationRecord]
    assert rows[1] == valid
    # train_iters and num_nan_iterations are the printed line's, not the file's: read back as 0.
    assert (rows[0].iteration, rows[0].num_skipped_iterations, rows[0].train_iters) == (10, 1, 0)
    assert math.isnan(rows[0].lm_loss)


def test_the_atomic_writer_leaves_the_old_file_when_the_new_one_cannot_be_written(tmp_path: Path):
    path = tmp_path / "plan.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})  # not JSON: fails half-way through writing the temporary
    assert json.loads(path.read_text()) == {"a": 1}
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary left behind


def test_submit_writes_the_contract_that_the_trainer_and_status_read(tmp_path: Path, capsys):
    run = tmp_path / "run"
    assert main(["submit", "--recipe", "tiny", "--dry-run", "--out", str(run), "--set", "data.source=synthetic"]) == 0
    spec = read_spec(run)  # what `megatron-hpc train --run-dir` reads
    assert spec.config.name == "tiny" and spec.plan.world_size == 1
    fp = FingerprintRecord.read(run)  # what the node task records after a compile phase
    assert len(fp.sha256) == 64 and fp.inputs["mesh"]["pipeline_parallel"] == spec.plan.pipeline_parallel == 1
    node = (run / "node.sh").read_text()
    assert 'LOG="$RUN_DIR/logs/$PHASE-node$NODE_RANK.log"' in node and '"$RUN_DIR/stop-request"' in node
