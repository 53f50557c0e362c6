"""Records travel between processes as JSON lines; the parent merges a worker's batches by pid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attndbg.timeline import worker
from attndbg.timeline.records import ProcessRecords, from_json, to_json
from tests.timeline.factory import replay_step


def test_round_trip() -> None:
    records = replay_step(pid=7)
    records.notes.append("a note")
    again = from_json(json.loads(json.dumps(to_json(records))))
    assert again == records


def test_a_record_of_another_shape_is_refused() -> None:
    data = to_json(replay_step())
    data["kernels"][0] = data["kernels"][0][:3]
    with pytest.raises(ValueError, match="Kernel record has 3 fields"):
        from_json(data)


def test_worker_files_merge_by_pid_and_skip_a_cut_line(tmp_path: Path) -> None:
    first, second = replay_step(pid=21), replay_step(pid=21, step=1)
    (tmp_path / "worker-21.jsonl").write_text(json.dumps(to_json(first)) + "\n" + json.dumps(to_json(second)) + "\n" + '{"pid": 21, "ker')
    (tmp_path / "worker-22.jsonl").write_text(json.dumps(to_json(replay_step(pid=22))) + "\n")
    merged = worker.read(tmp_path)
    assert [m.pid for m in merged] == [21, 22]
    assert len(merged[0].kernels) == len(first.kernels) + len(second.kernels)
    assert merged[0].ranges == first.ranges + second.ranges


def test_empty() -> None:
    assert ProcessRecords(pid=1, label="x").empty() and not replay_step().empty()


def test_only_the_launches_external_ids_are_kept() -> None:
    from attndbg.timeline.convert import LaunchExternalIds
    from attndbg.timeline.records import ExternalId

    keep = LaunchExternalIds()
    # 1 and 2 are launches; 3 is another call (a memcpy); 4's launch record comes in the next batch.
    first = keep.keep([ExternalId(1, 10), ExternalId(3, 10), ExternalId(4, 11)], [1, 2])
    assert first == [ExternalId(1, 10)]
    second = keep.keep([ExternalId(2, 10), ExternalId(5, 11)], [4])
    assert second == [ExternalId(4, 11), ExternalId(2, 10)]
    assert keep.keep([], [3, 5]) == [ExternalId(5, 11)]  # 3 waited once and was dropped; 5 waits one batch


def test_kernel_names_are_written_once() -> None:
    records = replay_step()
    data = json.loads(json.dumps(to_json(records)))
    assert sorted(data["kernel_names"]) == sorted({k.name for k in records.kernels}) and all(isinstance(row[0], int) for row in data["kernels"])
    data["kernels"][0][0] = len(data["kernel_names"])
    with pytest.raises(ValueError, match=f"names entry {len(data['kernel_names'])} of {len(data['kernel_names'])} kernel_names"):
        from_json(data)


def test_rows_that_carry_their_kernel_names_are_read() -> None:
    # The form before kernel_names (tests/timeline/data's files, a worker of an older attndbg).
    records = replay_step()
    data = json.loads(json.dumps(to_json(records)))
    table = data.pop("kernel_names")
    data["kernels"] = [[table[row[0]], *row[1:]] for row in data["kernels"]]
    assert from_json(data) == records
