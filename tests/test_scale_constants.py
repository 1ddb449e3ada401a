"""labkit.scale.constants: every hardware figure the cost model reads cites its measurement (issue 34: "every constant
cites a kernel-level measurement ... the notebook lists them all"). Pure file reading, no process."""
from __future__ import annotations

import json
import shutil

from labkit.scale.constants import cited, format_cited, shipped_files, uncited
from labkit.scale.gpu import GPU_DIR


def test_every_shipped_figure_cites_a_source():
    """Every field of every GPU kind, cluster and the allocator's reserve (but name and description) has a source:
    its own key in "sources", the key it shares (a GEMM's shape with its TFLOP/s, the two latencies), or for the
    attention tables one per implementation."""
    assert uncited() == []
    rows = cited()
    files = {r["file"] for r in rows}
    assert {"gpus/h100-sxm.json", "clusters/h100-sxm.json", "scale/allocator.json"} <= files
    assert len(files) == len(shipped_files())
    by = {(r["file"], r["field"]): r for r in rows}
    assert by["gpus/h100-sxm.json", "msmf_shape"]["source"] == by["gpus/h100-sxm.json", "msmf_tflops"]["source"]
    assert "082816f9" in by["gpus/h100-sxm.json", "msmf_tflops"]["source"]
    assert "nccl/issues/1047" in by["clusters/h100-sxm.json", "busbw_by_kind"]["source"]


def test_a_figure_without_its_source_is_named(tmp_path):
    """Planted: the H100 kind's file with the MSMF's source removed: both the MSMF and its shape (which shares that
    source) are named, with the file; the attention tables lose theirs when one implementation's is gone."""
    folder = tmp_path / "gpus"
    folder.mkdir()
    values = json.loads((GPU_DIR / "h100-sxm.json").read_text())
    del values["sources"]["msmf_tflops"], values["sources"]["attention.fa3"]
    (folder / "h100-sxm.json").write_text(json.dumps(values))
    shutil.copy(GPU_DIR / "a100-sxm.json", folder / "a100-sxm.json")
    assert uncited(sorted(folder.glob("*.json"))) == ["gpus/h100-sxm.json: msmf_tflops", "gpus/h100-sxm.json: msmf_shape",
                                                      "gpus/h100-sxm.json: attention"]


def test_the_table_lists_each_figure_once_and_marks_shared_sources():
    text = format_cited(("gpus/h100-sxm.json",))
    lines = text.splitlines()[1:]
    assert len(lines) == len([r for r in cited() if r["file"] == "gpus/h100-sxm.json"])
    shape = next(line for line in lines if " mamf_shape " in line)
    assert shape.rstrip().endswith("(as above)") and "[6144, 17920, 2816]" in shape
