"""Checkpoints, round 3: what is restored is what was verified.

The metadata's digest covers the logical names, layout, step and checksums; a step
without checksums is restored with a warning; a step whose "step" disagrees with its
folder is damaged; a damaged manifest, a deleted data file or garbage array metadata
end in one error without Orbax's noise (a real child process); a closed or pathless
Checkpointer is refused. Real Orbax checkpoints, damaged on disk.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from test_checkpoint_faults import _run

import meshplan
from meshplan._checkpoint.integrity import step_directory
from meshplan._checkpoint.metadata import UnverifiedWarning


def _two_steps(folder: Path) -> None:
    w = meshplan.LogicallyPartitioned(jnp.arange(64.0).reshape(8, 8), ("embed", "mlp"))
    with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        for step in (1, 2):
            ckpt.save(step, {"w": w, "b": jnp.full((4,), float(step))})


def _edit(folder: Path, step: int, change) -> None:
    path = Path(step_directory(folder, step)) / "meshplan" / "metadata"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_edited_names_are_a_damaged_step_and_fallback_takes_the_one_before(tmp_path):
    _two_steps(tmp_path)
    _edit(tmp_path, 2, lambda d: d["arrays"]["w"].update(names=["mlp", "embed"]))
    with pytest.raises(meshplan.CheckpointError, match="digest mismatch") as e:
        meshplan.restore(tmp_path)
    assert e.value.problems[0].code == "ckpt-damaged"
    with pytest.warns(UserWarning, match=r"Skipped .*\(step 2\).*digest mismatch"):
        restored = meshplan.restore(tmp_path, fallback=True)
    assert restored.metadata.step == 1
    assert restored.state["w"].names == ("embed", "mlp")


def test_a_step_without_checksums_is_restored_with_a_warning(tmp_path):
    _two_steps(tmp_path)

    def strip(data):
        data.pop("digest")
        for info in data["arrays"].values():
            info.pop("checksum", None)

    _edit(tmp_path, 2, strip)
    with pytest.warns(UnverifiedWarning, match=r"\(step 2\) was restored unverified") as caught:
        restored = meshplan.restore(tmp_path)
    assert "2 of its 2 arrays carry no checksum" in str(caught[0].message)
    np.testing.assert_array_equal(restored.state["b"], np.full(4, 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sealed step: no warning
        meshplan.restore(tmp_path, step=1)


def test_a_step_field_that_disagrees_with_its_folder_is_damaged(tmp_path):
    _two_steps(tmp_path)

    def renumber(data):
        data.pop("digest")
        data["step"] = 99

    _edit(tmp_path, 2, renumber)
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    (problem,) = e.value.problems
    assert problem.code == "ckpt-damaged"
    assert "its metadata says step 99, but it is the folder of step 2" in problem.message
    assert "step=99" not in str(e.value)
    with pytest.warns(UserWarning, match="says step 99"):
        assert meshplan.restore(tmp_path, fallback=True).metadata.step == 1


_RESTORE_EACH = """
import sys, meshplan
for folder in sys.argv[1:]:
    try:
        meshplan.restore(folder)
    except meshplan.CheckpointError as e:
        print("ERROR", e.problems[0].code, str(e).splitlines()[0])
"""


@pytest.mark.slow
def test_a_damaged_manifest_data_file_or_array_metadata_is_one_clear_error(tmp_path):
    folders = []
    for fault in ("manifest", "data-file", "array-metadata"):
        folder = tmp_path / fault
        with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ckpt.save(1, {f"w{i}": jnp.full((256, 64), float(i)) for i in range(12)})
        state = Path(step_directory(folder, 1)) / "state"
        if fault == "manifest":
            for path in state.rglob("manifest.ocdbt"):
                path.write_bytes(b"garbage")
        elif fault == "data-file":
            for path in [*state.glob("d/*"), *state.glob("ocdbt.process_*/d/*")]:
                os.remove(path)
        else:
            for path in (state / "array_metadatas").iterdir():
                path.write_text("{garbage")
        folders.append(str(folder))
    result, _ = _run(_RESTORE_EACH, *folders)
    errors = [line for line in result.stdout.splitlines() if line.startswith("ERROR")]
    assert [line.split()[1] for line in errors] == ["ckpt-damaged"] * 3, result.stdout
    assert "Event loop is closed" not in result.stderr
    assert "Traceback" not in result.stderr and "See full TensorStore" not in result.stdout
    assert len(result.stderr.splitlines()) < 5, result.stderr[-3000:]


def test_a_closed_or_pathless_checkpointer_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(meshplan.ArgumentError, match="the path is empty") as e:
        meshplan.Checkpointer("")
    assert e.value.problems[0].code == "ckpt-empty-path"
    assert os.listdir(tmp_path) == []
    ckpt = meshplan.Checkpointer(tmp_path / "run")
    ckpt.close()
    with pytest.raises(meshplan.CheckpointError, match="is closed") as e:
        ckpt.save(1, {"w": jnp.ones(2)})
    assert e.value.problems[0].code == "ckpt-closed"
    assert "meshplan.Checkpointer(" in e.value.problems[0].fix
